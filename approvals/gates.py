"""The approvals app's side of runs.gates: parked requests become cards, decisions come back to the engine."""

from __future__ import annotations

from dataclasses import replace

import structlog
from django.utils import timezone

from approvals import cards, personal, rules
from approvals.models import Approval, card_closed
from core import pii, tracing
from core.models import Channel
from runs import workflow as workflows
from runs.errors import Fatal, UnknownWorkflow
from runs.gates import ApprovalRequest, Decision, Kind, Outcome

log = structlog.get_logger("approvals.gates")


class CardBackend:
    def open(self, run, seq: int, request: ApprovalRequest) -> None:
        channel = Channel.objects.filter(name=request.channel).first()
        if channel is None:
            raise Fatal(f"the workflow asks for a decision on channel {request.channel!r}, which does not exist")
        schema = _schema_of(run, seq, request)
        # The card keeps references (approvals.cards.keep_references): the question is asked over them.
        request = _as_kept(run, request, schema, create=True)
        args_hash = request.args_hash()
        open_card = Approval.objects.filter(run=run, step_seq=seq, status__in=Approval.OPEN).first()
        if open_card is not None:
            if open_card.args_hash == args_hash:
                return  # parked again on the same question (a resumed job): keep the card
            open_card.status, open_card.decided_at = Approval.Status.CANCELLED, timezone.now()
            open_card.save(update_fields=["status", "decided_at"])
        # Without display hints when this process cannot resolve the gate (an edit of the card is refused then).
        display = Approval(run=run, step_seq=seq, kind=request.kind).display_of(request.proposed)
        spec = cards.CardSpec(
            kind=request.kind,
            proposed=request.proposed,
            args_hash=args_hash,
            current=request.current,
            summary=request.summary,
            rule_id=request.rule_id,
            confidence=request.confidence,
            citations=request.citations,
            risk=request.risk,
            display=display,
            schema=schema,
        )
        cards.open_card(run, seq, channel, spec, policy=_policy_of(run, seq, channel, request))

    def decision(self, run, seq: int, request: ApprovalRequest) -> Decision | None:
        # The card's hash is over the references it keeps: the request, asked again with clear values, is found by
        # the references they were sealed as (nothing new is sealed to find it).
        kept = _as_kept(run, request, _schema_of(run, seq, request), create=False)
        hashes = {request.args_hash(), kept.args_hash()}
        card = (
            Approval.objects.filter(run=run, step_seq=seq, args_hash__in=hashes, status__in=Approval.DECIDED)
            .prefetch_related("decisions__actor")
            .order_by("-decided_at")
            .first()
        )
        return _decision_of(card) if card is not None else None

    def decided(self, run, seq: int) -> Decision | None:
        card = (
            Approval.objects.filter(run=run, step_seq=seq, kind=Kind.ACTION, status__in=Approval.DECIDED)
            .prefetch_related("decisions__actor")
            .order_by("-decided_at")
            .first()
        )
        return _decision_of(card) if card is not None else None

    def shadow_of(self, run, seq: int, channel: str) -> bool | None:
        return (
            Approval.objects.filter(
                run=run, step_seq__lte=seq, channel__name=channel, kind=Kind.ACTION, status__in=Approval.DECIDED
            )
            .order_by("-step_seq", "-decided_at")
            .values_list("shadow", flat=True)
            .first()
        )

    def close_pending(self, run, status: str) -> None:
        """The run's open cards close (its cancel, in its transaction, the run's row locked: no decision is under
        way); each is announced as closed (approvals.models.card_closed: a posted Slack message loses its buttons)."""
        open_cards = Approval.objects.filter(run=run, status__in=Approval.OPEN)
        closed, now = list(open_cards), timezone.now()
        open_cards.filter(pk__in=[card.pk for card in closed]).update(status=status, decided_at=now)
        for card in closed:
            card.status, card.decided_at = status, now
            card_closed.send(Approval, card=card)


def _schema_of(run, seq: int, request: ApprovalRequest) -> dict | None:
    """The JSON Schema of the gate's proposal (what it marks `x-pii`), or None."""
    return personal.schema_of(Approval(run=run, step_seq=seq, kind=request.kind))


def _as_kept(run, request: ApprovalRequest, schema: dict | None, *, create: bool) -> ApprovalRequest:
    """The request with its proposal as its card keeps it (approvals.personal.card_proposal). A proposal that lacks
    the subject its schema names cannot be sealed: the step fails (Fatal), nothing is shown in clear."""
    try:
        return replace(request, proposed=personal.card_proposal(run.pk, request.proposed, schema, create=create))
    except pii.SchemaError as exc:
        raise Fatal(f"the gate's proposal cannot be sealed: {exc}") from None


def _policy_of(run, seq: int, channel: Channel, request: ApprovalRequest) -> dict | None:
    """The approval policy a card of this request follows (approvals.cards.policy_for): the one its gate names in
    code, else the channel's for its step or its agent tool, else the channel's own; None: the channel's rule."""
    try:
        step = workflows.get(run.workflow, run.workflow_version).step_of(run, seq)
    except UnknownWorkflow:
        step = None  # a workflow this process does not know: its channel's policy
    spec = step.gate if step is not None else None
    tool = request.rule_id.removeprefix("tool:") if request.rule_id.startswith("tool:") else ""
    return cards.policy_for(
        channel, step=step.name if step is not None else "", tool=tool, named=spec.policy if spec is not None else ""
    )


def _decision_of(card: Approval) -> Decision:
    """The engine's view of a decided card (its decisions prefetched). What executes is `card.to_execute`, what
    the card page, the inbox and the API showed: under the two-person rule the last edit, which the second
    person approved, else the proposal as it stands; nothing after a rejection."""
    tracing.link(card.trace_parent)  # the step that reads the decision follows from the person's wait (its span)
    decisions = sorted(card.decisions.all(), key=lambda d: (d.created_at, d.pk))
    last, outcome = decisions[-1], Outcome(card.status)
    # Those whose decisions made the outcome (rules.counted): who approved what executes, from its last change
    # on (an edit restarts the two-person count), or who rejected it.
    deciders = rules.counted(decisions, outcome)
    return Decision(
        decision=outcome,
        payload=card.to_execute,
        comment=last.comment,
        reason=last.reason,
        by=", ".join(dict.fromkeys(d.actor.username if d.actor else "system" for d in deciders)),
        proposed=card.proposed,
        undo=outcome == Outcome.REJECTED and any(d.undo for d in deciders),
    )
