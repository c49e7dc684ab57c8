"""The one door for cards: every card, a workflow gate's (approvals.gates.CardBackend.open) or an external agent's
request (external.asks), opens through `open_card`, so that the rules of a card are written once.

What the door gives every card:
- its approval policy (approvals.models.ApprovalPolicy.for_card: the one the gate names, else the channel's for the
  step or the tool (`tool:<action>` for an external agent's action), else the channel's own), as a snapshot the card
  keeps, starting at its first stage (who it asks, its SLA); without one, the channel's own rule as a one-stage
  policy (approvals.rules.channel_rule: `required_approvals` of anyone who may approve the channel, its SLA policy),
  so that Approval.decide has one count (approvals.rules.PolicyCount);
- its deadline: the stage's SLA, or under the channel's rule the channel's own, never later than a hard end
  (`expires_at`: an external request's `expires_in`), at which the card expires whatever its stage
  (approvals.sla.apply_sla);
- shadow mode as the channel and workflow say when it opens (an action card only);
- its SLA timer, deferred in the caller's transaction: the timer exists if and only if the card does;
- personal data as references (approvals.personal): the values its proposal's schema marks `x-pii` (`schema`:
  the gate's proposal model's, an external request's own) sealed, and the run's personal values anywhere else on
  it (its summary, the current state) replaced by their references, before the card and its args hash are
  written: the hash is over references, which every view shows masked.

Approval.decide is the one door of a decision, and compares `now` with the deadline there."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime

import structlog
from django.utils import timezone

from approvals import personal, rules, sla
from approvals.models import Approval, ApprovalPolicy, OnExpiry
from core import tracing
from core.models import Channel
from runs.gates import ApprovalRequest, Kind

log = structlog.get_logger("approvals.cards")


@dataclass(frozen=True)
class CardSpec:
    """What a card asks and shows: the proposal, the state it changes, why, and its display columns."""

    kind: str
    proposed: dict
    args_hash: str
    current: dict | None = None
    summary: str = ""
    rule_id: str = ""
    confidence: float | None = None
    citations: list = field(default_factory=list)
    risk: str = "medium"
    display: dict = field(default_factory=dict)  # headline, amount_minor, currency (runs.gates.Display.values)
    schema: dict | None = None  # the proposal's JSON Schema: what it marks `x-pii` is sealed (approvals.personal)


def policy_for(channel: Channel, *, step: str = "", tool: str = "", named: str = "") -> dict:
    """The snapshot of the approval policy a card on `channel` follows (ApprovalPolicy.for_card), else the channel's
    own rule as a one-stage policy (approvals.rules.channel_rule). A gate naming a policy that does not exist gets
    one that fails closed (ApprovalPolicy.missing: nobody may approve it, rejected at the channel's SLA), which its
    card page shows."""
    try:
        found = ApprovalPolicy.for_card(channel, step=step, tool=tool, named=named)
    except LookupError:
        log.error("a gate names an approval policy that does not exist: its card fails closed", policy=named)
        return ApprovalPolicy.missing(named, channel)
    return found.snapshot() if found is not None else rules.channel_rule(channel)


def keep_references(run, channel: Channel, spec: CardSpec) -> CardSpec:
    """`spec` as the card keeps it: personal data as references (approvals.personal.card_proposal), and the args
    hash over them when that changed the proposal (runs.gates.ApprovalRequest.args_hash, the one formula)."""
    proposed = personal.card_proposal(run.pk, spec.proposed, spec.schema)
    display = {**spec.display, "headline": personal.scrub_for_run(run.pk, spec.display.get("headline", ""))}
    kept = replace(
        spec,
        proposed=proposed,
        current=personal.scrub_for_run(run.pk, spec.current),
        summary=personal.scrub_for_run(run.pk, spec.summary),
        citations=personal.scrub_for_run(run.pk, spec.citations),
        display=display if "headline" in spec.display else spec.display,
    )
    if proposed != spec.proposed:
        question = ApprovalRequest(channel=channel.name, proposed=proposed, current=kept.current, kind=spec.kind)
        kept = replace(kept, args_hash=question.args_hash())
    return kept


def open_card(
    run,
    seq: int,
    channel: Channel,
    spec: CardSpec,
    *,
    policy: dict | None,
    expires_at: datetime | None = None,
    due_by: datetime | None = None,
    on_expiry: str = OnExpiry.CHANNEL,
) -> Approval:
    """Open the card of step `seq` of `run` (in the caller's transaction, which holds the run's row): its policy's
    first stage, its deadline, its timer. `policy`: policy_for's snapshot (None: the channel's own rule).
    `expires_at`: a hard end (no deadline is later, and the card expires
    then); `due_by`: its first deadline at the latest (an external request that escalates once at `expires_in`)."""
    now = timezone.now()
    policy = policy or rules.channel_rule(channel)
    spec = keep_references(run, channel, spec)
    card = Approval(
        **spec.display,
        run=run,
        step_seq=seq,
        kind=spec.kind,
        channel=channel,
        proposed=spec.proposed,
        current=spec.current,
        summary=spec.summary,
        rule_id=spec.rule_id,
        confidence=spec.confidence,
        citations=spec.citations,
        risk=spec.risk,
        # Shadow mode is read as the card opens. Only a proposed action is shadowed: a reconcile card asks about a
        # write that was really attempted, and a budget card about the run's own spending.
        shadow=spec.kind == Kind.ACTION and Channel.in_shadow(channel.name, run.workflow),
        args_hash=spec.args_hash,
        due_at=expires_at or due_by or now + channel.sla,
        expires_at=expires_at,
        on_expiry=on_expiry,
        # The card keeps the policy as it is now (a channel's rule too: its one stage asks anyone who may approve
        # the channel, the columns' defaults).
        policy=policy,
        # Under the span that opens it (the parking step's, an approval request's): its wait's parent.
        trace_parent=tracing.traceparent_of() if tracing.ENABLED else "",
    )
    if not rules.is_channel_rule(policy):
        # An admin's policy: the card starts at its first stage (its SLA, who it asks). Under the channel's rule its
        # deadline stays the channel's, as it always was (an external request's `expires_in` may exceed the SLA).
        card.enter_stage(0, now)
    if due_by is not None:
        card.due_at = min(card.due_at, due_by)
    card.save(force_insert=True)
    sla.schedule_timer(card)
    return card
