"""The figures that say whether the console is healthy, read from the database each time they are asked for:
one snapshot, composed here from the queries each app owns on its own tables (core.monitoring, jobs.monitoring,
runs.monitoring, approvals.monitoring; where a figure comes from is explained there). The dashboard
(console.dashboard) shows it with its alert states (console.alerts) and charts (console.charts); /metrics
exposes it to Prometheus (console.prometheus). This module sits on top with the views; nothing below imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from django.utils import timezone

from approvals import monitoring as approvals
from approvals.monitoring import ShadowAgreement
from core import monitoring as core
from jobs import monitoring as jobs
from jobs.monitoring import Queue
from runs import breakers, ratelimit
from runs import monitoring as runs
from runs.monitoring import Compensations, StuckRun, ToolErrors


@dataclass
class Snapshot:
    at: datetime
    queues: dict[str, Queue]
    jobs_doing: int
    jobs_stalled: int
    workers_alive: int
    runs_by_status: dict[str, int]
    dead_letters_open: int
    dead_letters_total: int
    dead_letter_oldest_open_age: float | None
    approvals_open: dict[str, int]
    approvals_breached: dict[str, int]
    oldest_card_age: float | None
    oldest_card_sla: float | None
    tool_errors: list[ToolErrors]
    duplicates_blocked: dict[tuple[str, str], int]
    sandbox_duplicates: int  # received by the external systems (core.monitoring.received_duplicates)
    tokens_in: int
    tokens_out: int
    cost: Decimal
    cost_buckets: list[tuple[float, int]]
    token_buckets: list[tuple[float, int]]
    finished_runs: int
    finished_tokens: int
    finished_cost: Decimal
    retries: dict[str, int]
    usual_seconds: dict[str, float]
    stuck: list[StuckRun]
    kill_switches: dict[str, bool]
    global_kill_switch: bool
    finished_last_15m: int
    cost_last_hour: Decimal | None  # mean cost of the runs that finished in the last hour
    cost_baseline: Decimal | None  # the same, over the USUAL_TIME_WINDOW before that hour
    shadow_agreement: list[ShadowAgreement]
    shadow_effects: dict[str, int]  # effects recorded instead of sent, per channel
    breakers: list = field(default_factory=list)  # runs.models.Breaker, as runs.breakers.states() shows them
    throttled: list = field(default_factory=list)  # runs.ratelimit.ThrottledTenant: tenants waiting for tokens
    compensations: list[Compensations] = field(default_factory=list)  # undo, per workflow (runs.monitoring)

    @property
    def queue_oldest_age(self) -> float:
        return max((q.oldest_age for q in self.queues.values()), default=0.0)

    @property
    def channels(self) -> list[tuple[str, int, int, bool]]:
        """(channel, open cards, cards past their SLA, kill switch engaged)."""
        names = sorted(set(self.kill_switches) | set(self.approvals_open))
        return [
            (c, self.approvals_open.get(c, 0), self.approvals_breached.get(c, 0), self.kill_switches.get(c, False))
            for c in names
        ]

    @property
    def duplicates_by_channel(self) -> list[tuple[str, int, int]]:
        """(channel, replayed, reconciled)."""
        names = sorted({channel for channel, _ in self.duplicates_blocked})
        blocked = self.duplicates_blocked
        return [(c, blocked[(c, "replayed")], blocked[(c, "reconciled")]) for c in names]

    @property
    def retries_seen(self) -> list[tuple[str, int]]:
        return [(cause, n) for cause, n in self.retries.items() if n]

    @property
    def tokens_per_run(self) -> float:
        return self.finished_tokens / self.finished_runs if self.finished_runs else 0.0

    @property
    def approvals_backlog(self) -> int:
        return sum(self.approvals_open.values())

    @property
    def sla_breaches(self) -> int:
        return sum(self.approvals_breached.values())


def snapshot(now: datetime | None = None) -> Snapshot:
    now = now or timezone.now()
    jobs_doing, jobs_stalled = jobs.jobs_running(now)
    letters = jobs.dead_letters(now)
    cards = approvals.open_cards(now)
    usage = runs.usage()
    recent = runs.recent(now)
    usual = runs.usual_seconds(now)
    return Snapshot(
        at=now,
        queues=jobs.queues(now),
        jobs_doing=jobs_doing,
        jobs_stalled=jobs_stalled,
        workers_alive=jobs.workers_alive(now),
        runs_by_status=runs.runs_by_status(),
        dead_letters_open=letters.open,
        dead_letters_total=letters.total,
        dead_letter_oldest_open_age=letters.oldest_open_age,
        approvals_open=cards.per_channel,
        approvals_breached=cards.breached,
        oldest_card_age=cards.oldest_age,
        oldest_card_sla=cards.oldest_sla,
        tool_errors=runs.tool_errors(now),
        duplicates_blocked=runs.duplicates_blocked(),
        sandbox_duplicates=core.received_duplicates(),
        tokens_in=usage.tokens_in,
        tokens_out=usage.tokens_out,
        cost=usage.cost,
        cost_buckets=usage.cost_buckets,
        token_buckets=usage.token_buckets,
        finished_runs=usage.finished_runs,
        finished_tokens=usage.finished_tokens,
        finished_cost=usage.finished_cost,
        retries=runs.retries(),
        usual_seconds=usual,
        stuck=runs.stuck_runs(now, usual),
        kill_switches=core.kill_switches(),
        global_kill_switch=core.global_kill_switch_engaged(),
        finished_last_15m=recent.finished_last_15m,
        cost_last_hour=recent.cost_last_hour,
        cost_baseline=recent.cost_baseline,
        shadow_agreement=approvals.shadow_agreement(),
        shadow_effects=runs.shadow_effects(),
        breakers=breakers.states(now),
        throttled=ratelimit.throttled(now),
        compensations=runs.compensations(),
    )
