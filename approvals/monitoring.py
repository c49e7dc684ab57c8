"""The figures of the approval cards, for monitoring (console.monitoring): the open cards per channel against
their SLA, and shadow mode's agreement.

Shadow agreement: the answers (Decision.agreement) that reviewers gave on shadow cards, per workflow and rule
(the card's rule_id), counting every answer (under the two-person rule, each person's); the share that agreed
with the agent is what a team reads to decide when a workflow goes live."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, Q

from approvals.models import Approval, Decision
from approvals.rules import Agreement
from core.monitoring import rows


@dataclass
class OpenCards:
    per_channel: dict[str, int]
    breached: dict[str, int]  # past their due time, per channel
    oldest_age: float | None  # seconds since the oldest open card was created
    oldest_sla: float | None  # that card's SLA: due time minus creation, seconds


@dataclass
class ShadowAgreement:
    """Reviewers' answers on the shadow cards of one workflow and rule."""

    workflow: str
    rule_id: str
    answers: int
    agreed: int

    @property
    def disagreed(self) -> int:
        return self.answers - self.agreed

    @property
    def rate(self) -> float:
        return self.agreed / self.answers if self.answers else 0.0

    @property
    def percent(self) -> float:
        return 100 * self.rate


def open_cards(now: datetime) -> OpenCards:
    cards = Approval.objects.filter(status__in=Approval.OPEN)
    oldest = cards.order_by("created_at").values("created_at", "due_at").first()
    return OpenCards(
        per_channel=dict(cards.values_list("channel__name").annotate(n=Count("id"))),
        breached=dict(cards.filter(due_at__lt=now).values_list("channel__name").annotate(n=Count("id"))),
        oldest_age=(now - oldest["created_at"]).total_seconds() if oldest else None,
        oldest_sla=(oldest["due_at"] - oldest["created_at"]).total_seconds() if oldest else None,
    )


def shadow_agreement() -> list[ShadowAgreement]:
    """Answers and agreements on shadow cards, per workflow and rule."""
    return [
        ShadowAgreement(workflow, rule_id, answers, agreed)
        for workflow, rule_id, answers, agreed in Decision.objects.filter(approval__shadow=True)
        .exclude(agreement="")
        .values_list("approval__workflow", "approval__rule_id")
        .annotate(answers=Count("id"), agreed=Count("id", filter=Q(agreement=Agreement.AGREE)))
        .order_by("approval__workflow", "approval__rule_id")
    ]


def open_cards_per_minute(start: datetime, end: datetime) -> list[int]:
    """Cards open at the end of each minute from `start` to `end` (whole minutes, both included)."""
    return [
        n
        for _, n in rows(
            """
            SELECT g.t, count(a.id)
            FROM generate_series(%(start)s::timestamptz, %(end)s::timestamptz, interval '1 minute') g(t)
            LEFT JOIN approvals_approval a
                   ON a.created_at < g.t + interval '1 minute'
                  AND (a.decided_at IS NULL OR a.decided_at >= g.t + interval '1 minute')
            GROUP BY g.t ORDER BY g.t
            """,
            {"start": start, "end": end},
        )
    ]
