"""The recorded cards of a period and what a candidate would have done with them (docs/evaluate.md).

Two queries, whatever the number of cards: the cards decided in the period and their decisions, read as tuples
(`values_list`); the rest is Python over them, so 10,000 cards evaluate in well under a second
(bench/evaluate.py). A card counts as decided by a person when it closed approved, edited or rejected and its
closing decision has an actor; the others (expired, cancelled, rejected by an SLA's safe default or any decision of
the system) are counted apart and left out of the comparison, since no person's judgment is recorded on them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from approvals.models import Approval, ApprovalStatus, Decision, DecisionKind
from evals.errors import EmptyPeriod
from evals.rules import ACTIONS, DECIDES_ITSELF, Action, Candidate

# What people did, as the evaluation's matrix names it: the card's status once a person closed it.
OUTCOMES = (ApprovalStatus.APPROVED.value, ApprovalStatus.EDITED.value, ApprovalStatus.REJECTED.value)
BY_SYSTEM = "by_system"


@dataclass(slots=True)
class RecordedCard:
    """One card as an evaluation reads it: its columns the candidate's conditions name, how it closed, and who
    decided it (from its decisions, in order)."""

    pk: int
    run_id: str
    workflow: str
    kind: str
    channel: str
    rule_id: str
    risk: str
    currency: str
    amount_minor: int | None
    status: str
    created_at: datetime
    decided_at: datetime
    decisions: list[tuple[str | None, str, str, str]] = field(default_factory=list)  # actor, decision, comment, reason

    @property
    def by_person(self) -> bool:
        return self.status in OUTCOMES and bool(self.decisions) and self.decisions[-1][0] is not None

    @property
    def not_by_person(self) -> str:
        """Why the card is left out of the comparison: expired, cancelled, or by_system."""
        return self.status if self.status not in OUTCOMES else BY_SYSTEM

    @property
    def deciders(self) -> list[str]:
        """The people who decided it, each once, in the order they did."""
        return list(dict.fromkeys(actor for actor, *_ in self.decisions if actor is not None))

    @property
    def approvers(self) -> int:
        """How many distinct people approved (or edited) it."""
        return len({a for a, decision, *_ in self.decisions if a is not None and decision != DecisionKind.REJECT})

    def listed(self) -> dict:
        """The card as the evaluation lists it (the dangerous ones, the ones it would have refused)."""
        _, _, comment, reason = self.decisions[-1] if self.decisions else (None, "", "", "")
        return {
            "card": self.pk,
            "run": self.run_id,
            "workflow": self.workflow,
            "channel": self.channel,
            "amount_minor": self.amount_minor,
            "currency": self.currency,
            "outcome": self.status,
            "decided_by": self.deciders,
            "comment": comment,
            "reason": reason,
        }


def recorded_cards(since: datetime, until: datetime) -> list[RecordedCard]:
    """The cards closed in [since, until), with their decisions."""
    in_period = {"decided_at__gte": since, "decided_at__lt": until}
    rows = (
        Approval.objects.filter(**in_period)
        .order_by("pk")
        .values_list(
            "pk",
            "run_id",
            "workflow",
            "kind",
            "channel__name",
            "rule_id",
            "risk",
            "currency",
            "amount_minor",
            "status",
            "created_at",
            "decided_at",
        )
    )
    cards = {}
    for pk, run_id, *rest in rows.iterator(chunk_size=5000):
        cards[pk] = RecordedCard(pk, str(run_id), *rest)
    decisions = (
        Decision.objects.filter(**{f"approval__{k}": v for k, v in in_period.items()})
        .order_by("approval_id", "created_at", "pk")
        .values_list("approval_id", "actor__username", "decision", "comment", "reason")
    )
    for card_id, *decision in decisions.iterator(chunk_size=5000):
        cards[card_id].decisions.append(tuple(decision))
    return list(cards.values())


def evaluate(candidate: Candidate, since: datetime, until: datetime) -> dict:
    """The figures of `candidate` over the cards closed in [since, until); EmptyPeriod when no person decided
    any card in it (nothing to compare with)."""
    figures = tally(candidate, recorded_cards(since, until))
    figures["period"] = {"since": since.isoformat(), "until": until.isoformat()}
    return figures


def tally(candidate: Candidate, cards: list[RecordedCard]) -> dict:
    """The figures (docs/evaluate.md, "What the figures mean"):

    - `matrix[action][outcome]`: of the cards a person decided, how many the candidate would have auto-approved,
      refused or asked about, against what the person did (approved unchanged, edited, rejected);
    - `agreement`: of the cards the candidate would have decided itself, the share it decided as the person did
      (auto-approved and approved unchanged, refused and rejected); None when it would have decided none;
    - `dangerous`: the cards it would have let through that a person rejected or edited, listed;
    - `refused_approved`: the cards it would have refused that a person approved (unchanged or edited), listed;
    - `time_saved`: over the cards it would have decided itself, the time each waited for its person (decided_at -
      created_at), summed, and its median;
    - `quorum_short`: with a quorum, the cards it asks about that fewer distinct people approved than it asks
      (they would have waited for another person), listed;
    - `not_decided_by_person`: the cards of the period left out (expired, cancelled, by_system)."""
    matrix = {action: dict.fromkeys(OUTCOMES, 0) for action in ACTIONS}
    left_out = {ApprovalStatus.EXPIRED.value: 0, ApprovalStatus.CANCELLED.value: 0, BY_SYSTEM: 0}
    dangerous, refused_approved, quorum_short, waited = [], [], [], []
    for card in cards:
        if not card.by_person:
            left_out[card.not_by_person] = left_out.get(card.not_by_person, 0) + 1
            continue
        action = candidate.action_for(card)
        matrix[action][card.status] += 1
        if action in DECIDES_ITSELF:
            waited.append(card.decided_at - card.created_at)
        if action == Action.AUTO_APPROVE and card.status != ApprovalStatus.APPROVED:
            dangerous.append(card.listed())
        elif action == Action.REFUSE and card.status != ApprovalStatus.REJECTED:
            refused_approved.append(card.listed())
        elif action == Action.ASK and card.status != ApprovalStatus.REJECTED:
            needed = candidate.quorum_for(card)
            if card.approvers < needed:
                quorum_short.append({**card.listed(), "approvers": card.approvers, "needed": needed})
    decided = sum(matrix[Action.AUTO_APPROVE].values()) + sum(matrix[Action.REFUSE].values())
    if not decided and not sum(matrix[Action.ASK].values()):
        raise EmptyPeriod("no card was decided by a person in this period: there is nothing to compare with")
    agreed = matrix[Action.AUTO_APPROVE][ApprovalStatus.APPROVED] + matrix[Action.REFUSE][ApprovalStatus.REJECTED]
    figures = {
        "total": len(cards),
        "decided_by_person": sum(sum(row.values()) for row in matrix.values()),
        "not_decided_by_person": left_out,
        "matrix": matrix,
        "candidate_decided": decided,
        "agreed": agreed,
        "agreement": agreed / decided if decided else None,
        "dangerous": {"count": len(dangerous), "cards": dangerous},
        "refused_approved": {"count": len(refused_approved), "cards": refused_approved},
        "time_saved": {
            "cards": len(waited),
            # Summed as timedeltas (whole microseconds), so the figure does not depend on the cards' order.
            "total_seconds": sum(waited, timedelta()).total_seconds(),
            "median_seconds": statistics.median(waited).total_seconds() if waited else None,
        },
    }
    if candidate.quorum:
        figures["quorum_short"] = {"count": len(quorum_short), "cards": quorum_short}
    return figures
