"""What an external agent's approval request does (external.models.ActionRequest; the HTTP side is external.api):
open it (a card in the inbox), tell its state, hand out its one execution ("consume"), record the outcome.

Every change is one transaction that locks the request's run first (the lock order of Approval.decide and
Run.cancel: the run, then what hangs from it), so a consume, a decision, a cancel and an expiry of one request
are serialised, and each reads what the others committed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from approvals import cards, sla
from approvals.models import Approval, Notification, OnExpiry
from approvals.tasks import send_notification
from core import outbound_url, safe_input
from core.access import may_act_unreviewed, may_operate_channel, may_request
from core.models import ActorType, AuditEntry, Channel
from external import schemas
from external.models import ActionRequest, ApprovalMode
from runs import effects
from runs.breakers import BreakerOpen
from runs.effects import shadow_response
from runs.gates import ANY_LEAF, Display, GateSpec, Kind, canonical_hash
from runs.models import EXTERNAL_WORKFLOW, Receipt, Run, Step

MIN_EXPIRES_IN, MAX_EXPIRES_IN = 60, 7 * 24 * 3600

# What the agent is told of a card's status.
_STATUS = {
    Approval.Status.PENDING: "pending",
    Approval.Status.ESCALATED: "pending",
    Approval.Status.APPROVED: "approved",
    Approval.Status.EDITED: "approved",
    Approval.Status.REJECTED: "rejected",
    Approval.Status.EXPIRED: "expired",
    Approval.Status.CANCELLED: "cancelled",
}


def canonical(arguments: Any) -> bytes:
    """The arguments' canonical JSON: sorted keys, no whitespace, UTF-8 (what the digest is of)."""
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def digest(arguments: Any) -> str:
    """SHA-256 hex of the canonical JSON: what an agent names when it consumes an approval."""
    return hashlib.sha256(canonical(arguments)).hexdigest()


class RequestError(Exception):
    """A request, a consume or a result refused: `status` (HTTP), `error` (code) and `detail`; nothing written."""

    status, error = 400, "bad_request"

    def __init__(self, detail: Any, **extra):
        super().__init__(detail if isinstance(detail, str) else json.dumps(detail))
        self.detail = detail
        self.extra = extra


class NotFound(RequestError):
    status, error = 404, "not_found"


class Forbidden(RequestError):
    status, error = 403, "forbidden"


class Invalid(RequestError):
    status, error = 422, "invalid"


class Conflict(RequestError):
    status, error = 409, "conflict"


class AlreadyConsumed(Conflict):
    error = "already_consumed"


class DigestMismatch(Conflict):
    error = "digest_mismatch"


class NotApproved(Conflict):
    error = "not_approved"


class NotConsumed(Conflict):
    error = "not_consumed"


class Stale(Conflict):
    error = "stale"


class RunEnded(Conflict):
    error = "run_ended"


class Locked(RequestError):
    status, error = 423, "locked"


class Unavailable(RequestError):
    status, error = 503, "unavailable"


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
        with transaction.atomic():
            return _open(user, ask, channel, token), True
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


def _open(user, ask: Ask, channel: Channel, token=None) -> ActionRequest:
    run = _run_for(user, ask.run)
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
        request_hash=ask.fingerprint(),
        run=run,
        step_seq=seq,
        channel=channel,
        action=ask.action,
        arguments=ask.arguments,
        schema=ask.schema,
        display=ask.display,
        approval=ask.approval,
        callback_url=ask.callback_url or "",
        expires_at=expires_at,
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
        data={"action": ask.action, "arguments": ask.arguments, "approval": ask.approval},
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
        return schemas.edit_errors(self.schema, edited)


def gate_of(card: Approval) -> GateSpec | None:
    """approvals.edits' resolver for the cards of external runs."""
    request = ActionRequest.objects.filter(card=card).only("schema", "display").first()
    if request is None:
        return None
    return SchemaGate(editable=ANY_LEAF, display=_display(request.display), schema=request.schema)


# --- what the agent is told --------------------------------------------------------------------------------------


def state(request: ActionRequest) -> dict:
    """The request as GET /api/approval-requests/{id} shows it: the decision, what to execute, the execution."""
    card = request.card
    if card is None:  # approval: never
        status, decided_by, decided_at, comment, reason = "approved", "policy", request.created_at, "", ""
        to_execute, edited = request.arguments, False
    else:
        status = _STATUS[card.status]
        last = card.decisions.select_related("actor").order_by("-created_at").first()
        comment, reason = (last.comment, last.reason) if last else ("", "")
        decided_at = card.decided_at
        decided_by = _deciders(card) if status in ("approved", "rejected") else None
        to_execute = card.to_execute if status == "approved" else None
        edited = card.status == Approval.Status.EDITED
    return {
        "id": str(request.id),
        "run_id": str(request.run_id),
        "card_id": request.card_id,
        "channel": request.channel.name,
        "action": request.action,
        "status": status,
        "arguments": to_execute,
        "arguments_digest": digest(to_execute) if to_execute is not None else None,
        "edited": edited,
        "decided_by": decided_by,
        "decided_at": decided_at,
        "comment": comment,
        "reason": reason,
        "expires_at": request.expires_at,
        "shadow": bool(card and card.shadow),
        "execution": execution(request),
    }


def _deciders(card: Approval) -> str:
    decisions = list(card.decisions.select_related("actor").order_by("created_at"))
    if card.status == Approval.Status.REJECTED:
        counted = [d for d in decisions if d.decision == "reject"]
    else:
        last_edit = max((i for i, d in enumerate(decisions) if d.decision == "edit"), default=0)
        counted = [d for d in decisions[last_edit:] if d.decision in ("approve", "edit")]
    return ", ".join(dict.fromkeys(d.actor.get_username() if d.actor else "system" for d in counted)) or "system"


def execution(request: ActionRequest) -> dict:
    """The one execution: not started, pending (consumed, no outcome reported: unknown), succeeded or failed."""
    receipt = request.receipt
    if receipt is None:
        return {"status": "not_started", "consumed_at": None, "completed_at": None, "result": None, "error": ""}
    response = receipt.response or {}
    outcome = "succeeded" if response.get("ok") else "failed"
    status = "pending" if receipt.status == Receipt.Status.PENDING else outcome
    return {
        "status": status,
        "consumed_at": receipt.created_at,
        "completed_at": receipt.completed_at,
        "result": stored_result(response),
        "error": response.get("error", ""),
        "recorded_by": response.get("recorded_by"),
        "note": response.get("note", ""),
    }


def for_user(user, request_id) -> ActionRequest:
    """The request, if it is this user's (NotFound otherwise: another token's requests do not exist for it). A card
    past its deadline has its expiry applied first (approvals.sla.apply_sla), so the agent is never told
    `pending` by a request that expired while no timer job ran."""
    found = ActionRequest.objects.select_related("channel", "card", "receipt", "run").filter(created_by=user)
    request = found.filter(pk=request_id).first()
    if request is None:
        raise NotFound("Not found.")
    card = request.card
    if card is not None and card.status in Approval.OPEN and card.due_at <= timezone.now():
        sla.apply_sla(card.pk)
        request = found.get(pk=request_id)
    return request


# --- its one execution -------------------------------------------------------------------------------------------


def consume(user, request_id, arguments_digest: str, nonce: str = "") -> dict:
    """Go, once: for an approved request whose arguments are the ones named by `arguments_digest`, while no kill
    switch stops its channel. Writes its receipt (pending until the agent reports the outcome). A shadow card's
    action is not to run: the receipt is completed as shadow, and the answer says so (`go: false`).

    `nonce`: the caller's name for this consume. The same nonce asking again while the execution is pending is
    answered with the same go (the first answer was lost on its way: that caller has not run anything yet); any
    other second consume is AlreadyConsumed."""
    with transaction.atomic():
        request = _locked(user, request_id)
        answer = state(request)
        if request.receipt_id is not None:
            if nonce and nonce == request.consume_nonce and answer["execution"]["status"] == "pending":
                return _go(request, answer, shadow=False)
            raise AlreadyConsumed(
                "This approval was consumed already: its execution is what is recorded.", execution=answer["execution"]
            )
        if answer["status"] != "approved":
            raise NotApproved(f"The request is {answer['status']}: there is nothing to execute.")
        if arguments_digest != answer["arguments_digest"]:
            raise DigestMismatch(
                "These are not the approved arguments: GET the request and execute its `arguments` "
                "(a reviewer may have edited them)."
            )
        if (stale_at := consume_by(request)) <= timezone.now():
            raise Stale(
                f"This approval was not used in time (by {stale_at.isoformat()}, APPROVAL_CONSUME_WITHIN): the world "
                "it was given in may have changed. Ask again."
            )
        key = f"external:{request.id}"
        try:
            receipt = effects.open_receipt(
                request.run,
                request.step_seq,
                request.channel.name,
                key,
                step=request.action,
                preview={"call": request.action, **answer["arguments"]},
            )
        except effects.RunEnded as exc:
            raise RunEnded(f"{exc}: this approval is not to be used.") from None
        except effects.ChannelStopped as exc:
            raise Locked(str(exc)) from None
        except BreakerOpen as exc:
            raise Unavailable(str(exc), retry_after=round(exc.delay)) from None
        request.receipt, request.consume_nonce = receipt, nonce
        request.save(update_fields=["receipt", "consume_nonce"])
        if receipt.shadow:
            receipt.complete_outcome({"ok": True, "result": shadow_response(key)})
        Step.objects.filter(run=request.run, seq=request.step_seq).update(
            status=Step.Status.DONE if receipt.shadow else Step.Status.UNKNOWN,
            output={"shadow": shadow_response(key)} if receipt.shadow else None,
            ended_at=timezone.now() if receipt.shadow else None,
        )
        _audit(request, "external.consume", user, {"arguments": answer["arguments"], "shadow": receipt.shadow})
        return _go(request, answer, shadow=receipt.shadow)


def consume_by(request: ActionRequest):
    """When an approval goes stale if nobody consumed it: APPROVAL_CONSUME_WITHIN after the decision (after the ask,
    for `approval: never`), and never later than the request's own expiry plus that window."""
    within = timedelta(seconds=settings.APPROVAL_CONSUME_WITHIN)
    decided_at = request.card.decided_at if request.card is not None else request.created_at
    return min(decided_at + within, request.expires_at + within)


def _go(request: ActionRequest, answer: dict, *, shadow: bool) -> dict:
    return {
        "go": not shadow,
        "shadow": shadow,
        "arguments": answer["arguments"],
        "arguments_digest": answer["arguments_digest"],
        "execution": execution(request),
    }


def report(user, request_id, *, ok: bool, result: Any = None, error: str = "") -> dict:
    """The outcome of the execution the agent consumed: completes its receipt (once; the same outcome sent
    again is answered as recorded; another one, or any after a person recorded it, is a Conflict)."""
    # Any valid JSON (external.api.ResultIn): as jsonb holds it, or as its JSON text where jsonb cannot (storable).
    outcome = {"ok": True, **storable(result)} if ok else {"ok": False, "error": error}
    with transaction.atomic():
        request = _locked(user, request_id)
        receipt = request.receipt
        if receipt is None:
            raise NotConsumed("The approval was not consumed: there is no execution to report on.")
        if receipt.status == Receipt.Status.DONE:
            if not same_outcome(receipt.response, outcome):
                raise Conflict("Another outcome was recorded for this execution.", execution=execution(request))
            return execution(request)
        receipt.complete_outcome(outcome)
        Step.objects.filter(run=request.run, seq=request.step_seq).update(
            status=Step.Status.DONE if ok else Step.Status.FAILED,
            output=storable(result) if ok else None,
            error="" if ok else error[:5000],
            ended_at=timezone.now(),
        )
        _audit(request, "external.result", user, outcome)
        return execution(request)


def _locked(user, request_id) -> ActionRequest:
    """The request, its run locked first (the order of Approval.decide and Run.cancel), then its own row."""
    found = for_user(user, request_id)
    Run.objects.select_for_update().filter(pk=found.run_id).exists()
    return (
        ActionRequest.objects.select_for_update(of=("self",))
        .select_related("channel", "card", "receipt", "run")
        .get(pk=found.pk)
    )


def _audit(request: ActionRequest, action: str, user, data: dict, actor_type: str = ActorType.AGENT) -> None:
    AuditEntry.record(
        action,
        actor=user,
        actor_type=actor_type,
        target=f"action_request:{request.id}",
        run_id=request.run_id,
        approval_id=request.card_id,
        channel=request.channel.name,
        trace_id=request.run.trace_id,
        data={"action": request.action, **data},
    )


# --- when its card closes ----------------------------------------------------------------------------------------


def card_closed(sender, card: Approval, **_) -> None:
    """approvals.models.card_closed: a rejected or expired request's step ends; its callback (if any) is written
    with its job, in the decision's transaction (sent, signed and retried, by the `outbound` queue)."""
    request = ActionRequest.objects.select_related("channel", "run").filter(card=card).first()
    if request is None:
        return
    request.card = card
    answer = state(request)
    if answer["status"] in ("rejected", "expired"):
        Step.objects.filter(run=request.run, seq=request.step_seq).update(
            status=Step.Status.DONE,
            output={"decision": answer["status"], "comment": answer["comment"], "by": answer["decided_by"]},
            ended_at=timezone.now(),
        )
    if request.callback_url:
        notification = Notification.objects.create(
            approval=card,
            event="external.decision",
            backend="callback",
            payload={
                "url": request.callback_url,
                "body": json.loads(json.dumps(answer, default=str)),
                "user_id": request.created_by_id,
                "token_id": request.api_token_id,  # whose secret signs it (else every live token of the user's)
            },
        )
        send_notification.defer(notification_id=notification.pk)


# --- any JSON result, stored -------------------------------------------------------------------------------------
# An agent's result is whatever its system answered (core.safe_input: any valid JSON). PostgreSQL's jsonb keeps
# integers of any size exactly (numeric) but refuses a NUL character in a string or a key (and a lone surrogate
# cannot be encoded at all): such a result is kept as its JSON text, under `result_json` instead of `result`, in
# the receipt, the step's output and the audit entry alike, and answered as the value it stands for.


def _jsonb_holds(value: Any) -> bool:
    """Whether jsonb stores `value` as it is: no string or key with a NUL or a lone surrogate. Walked without
    recursion, as safe_input.check is."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if safe_input.unsafe_char(item):
                return False
        elif isinstance(item, dict):
            if any(safe_input.unsafe_char(key) for key in item):
                return False
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def storable(result: Any) -> dict:
    """A result as the console stores it: {"result": value}, or {"result_json": its JSON text} (ASCII: the NUL
    and any surrogate written as \\u escapes) when jsonb cannot hold it."""
    if _jsonb_holds(result):
        return {"result": result}
    return {"result_json": json.dumps(result, ensure_ascii=True, sort_keys=True)}


def stored_result(stored: dict) -> Any:
    """The value a stored outcome (or a step's output) holds: the inverse of storable."""
    if "result_json" in stored:
        return json.loads(stored["result_json"])
    return stored.get("result")


def same_outcome(stored: dict | None, outcome: dict) -> bool:
    """Whether a recorded outcome is `outcome` (an agent's retry after a lost answer): the same JSON, compared as
    text so that true is not 1 and 1 is not 1.0 (Python's == says they are)."""

    def text(value: dict) -> str:
        fields = {key: item for key, item in value.items() if key not in ("result", "result_json")}
        return json.dumps({**fields, "result": stored_result(value)}, ensure_ascii=True, sort_keys=True)

    return stored is not None and text(stored) == text(outcome)


# --- an outcome recorded by a person ----------------------------------------------------------------------------

OUTCOME_TEXT_MAX = 5000


def record_outcome(user, run_id, step_seq: int, *, outcome: str, text: str) -> dict:
    """A person records the outcome of an execution that is "outcome unknown" (the agent consumed its approval
    and never reported what happened: it crashed, or its result was lost), from the run page: `outcome`
    succeeded (`text` says how they know) or failed (`text` is the error). Only someone with `operate_channel`
    on the request's channel may (Forbidden otherwise). Once, like the agent's result: the pending receipt is
    completed by compare-and-swap, marked reconciled (completed by a person, not the call); a second record is a
    Conflict, and so is the agent's later result (report). Audited `external.result` with the person as actor
    (`by_hand`). Returns the execution as the agent now reads it."""
    text = (text or "").strip()
    if outcome not in ("succeeded", "failed"):
        raise Invalid("The outcome is succeeded or failed.")
    if not text:
        raise Invalid(
            "Say how you know it succeeded (a note)." if outcome == "succeeded" else "Say how you know: the error."
        )
    if len(text) > OUTCOME_TEXT_MAX:
        raise Invalid(f"The note is at most {OUTCOME_TEXT_MAX} characters.")
    if why := safe_input.unsafe_char(text):
        raise Invalid(f"The note contains {why}.")
    ok = outcome == "succeeded"
    with transaction.atomic():
        # The lock order of report and Approval.decide: the run first, then the request.
        Run.objects.select_for_update().filter(pk=run_id).exists()
        request = (
            ActionRequest.objects.select_for_update(of=("self",))
            .select_related("channel", "card", "receipt", "run")
            .filter(run_id=run_id, step_seq=step_seq)
            .first()
        )
        if request is None:
            raise NotFound("No approval request at this step of the run.")
        if not may_operate_channel(user, request.channel):
            raise Forbidden(
                f"Only someone with operate_channel on {request.channel.name} may record the outcome of its actions."
            )
        receipt = request.receipt
        if receipt is None:
            raise NotConsumed("The approval was not consumed: nothing was executed, there is no outcome to record.")
        if receipt.status == Receipt.Status.DONE:
            raise Conflict("The outcome was recorded already: it stays as it is.", execution=execution(request))
        by = user.get_username()
        said = {"result": None, "note": text} if ok else {"error": text}
        receipt.complete_outcome({"ok": ok, **said, "recorded_by": by})
        Receipt.objects.filter(pk=receipt.pk).update(reconciled=True)
        Step.objects.filter(run=request.run, seq=request.step_seq).update(
            status=Step.Status.DONE if ok else Step.Status.FAILED,
            output={"recorded_by": by, "note": text} if ok else None,
            error="" if ok else text,
            ended_at=timezone.now(),
        )
        said_by_hand = {"ok": ok, "by_hand": True, **({"note": text} if ok else {"error": text})}
        _audit(request, "external.result", user, said_by_hand, actor_type=ActorType.HUMAN)
        return execution(request)
