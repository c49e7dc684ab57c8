"""The rules of a decision, each written once: what a decision must carry, who may take it, the one count
(PolicyCount: a channel's own rule, the two-person rule, is its one-stage policy), the outcome it gives the engine,
and the SLA state with its due-soon threshold. Approval.decide applies them; the card page, the inbox, the API
and the engine's side of the gate (approvals.gates) read the same functions.

A leaf of the approvals app: it knows cards by their fields, never imports approvals.models, and the models
import it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.contrib.auth import get_user_model
from django.db import models
from django.db.models import Case, CharField, Q, Value, When

from approvals import edits
from approvals.errors import (
    AlreadyDecided,
    CannotCheckEdit,
    InvalidDecision,
    NotAllowed,
    SecondApproverNeeded,
    StaleVersion,
)
from core.access import may_approve
from runs.gates import Kind, Outcome

if TYPE_CHECKING:
    from approvals.models import Approval, Decision
    from core.models import Channel


class DecisionKind(models.TextChoices):
    """What a person answers a card."""

    APPROVE = "approve"
    EDIT = "edit"
    REJECT = "reject"


class Agreement(models.TextChoices):
    """On a shadow card: whether the reviewer, who did the action by hand, agrees with what the agent proposed."""

    AGREE = "agree", "I agree with the agent"
    DISAGREE = "disagree", "I disagree with the agent"


DONE_BY_HAND_MAX = 5000


# --- what a decision carries -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Asked:
    """A decision as asked, checked before anything is locked: a rejection says why, an edit brings its payload,
    and a shadow card's agreement is one of Agreement's."""

    decision: DecisionKind
    comment: str = ""
    reason: str = ""
    payload: dict | None = None
    agreement: str = ""
    done_by_hand: str = ""
    undo: bool = False  # "reject and undo": what the run did is undone too (runs.compensations)

    @classmethod
    def of(
        cls,
        decision: str,
        *,
        comment: str = "",
        reason: str = "",
        payload: Any = None,
        agreement: str = "",
        done_by_hand: str = "",
        undo: bool = False,
    ) -> Asked:
        if decision not in DecisionKind.values:
            raise InvalidDecision(f"decision must be approve, edit or reject, not {decision!r}")
        comment = (comment or "").strip()
        if decision == DecisionKind.REJECT and not comment:
            raise InvalidDecision("a rejection needs a comment saying why")
        if decision == DecisionKind.EDIT and not isinstance(payload, dict):
            raise InvalidDecision("an edit needs the new payload (an object)")
        agreement, done_by_hand = agreement or "", (done_by_hand or "").strip()
        if agreement and agreement not in Agreement.values:
            raise InvalidDecision(f"agreement must be agree or disagree, not {agreement!r}")
        if len(done_by_hand) > DONE_BY_HAND_MAX:
            raise InvalidDecision(f"what you did is longer than {DONE_BY_HAND_MAX} characters")
        if undo and decision != DecisionKind.REJECT:
            raise InvalidDecision("only a rejection can also undo what the run did")
        return cls(
            DecisionKind(decision),
            comment=comment,
            reason=reason or "",
            payload=payload if decision == DecisionKind.EDIT else None,
            agreement=agreement,
            done_by_hand=done_by_hand,
            undo=bool(undo),
        )


# --- who may decide ----------------------------------------------------------------------------------------


def started_the_run(user, card: Approval) -> bool:
    """Separation of duties: nobody decides a card of a run they started."""
    return card.run.created_by_id == getattr(user, "pk", None)


def decider_refusal(actor, card: Approval, covering: Iterable[int] = ()) -> str:
    """Why `actor` may not decide `card`, or "" when they may. Who may decide a card: a person with
    `approve_channel` on its channel (core.access.may_approve; a superuser holds it everywhere) who did not start
    its run, and, on a card opened under an approval policy, whom its current stage asks (or who covers for
    someone it names: `covering`, approvals.models.Delegation.covered_by). The system (no actor: approvals.sla)
    always may. Approval.decide applies it to every caller; the pages and the API ask approvals.access.card_for,
    which applies it too."""
    if actor is None:
        return ""
    if not may_approve(actor, card.channel):
        return f"you may not decide cards on {card.channel.name} (no approve_channel there)"
    if started_the_run(actor, card):
        return "you started this run: someone else must decide its cards"
    return policy_refusal(actor, card, covering)


# --- the checks of Approval.decide, in order -----------------------------------------------------------------


def check(actor, card: Approval, asked: Asked, version: int | None, covering: Iterable[int] = ()) -> None:
    """Everything that refuses `asked` on `card` (locked, re-read) before anything is written: who decides, whether
    the card is still open as the person saw it, whether the decision fits the card."""
    if refusal := decider_refusal(actor, card, covering):
        raise NotAllowed(refusal)
    if card.status not in card.OPEN:
        raise AlreadyDecided(card)
    if version is not None and version != card.version:
        raise StaleVersion(card, version)
    if card.shadow and not asked.agreement:
        raise InvalidDecision("this is a shadow card: say whether you agree with the agent (agree or disagree)")
    if not card.shadow and (asked.agreement or asked.done_by_hand):
        raise InvalidDecision("agreement and what you did by hand are recorded on shadow cards only")
    check_what_would_execute(card, asked)


def check_what_would_execute(card: Approval, asked: Asked) -> None:
    """An edit must pass the card's validator (approvals.edits), which must be able to find the card's gate; an
    approval of a budget card must keep the limit within its ceiling."""
    try:
        if asked.decision == DecisionKind.EDIT and (errors := edits.edit_errors(card, asked.payload)):
            raise InvalidDecision(f"this edit is not allowed: {edits.as_text(errors)}", errors)
    except edits.GateUnresolved as exc:
        raise CannotCheckEdit(str(exc)) from exc
    if asked.decision == DecisionKind.APPROVE and (refusal := edits.approval_refusal(card)):
        raise InvalidDecision(f"this card cannot be approved: {refusal}")


# --- the count since the last change ----------------------------------------------------------------------------


def counted(decisions: Sequence[Decision], toward: str) -> list[Decision]:
    """The decisions among `decisions` (in the order they were taken) that count toward `toward`, a decision or an
    outcome: toward what executes (an approval), the approvals and edits given since its last change (an edit
    restarts the count, its author counting as one); toward a rejection, the rejections; toward a new edit, none
    (it restarts the count). PolicyCount counts these, stage by stage."""
    if toward in (DecisionKind.REJECT, Outcome.REJECTED):
        return [d for d in decisions if d.decision == DecisionKind.REJECT]
    if toward == DecisionKind.EDIT:
        return []
    since = max((i for i, d in enumerate(decisions) if d.decision == DecisionKind.EDIT), default=0)
    return [d for d in decisions[since:] if d.decision in (DecisionKind.APPROVE, DecisionKind.EDIT)]


# --- the outcome --------------------------------------------------------------------------------------------------


def outcome(decision: str, earlier: Iterable[Decision]) -> Outcome:
    """What a decision that completes a card tells the engine: rejected; else edited when it runs an edit (this
    one, or the pending edit a second person approved); else approved."""
    if decision == DecisionKind.REJECT:
        return Outcome.REJECTED
    if decision == DecisionKind.EDIT or any(d.decision == DecisionKind.EDIT for d in earlier):
        return Outcome.EDITED
    return Outcome.APPROVED


# --- the SLA ----------------------------------------------------------------------------------------------------

DUE_SOON_SHARE = 0.25  # due soon when less than this share of the channel's SLA remains...
DUE_SOON_MIN = timedelta(minutes=5)  # ...or less than this, whichever is longer


class SlaState(models.TextChoices):
    ON_TIME = "on_time", "On time"
    DUE_SOON = "due_soon", "Due soon"
    BREACHED = "breached", "Breached"
    DECIDED = "decided", "Decided"  # the timer stopped


OPEN_SLA_STATES = (SlaState.ON_TIME, SlaState.DUE_SOON, SlaState.BREACHED)


def due_soon_window(sla: timedelta) -> timedelta:
    """How long before its deadline an open card is due soon. The pages send it to the browser (data-soon, in
    seconds), whose timers (static/sla.js) change state at it."""
    return max(sla * DUE_SOON_SHARE, DUE_SOON_MIN)


def sla_state(due_at: datetime, sla: timedelta, now: datetime, *, is_open: bool = True) -> SlaState:
    """An open card is breached once its deadline has passed, due soon within its channel's due-soon window."""
    if not is_open:
        return SlaState.DECIDED
    remaining = due_at - now
    if remaining <= timedelta(0):
        return SlaState.BREACHED
    if remaining < due_soon_window(sla):
        return SlaState.DUE_SOON
    return SlaState.ON_TIME


# The same rule in SQL, for the inbox's filters and counts: one range per channel, so an index can serve it.


def _due_soon_q(channels: Iterable[Channel], now: datetime) -> Q:
    q = Q(pk__in=[])
    for channel in channels:
        q |= Q(channel_id=channel.pk, due_at__lt=now + due_soon_window(channel.sla))
    return q


def sla_state_q(state: str, channels: Iterable[Channel], now: datetime) -> Q:
    """The open cards of `channels` in SLA `state` at `now`."""
    if state == SlaState.BREACHED:
        return Q(due_at__lte=now)
    if state == SlaState.DUE_SOON:
        return Q(due_at__gt=now) & _due_soon_q(channels, now)
    return Q(due_at__gt=now) & ~_due_soon_q(channels, now)


def sla_state_expression(channels: Iterable[Channel], now: datetime) -> Case:
    """Each open card's SLA state at `now`, as a column."""
    soon = [
        When(channel_id=channel.pk, due_at__lt=now + due_soon_window(channel.sla), then=Value(SlaState.DUE_SOON))
        for channel in channels
    ]
    return Case(
        When(due_at__lte=now, then=Value(SlaState.BREACHED)),
        *soon,
        default=Value(SlaState.ON_TIME),
        output_field=CharField(),
    )


@dataclass(frozen=True)
class SlaRange:
    """The open cards of one channel in one SLA state at some `now`: those with `after < due_at < before`."""

    state: SlaState
    channel: Channel
    after: datetime
    before: datetime


_TICK = timedelta(microseconds=1)  # PostgreSQL's timestamps count microseconds: `x - _TICK < due_at` is `x <= due_at`
_EVER = datetime.min.replace(tzinfo=UTC), datetime.max.replace(tzinfo=UTC)


def sla_ranges(channels: Iterable[Channel], now: datetime) -> list[SlaRange]:
    """The rule of sla_state as one range of due_at per channel and state (breached up to now, due soon until the
    channel's window, on time after it), for a query that reads each as an index range and caps it."""
    ranges = []
    for channel in channels:
        soon = now + due_soon_window(channel.sla)
        ranges += [
            SlaRange(SlaState.BREACHED, channel, _EVER[0], now + _TICK),
            SlaRange(SlaState.DUE_SOON, channel, now, soon),
            SlaRange(SlaState.ON_TIME, channel, soon - _TICK, _EVER[1]),
        ]
    return ranges


# --- approval policies ------------------------------------------------------------------------------------------
# Every card carries a snapshot of the policy it was opened under (`Approval.policy`): an admin's
# (approvals.models.ApprovalPolicy, made by `ApprovalPolicy.snapshot`), or, on a channel without one, the channel's
# own rule as a one-stage policy (`channel_rule`): {id, name, version, at_end, stages: [{name, purpose, quorum, sla
# (seconds), anyone, users: [ids], groups: [ids]}]}. The rules below read that snapshot, never the policy's rows,
# so an admin's edit does not change an open card's rules. A card opened before cards carried the channel's rule
# (`policy` null) reads it at read time (Approval.rule).


class StagePurpose(models.TextChoices):
    """What a row of a policy is: a stage of the ordered chain (its quorum must approve), or an escalation level
    of the stage above it (it takes that stage over when the SLA of the level before it runs out)."""

    APPROVE = "approve", "a stage that must approve"
    ESCALATE = "escalate", "escalation of the stage above"


class AtEnd(models.TextChoices):
    """What the policy does when the last escalation level's SLA runs out."""

    REJECT = "reject", "reject the card (fail closed)"
    WAIT = "wait", "keep waiting, alert ops"


def stage_errors(*, anyone: bool, quorum: int | None, people: int) -> list[str]:
    """What is wrong with one stage of a policy (Django admin's form shows them): nobody may decide, a quorum
    below one, or more people asked for than the stage names (`people`: the distinct users it names, directly or
    through its groups)."""
    if quorum is None or quorum < 1:
        return ["the quorum must be at least 1"]
    if anyone:
        return []
    if people == 0:
        return ["the stage names nobody: tick 'the channel's approvers' or name groups or users"]
    if quorum > people:
        return [f"the quorum ({quorum}) is more than the {people} people the stage names"]
    return []


def policy_errors(purposes: Sequence[str]) -> list[str]:
    """What is wrong with a policy's stages as a whole (in order): none, or an escalation level with no stage
    above it."""
    if not purposes:
        return ["a policy needs at least one stage"]
    if purposes[0] != StagePurpose.APPROVE:
        return ["the first stage must be one that approves (an escalation level escalates the stage above it)"]
    return []


def channel_rule(channel: Channel) -> dict:
    """The channel's own rule as a one-stage policy, for a card on a channel without an approval policy:
    `required_approvals` distinct people among anyone with `approve_channel` on it (never the run's creator), by
    its SLA. Marked `channel_rule`, with the channel's SLA policy (`escalation_policy`): its deadline is the
    channel's (approvals.sla.apply_sla: escalate to its escalation group again at each SLA, or the safe
    default), and its cards are shown as under their channel's rule, not as named by an admin's policy."""
    stage = {"name": f"approvers of {channel.name}", "purpose": StagePurpose.APPROVE}
    stage |= {"quorum": channel.required_approvals, "sla": int(channel.sla.total_seconds())}
    stage |= {"anyone": True, "users": [], "groups": []}
    safe_default = channel.escalation_policy == "safe_default"
    return {
        "id": None,
        "name": f"{channel.name} channel rule",
        "version": 0,
        "channel_rule": True,
        "escalation_policy": channel.escalation_policy,
        "at_end": AtEnd.REJECT if safe_default else AtEnd.WAIT,
        "stages": [stage],
    }


def channel_rule_now(carried: dict | None, channel: Channel) -> dict:
    """The channel's rule a card under it (`carried`: its snapshot, or None on a card opened before cards carried
    one) follows now: as it carries it, but never asking fewer people than the channel does now. Raising a
    channel's `required_approvals` applies to its open cards, as it always did; lowering it does not loosen a card
    opened under the two-person rule."""
    now = channel_rule(channel)
    if not carried:
        return now
    stage = carried["stages"][0]
    quorum = max(stage["quorum"], now["stages"][0]["quorum"])
    return carried if quorum == stage["quorum"] else {**carried, "stages": [{**stage, "quorum": quorum}]}


def is_channel_rule(policy: dict | None) -> bool:
    """Whether a card's snapshot is its channel's own rule (channel_rule), not an admin's policy; None (a card
    opened before cards carried it) is the channel's rule."""
    return not policy or bool(policy.get("channel_rule"))


def stage_of_level(policy: dict, row: int) -> int:
    """The approving stage that row `row` belongs to: itself, or the nearest approving stage above an
    escalation level."""
    stages = policy["stages"]
    while row > 0 and stages[row]["purpose"] == StagePurpose.ESCALATE:
        row -= 1
    return row


def next_level(policy: dict, row: int) -> int | None:
    """Where the card goes when row `row`'s SLA runs out: the next escalation level of its stage, or None (the
    end of the chain: the policy's `at_end`)."""
    stages = policy["stages"]
    if row + 1 < len(stages) and stages[row + 1]["purpose"] == StagePurpose.ESCALATE:
        return row + 1
    return None


def next_stage(policy: dict, row: int) -> int | None:
    """The next approving stage after the stage of row `row` (its escalation levels skipped), or None: the last."""
    stages = policy["stages"]
    for i in range(row + 1, len(stages)):
        if stages[i]["purpose"] == StagePurpose.APPROVE:
            return i
    return None


@dataclass(frozen=True)
class Asking:
    """Who a card asks now (row `row` of its policy): the people of its stage and of every escalation level up
    to the row (an escalation adds people; those asked before may still answer)."""

    anyone: bool
    users: frozenset[int]
    groups: frozenset[int]

    @classmethod
    def at(cls, policy: dict, row: int) -> Asking:
        rows = policy["stages"][stage_of_level(policy, row) : row + 1]
        return cls(
            any(s["anyone"] for s in rows),
            frozenset(u for s in rows for u in s["users"]),
            frozenset(g for s in rows for g in s["groups"]),
        )

    def includes(self, user) -> bool:
        if self.anyone or user.pk in self.users:
            return True
        return bool(self.groups) and user.groups.filter(pk__in=self.groups).exists()

    def covered(self, covering: Iterable[int], creator_id: int | None, channel: Channel | None = None) -> int | None:
        """Of the absent people `covering` lists (those whose cover is deciding), the first this card names by
        name: the decision is theirs, taken on their behalf. Never the run's creator (they may not decide it),
        and, given the card's `channel`, never someone who no longer holds the right to decide it themselves
        (`holds_the_right`): a delegation passes on a right, it does not outlive it."""
        named = [u for u in covering if u in self.users and u != creator_id]
        if channel is not None:
            named = holds_the_right(named, channel)
        return named[0] if named else None


def holds_the_right(user_ids: Sequence[int], channel: Channel) -> list[int]:
    """Those of `user_ids` (in their order) who may decide the cards of `channel` now: active users who still
    hold `approve_channel` on it. Read when a cover decides (and by the card page), never when the delegation
    was set: a person deactivated, or whose permission was removed, since then passes nothing on."""
    if not user_ids:
        return []
    users = {u.pk: u for u in get_user_model().objects.filter(pk__in=user_ids, is_active=True)}
    return [pk for pk in user_ids if pk in users and may_approve(users[pk], channel)]


def policy_refusal(actor, card: Approval, covering: Iterable[int] = ()) -> str:
    """Why `actor` may not decide `card` at its current stage ("" when they may): the card's policy asks other
    people now, and nobody the actor covers for (approvals.models.Delegation) is among them, or those who are no
    longer active or no longer hold `approve_channel` on the card's channel."""
    policy = card.rule
    if actor is None:
        return ""
    asking = Asking.at(policy, card.stage)
    if asking.includes(actor) or asking.covered(covering, card.run_created_by_id, card.channel) is not None:
        return ""
    return f"this card is at stage '{policy['stages'][card.stage]['name']}' of its policy, which does not ask you"


def on_behalf_of(actor, card: Approval, covering: Iterable[int] = ()) -> int | None:
    """Whose decision `actor` takes on `card` at its stage: None for their own (the stage asks them), else the
    absent person they cover for whom the stage names and who still holds the right to decide it
    (approvals.models.Delegation)."""
    asking = Asking.at(card.rule, card.stage)
    if actor is None or asking.includes(actor):
        return None
    return asking.covered(covering, card.run_created_by_id, card.channel)


@dataclass(frozen=True)
class _Taken:
    """The decision being taken, as the count reads a Decision."""

    decision: str
    actor_id: int | None
    on_behalf_of_id: int | None
    stage: int


@dataclass(frozen=True)
class PolicyCount:
    """The one count of a decision on a card (Approval.decide), under the policy its card carries (Approval.rule:
    an admin's, or its channel's own rule as a one-stage policy): the row it is taken at, whose it is (the actor's,
    or the absent person's they cover), and where it leaves the card.

    Each stage needs its quorum of distinct people (an escalation level's own quorum once the card reached it),
    counting the decisions given at the stage or any of its levels since the card's last edit; when it is met the
    card goes to the next stage, and past the last one it is decided. One person counts once per card, across
    stages (as the absent person they cover, too). An edit restarts the count: the card goes back to its first
    stage, its author counting as one at the stage they edited at. A rejection by anyone asked ends the card,
    except on a reconcile card, where "it did not happen" (the write is done now) needs the quorums too.

    Under the channel's rule (one stage, `required_approvals` of anyone who may approve the channel: the two-person
    rule when 2), `applies` says whether a count was needed at all (more than one approval asked, and not a
    rejection that ends the card), as the decision's audit entry records it (`approvals`, `required`)."""

    applies: bool
    stage: int  # the row this decision is taken at
    stage_name: str
    on_behalf_of: int | None
    counted: tuple  # the earlier decisions that count with this one (all stages)
    given: int  # at the card's stage, with this decision
    required: int
    to_stage: int | None  # where the card goes (None once it is decided)
    complete: bool
    channel_rule: bool = False  # counted under the channel's own rule (rules.channel_rule)

    @classmethod
    def of(cls, card: Approval, actor, decision: str, earlier: Sequence[Decision], covering: Iterable[int] = ()):
        policy, row = card.rule, card.stage
        on_channel_rule = is_channel_rule(card.policy)
        on_behalf = on_behalf_of(actor, card, covering)
        taken = _Taken(decision, getattr(actor, "pk", None), on_behalf, row)
        name = policy["stages"][row]["name"]
        ends = decision == DecisionKind.REJECT and card.kind != Kind.RECONCILE
        if ends:
            return cls(not on_channel_rule, row, name, on_behalf, (), 1, 1, None, True, on_channel_rule)
        decisions = counted([*earlier, taken], DecisionKind.APPROVE if decision == DecisionKind.EDIT else decision)
        if decision == DecisionKind.EDIT and stage_of_level(policy, row) != 0:
            row = 0  # an edit restarts the chain
        while True:
            stage = stage_of_level(policy, row)
            # A decision under the channel's rule is recorded without a stage: its one stage, the first.
            here = [d for d in decisions if stage_of_level(policy, d.stage or 0) == stage]
            given, required = len(here), policy["stages"][row]["quorum"]
            applies = not on_channel_rule or required > 1
            earlier_counted = tuple(decisions[:-1])
            if given < required:
                return cls(
                    applies, taken.stage, name, on_behalf, earlier_counted, given, required, row, False, on_channel_rule
                )
            row = next_stage(policy, row)
            if row is None:
                return cls(
                    applies, taken.stage, name, on_behalf, earlier_counted, given, required, None, True, on_channel_rule
                )

    def check(self, actor) -> None:
        if actor is None:
            return
        people = {actor.pk, self.on_behalf_of} - {None}
        if not any({d.actor_id, d.on_behalf_of_id} & people for d in self.counted):
            return
        if self.channel_rule:
            raise SecondApproverNeeded(
                "you already answered this card as it stands: the two-person rule needs a different person"
            )
        raise SecondApproverNeeded(
            "you (or the person you cover for) already answered this card as it stands: its policy counts each "
            "person once, across its stages"
        )
