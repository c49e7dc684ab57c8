"""An external agent asks a person to sign off one action (external.models.ActionRequest; the HTTP side is
external.api): the request opened in one transaction, with its step on the agent's run, its card in the inbox
(through approvals.cards, the one door of cards) and that card's SLA timer; and the card's gate, what a reviewer's
edit must fit (the JSON Schema the agent sent).

What the agent is told of it next is external.status; its one execution, external.executions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from django.db import IntegrityError
from django.utils import timezone

from approvals import cards, personal
from approvals.models import Approval, OnExpiry
from core import outbound_url
from core.access import may_act_unreviewed, may_request
from core.models import ActorType, AuditEntry, Channel
from external import schemas
from external.errors import Conflict, Forbidden, Invalid, NotFound, Unavailable
from external.models import ActionRequest, ApprovalMode
from runs import group_commit
from runs.gates import ANY_LEAF, Display, GateSpec, Kind, canonical_hash
from runs.models import EXTERNAL_WORKFLOW, Run, Step

MIN_EXPIRES_IN, MAX_EXPIRES_IN = 60, 7 * 24 * 3600


# --- opening a request -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """What an agent asks (POST /api/approval-requests), its fields checked for shape by the API's schema."""

    channel: str
    action: str
    arguments: dict
    idempotency_key: str
    current: dict | None = None
    rationale: str | dict | None = None
    risk: str = "medium"
    display: dict | None = None
    schema: dict | None = None
    run: str | None = None
    callback_url: str | None = None
    expires_in: int | None = None
    on_expiry: str = "reject"
    approval: str = ApprovalMode.REQUIRED

    def fingerprint(self) -> str:
        """What makes two asks under one key the same request: the action and its arguments, on its channel. The
        rest describes the moment it was asked (an agent re-run after a crash sees another `current`): the first
        ask's stands."""
        return canonical_hash({"channel": self.channel, "action": self.action, "arguments": self.arguments})


def open_request(user, ask: Ask, *, console_host: str = "", token=None) -> tuple[ActionRequest, bool]:
    """Open the request (its step on the agent's run, its card in the inbox, its SLA timer) in one transaction:
    (request, True). The same key asking the same again gives (the request, False); another ask under it is a
    Conflict. `console_host` (host:port the call came to) is, with CONSOLE_URL, what a callback may not point at
    (core.outbound_url: nor at loopback, link-local or, unless allowed, private addresses)."""
    existing = ActionRequest.objects.filter(created_by=user, idempotency_key=ask.idempotency_key).first()
    if existing is not None:
        return _same(existing, ask), False
    channel = _channel_for(user, ask)
    _check(ask, console_host)
    try:
        # In one transaction with other asks (and deliveries) that come at the same time (runs.group_commit); the
        # idempotency key makes it safe to do again when that transaction's outcome is unknown.
        return group_commit.atomic(lambda: _open(user, ask, channel, token)), True
    except IntegrityError:
        # The same key sent twice at once: the other transaction's insert won the unique index.
        existing = ActionRequest.objects.filter(created_by=user, idempotency_key=ask.idempotency_key).first()
        if existing is None:
            raise
        return _same(existing, ask), False


def _same(existing: ActionRequest, ask: Ask) -> ActionRequest:
    if existing.request_hash != ask.fingerprint():
        raise Conflict(f"idempotency key {ask.idempotency_key!r} was used for another request ({existing.id})")
    return existing


def _channel_for(user, ask: Ask) -> Channel:
    channel = Channel.objects.filter(name=ask.channel).first()
    if channel is None:
        raise NotFound(f"No channel {ask.channel!r}.")
    if not may_request(user, channel):
        raise Forbidden(f"This token may not ask for approvals on {channel.name} (no request_channel there).")
    if ask.approval == ApprovalMode.NEVER and not may_act_unreviewed(user, channel):
        raise Forbidden(
            f"This token may not act on {channel.name} without a person's approval (no act_unreviewed there)."
        )
    return channel


def _check(ask: Ask, console_host: str) -> None:
    """What the API's schema cannot say: a valid JSON Schema that the arguments fit, a callback elsewhere."""
    if ask.schema is not None and (errors := schemas.ask_errors(ask.schema, ask.arguments)):
        raise Invalid(errors)
    if ask.callback_url:
        try:
            outbound_url.check(ask.callback_url, console=[console_host])
        except outbound_url.Refused as exc:
            if exc.transient:
                raise Unavailable(f"callback_url: {exc.detail}; ask again in a moment") from None
            raise Invalid([{"loc": "callback_url", "msg": exc.detail}]) from None


def open_compensation(original: ActionRequest, run: Run, ask: Ask, undo_order: int) -> ActionRequest:
    """A compensation's request (external.undo): what undoes `original`'s execution, asked of the same agent (its
    user and token, its callback) on the same channel, through the same door as any request (the channel's
    permission to ask, its approval policy, the two-person rule, the SLA), on `run`, which the caller locked and
    began undoing (`compensating`: no request of the agent's own may join it). Always a person's: a card."""
    channel = _channel_for(original.created_by, ask)
    return _open(
        original.created_by,
        ask,
        channel,
        original.api_token,
        run=run,
        compensates=original,
        undo_order=undo_order,
        callback_url=original.callback_url,
    )


def _open(
    user,
    ask: Ask,
    channel: Channel,
    token=None,
    *,
    run: Run | None = None,
    compensates: ActionRequest | None = None,
    undo_order: int | None = None,
    callback_url: str = "",
) -> ActionRequest:
    run = run or _run_for(user, ask.run)
    # What the console keeps holds references: the values the agent's schema marks `x-pii` sealed under the run
    # (approvals.personal, as its card keeps them); the fingerprint of a repeated ask is of what the agent sent.
    fingerprint = ask.fingerprint()
    ask = replace(ask, arguments=personal.card_proposal(run.pk, ask.arguments, ask.schema))
    seq = ActionRequest.objects.filter(run=run).count()
    expires_at = timezone.now() + (timedelta(seconds=ask.expires_in) if ask.expires_in else channel.sla)
    Step.objects.create(
        run=run,
        seq=seq,
        name=ask.action[:100],
        kind=Step.Kind.EFFECT,
        input={"arguments": ask.arguments},
        input_hash=canonical_hash(ask.arguments),
        status=Step.Status.WAITING,
        started_at=timezone.now(),
    )
    request = ActionRequest(
        created_by=user,
        api_token=token,
        idempotency_key=ask.idempotency_key,
        request_hash=fingerprint,
        run=run,
        step_seq=seq,
        channel=channel,
        action=ask.action,
        arguments=ask.arguments,
        schema=ask.schema,
        display=ask.display,
        approval=ask.approval,
        callback_url=ask.callback_url or callback_url,
        expires_at=expires_at,
        compensates=compensates,
        undo_order=undo_order,
    )
    if ask.approval == ApprovalMode.REQUIRED:
        request.card = _open_card(run, seq, channel, ask, expires_at)
    request.save(force_insert=True)
    AuditEntry.record(
        "external.request",
        actor=user,
        actor_type=ActorType.AGENT,
        target=f"action_request:{request.id}",
        run_id=run.id,
        approval_id=request.card_id,
        channel=channel.name,
        trace_id=run.trace_id,
        data={
            "action": ask.action,
            "arguments": ask.arguments,
            "approval": ask.approval,
            **({"compensates": str(compensates.id), "undo_order": undo_order} if compensates is not None else {}),
        },
    )
    return request


def _run_for(user, run_id: str | None) -> Run:
    """The agent's run (its session): the one it names, locked; else a new one."""
    if run_id is None:
        return Run.objects.create(
            workflow=EXTERNAL_WORKFLOW,
            workflow_version=1,
            input={},
            status=Run.Status.EXTERNAL,
            created_by=user,
            max_attempts=1,
        )
    run = Run.objects.select_for_update().filter(pk=run_id, created_by=user, workflow=EXTERNAL_WORKFLOW).first()
    if run is None:
        raise NotFound(f"No external run {run_id} of this token's user.")
    if run.status != Run.Status.EXTERNAL:
        raise Conflict(f"The run {run_id} is {run.status}: open a new one (leave `run` out).")
    return run


def _open_card(run: Run, seq: int, channel: Channel, ask: Ask, expires_at) -> Approval:
    """The request's card, through the one door of cards (approvals.cards): the channel's approval policy for the
    action (`tool:<action>`, else the channel's own) applies to it as to a workflow's gate. `on_expiry: reject` makes
    `expires_in` a hard end, whatever the policy's stages; `escalate` lets the card escalate once (the channel's
    escalation, or the policy's levels) before it expires."""
    rationale = ask.rationale if isinstance(ask.rationale, dict) else {"summary": ask.rationale or ""}
    spec = cards.CardSpec(
        kind=Kind.ACTION,
        proposed=ask.arguments,
        args_hash=canonical_hash({"kind": Kind.ACTION, "channel": channel.name, "proposed": ask.arguments}),
        current=ask.current,
        summary=rationale.get("summary") or f"The agent wants to run {ask.action}.",
        rule_id=(rationale.get("rule_id") or f"external:{ask.action}")[:100],
        confidence=rationale.get("confidence"),
        citations=rationale.get("citations") or [],
        risk=ask.risk,
        display=_display(ask.display).values(ask.arguments),
        schema=ask.schema,
    )
    escalate = ask.on_expiry == "escalate"
    return cards.open_card(
        run,
        seq,
        channel,
        spec,
        policy=cards.policy_for(channel, tool=ask.action),
        expires_at=None if escalate else expires_at,
        due_by=expires_at,
        on_expiry=OnExpiry.ESCALATE if escalate else OnExpiry.EXPIRE,
    )


def _display(paths: dict | None) -> Display:
    paths = paths or {}
    return Display(
        headline=paths.get("headline"), amount_minor=paths.get("amount_minor"), currency=paths.get("currency")
    )


# --- the card's gate: edits against the request's schema ---------------------------------------------------------


@dataclass(frozen=True)
class SchemaGate(GateSpec):
    """An external request's card: an edit must fit the JSON Schema the agent sent; without one, the card is
    approved or rejected, never edited."""

    schema: dict | None = None

    def accepts_edits(self) -> bool:
        return self.schema is not None

    def edit_errors(self, proposed: dict, edited: Any) -> list[dict]:
        if not isinstance(edited, dict):
            return [{"loc": "payload", "msg": "must be an object"}]
        if self.schema is None:
            return [{"loc": "payload", "msg": "the agent sent no schema for this action: approve or reject it"}]
        return schemas.edit_errors(self.schema, edited)  # opened by approvals.edits.edit_errors


def gate_of(card: Approval) -> GateSpec | None:
    """approvals.edits' resolver for the cards of external runs."""
    request = ActionRequest.objects.filter(card=card).only("schema", "display").first()
    if request is None:
        return None
    return SchemaGate(editable=ANY_LEAF, display=_display(request.display), schema=request.schema)
