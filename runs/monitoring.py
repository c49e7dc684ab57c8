"""The figures of the runs, their steps and side effects, for monitoring (console.monitoring).

Where a figure comes from, when it is not obvious:
- retries by cause: the `run.retry` audit entries the engine writes (runs.engine.record_retry); a retried
  step's row is reused, so the database would not otherwise keep them.
- duplicate side effects blocked by receipts: done receipts whose effect was asked for again and answered
  from the receipt. Two kinds leave a trace: `replayed` (the receipt was completed before a later attempt of
  its step started, so that attempt found it done: a no-op) and `reconciled` (an ambiguous write completed
  by the tool's lookup or a person instead of a blind retry). Not counted: a second run that reuses another
  run's natural key (the no-op leaves no row).
- compensations (undo, runs.compensations): a run undone is one being undone or that was (its `undo_reason` is
  set, or its status is compensating, compensated or compensation_failed); the compensation rate of a workflow is
  its runs undone over its runs whose way forward ended (finished, or undone); the compensations themselves are
  the `run.compensation` audit entries, one per compensation and outcome (done, declined, by_hand, failed), read
  through the audit log's (action, at) index.
- runs not moving: queued or running, with no progress (updated_at) for longer than
  max(STUCK_FLOOR, STUCK_FACTOR x the workflow's usual active time), the usual active time being the median
  sum of step latencies of its latest 200 runs that succeeded in the last 7 days (waits for people are not
  counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.db.models import Avg, Count, F, OuterRef, Q, Subquery, Sum
from django.db.models.fields.json import KT

from core.models import AuditEntry
from core.monitoring import per_minute, rows
from runs.models import Run, ShadowEffect

RETRY_CAUSES = [
    f"{source}_{how}" for source in ("model", "tool", "engine") for how in ("429", "5xx", "timeout", "error")
] + ["owner_gone", "no_job", "shutdown", "worker_crash"]  # worker_crash: entries written before owner_gone
ERROR_RATE_WINDOW = timedelta(minutes=10)
STUCK_FACTOR = 3
STUCK_FLOOR = timedelta(minutes=2)  # above the retry backoff cap, so a run waiting for its retry is moving
USUAL_TIME_WINDOW = timedelta(days=7)
USUAL_TIME_SAMPLE = 200  # the latest runs of each workflow that the median is taken over

COST_BUCKETS = [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5]
TOKEN_BUCKETS = [100, 500, 1_000, 5_000, 10_000, 50_000, 100_000]


@dataclass
class ToolErrors:
    workflow: str
    step: str
    kind: str
    attempts: int
    failed: int

    @property
    def rate(self) -> float:
        return self.failed / self.attempts if self.attempts else 0.0

    @property
    def percent(self) -> float:
        return 100 * self.rate


@dataclass
class StuckRun:
    id: str
    workflow: str
    status: str
    still_for: float  # seconds since it last moved
    usual: float  # its workflow's usual active time, seconds


@dataclass
class Usage:
    """Model tokens and cost: of all runs, and per finished run (cumulative histograms: (bound, runs <= bound),
    the last bound infinite)."""

    tokens_in: int
    tokens_out: int
    cost: Decimal
    finished_runs: int
    finished_tokens: int
    finished_cost: Decimal
    cost_buckets: list[tuple[float, int]]
    token_buckets: list[tuple[float, int]]


@dataclass
class Recent:
    finished_last_15m: int
    cost_last_hour: Decimal | None  # mean cost of the runs that finished in the last hour
    cost_baseline: Decimal | None  # the same, over the USUAL_TIME_WINDOW before that hour


COMPENSATION_OUTCOMES = ("done", "declined", "by_hand", "failed")
UNDO_STATUSES = (Run.Status.COMPENSATING, Run.Status.COMPENSATED, Run.Status.COMPENSATION_FAILED)


@dataclass
class Compensations:
    """A workflow's undos: its runs whose way forward ended, those undone, and its compensations by outcome."""

    workflow: str
    ended: int = 0
    undone: int = 0
    outcomes: dict[str, int] | None = None

    @property
    def rate(self) -> float:
        return self.undone / self.ended if self.ended else 0.0

    @property
    def percent(self) -> float:
        return 100 * self.rate

    @property
    def done(self) -> int:
        return (self.outcomes or {}).get("done", 0)

    @property
    def failed(self) -> int:
        return (self.outcomes or {}).get("failed", 0)


def compensations() -> list[Compensations]:
    """Per workflow that has undone a run: the compensation rate and the compensations done, by outcome."""
    undone = Q(undo_reason__gt="") | Q(status__in=UNDO_STATUSES)
    found: dict[str, Compensations] = {}
    for workflow, ended, n in (
        Run.objects.filter(Q(status__in=Run.FINISHED) | undone)
        .values_list("workflow")
        .annotate(ended=Count("id"), undone=Count("id", filter=undone))
        .filter(undone__gt=0)
        .order_by()
    ):
        found[workflow] = Compensations(workflow, ended, n, dict.fromkeys(COMPENSATION_OUTCOMES, 0))
    workflow_of = Run.objects.filter(pk=OuterRef("run_id")).values("workflow")[:1]
    for workflow, outcome, n in (
        AuditEntry.objects.filter(action="run.compensation")
        .values_list(Subquery(workflow_of), KT("data__outcome"))
        .annotate(n=Count("id"))
        .order_by()
    ):
        entry = found.setdefault(workflow, Compensations(workflow, 0, 0, dict.fromkeys(COMPENSATION_OUTCOMES, 0)))
        entry.outcomes[outcome] = entry.outcomes.get(outcome, 0) + n
    return sorted(found.values(), key=lambda c: c.workflow)


def runs_by_status() -> dict[str, int]:
    return {**dict.fromkeys(Run.Status.values, 0), **dict(Run.objects.values_list("status").annotate(n=Count("id")))}


def tool_errors(now: datetime) -> list[ToolErrors]:
    """Finished attempts and failed ones per step of each workflow, over steps started in the window. A step
    row keeps its attempt count: every finished attempt but a final `done` one failed."""
    return [
        ToolErrors(*row)
        for row in rows(
            """
            SELECT r.workflow, s.name, s.kind,
                   sum(GREATEST(s.attempt - CASE WHEN s.status IN ('running', 'waiting') THEN 1 ELSE 0 END, 0)),
                   sum(GREATEST(s.attempt - CASE WHEN s.status IN ('running', 'waiting', 'done') THEN 1 ELSE 0 END, 0))
            FROM runs_step s JOIN runs_run r ON r.id = s.run_id
            WHERE s.started_at >= %s AND s.kind <> 'gate'
            GROUP BY r.workflow, s.name, s.kind
            ORDER BY r.workflow, min(s.seq)
            """,
            [now - ERROR_RATE_WINDOW],
        )
    ]


def duplicates_blocked() -> dict[tuple[str, str], int]:
    """(channel, "replayed" or "reconciled") -> side effects answered from their receipt."""
    found = {}
    for channel, reconciled in rows(
        "SELECT channel, count(*) FILTER (WHERE reconciled) FROM runs_receipt WHERE status = 'done' GROUP BY channel",
        [],
    ):
        found[(channel, "replayed")], found[(channel, "reconciled")] = 0, reconciled
    # An effect step attempted again after its receipt was done (its worker died between the two commits): that
    # attempt found the receipt done and did nothing. The engine never deletes step rows, so attempt > 1 holds.
    for channel, replayed in rows(
        """
        SELECT r.channel, count(*)
        FROM runs_step s JOIN runs_receipt r ON r.run_id = s.run_id AND r.step_seq = s.seq
        WHERE s.kind = 'effect' AND s.attempt > 1 AND r.status = 'done' AND NOT r.reconciled
          AND s.started_at > r.completed_at
        GROUP BY r.channel
        """,
        [],
    ):
        found[(channel, "replayed")] = replayed
    return found


def usual_seconds(now: datetime) -> dict[str, float]:
    """The median active time of each workflow's latest USUAL_TIME_SAMPLE runs that succeeded in the window."""
    return {
        workflow: float(seconds)
        for workflow, seconds in rows(
            """
            WITH recent AS (
                SELECT id, workflow FROM (
                    SELECT r.id, r.workflow,
                           row_number() OVER (PARTITION BY r.workflow ORDER BY r.finished_at DESC) AS n
                    FROM runs_run r
                    WHERE r.status = 'succeeded' AND r.finished_at >= %s
                ) ranked
                WHERE n <= %s
            )
            SELECT recent.workflow, percentile_cont(0.5) WITHIN GROUP (ORDER BY active.ms) / 1000.0
            FROM recent
            CROSS JOIN LATERAL (
                SELECT COALESCE(sum(s.latency_ms), 0) AS ms FROM runs_step s WHERE s.run_id = recent.id
            ) active
            GROUP BY recent.workflow
            """,
            [now - USUAL_TIME_WINDOW, USUAL_TIME_SAMPLE],
        )
    }


def stuck_after(usual_seconds: float) -> float:
    """Seconds without progress after which a queued or running run is "not moving"."""
    return max(STUCK_FLOOR.total_seconds(), STUCK_FACTOR * usual_seconds)


def stuck_runs(now: datetime, usual: dict[str, float]) -> list[StuckRun]:
    """Queued or running runs not moving, given each workflow's usual active time (usual_seconds)."""
    return [
        StuckRun(str(run_id), workflow, status, (now - updated_at).total_seconds(), usual.get(workflow, 0.0))
        for run_id, workflow, status, updated_at in Run.objects.filter(
            status__in=[Run.Status.QUEUED, Run.Status.RUNNING], updated_at__lt=now - STUCK_FLOOR
        )
        .order_by("updated_at")
        .values_list("id", "workflow", "status", "updated_at")
        if (now - updated_at).total_seconds() > stuck_after(usual.get(workflow, 0.0))
    ]


def _histogram(runs, value, buckets) -> tuple[list[tuple[float, int]], int, object]:
    counts = runs.aggregate(
        n=Count("id"),
        total=Sum(value),
        **{f"le{i}": Count("id", filter=Q(**{f"{value}__lte": bound})) for i, bound in enumerate(buckets)},
    )
    cumulative = [(float(bound), counts[f"le{i}"]) for i, bound in enumerate(buckets)]
    return [*cumulative, (float("inf"), counts["n"])], counts["n"], counts["total"] or 0


def usage() -> Usage:
    totals = Run.objects.aggregate(tokens_in=Sum("tokens_in"), tokens_out=Sum("tokens_out"), cost=Sum("cost"))
    finished = Run.objects.filter(status__in=Run.FINISHED).annotate(tokens=F("tokens_in") + F("tokens_out"))
    cost_buckets, finished_runs, finished_cost = _histogram(finished, "cost", COST_BUCKETS)
    token_buckets, _, finished_tokens = _histogram(finished, "tokens", TOKEN_BUCKETS)
    return Usage(
        tokens_in=totals["tokens_in"] or 0,
        tokens_out=totals["tokens_out"] or 0,
        cost=totals["cost"] or Decimal(0),
        finished_runs=finished_runs,
        finished_tokens=finished_tokens,
        finished_cost=finished_cost,
        cost_buckets=cost_buckets,
        token_buckets=token_buckets,
    )


def retries() -> dict[str, int]:
    """Retries by cause, every known cause listed (0 when none)."""
    found = dict.fromkeys(RETRY_CAUSES, 0)
    found.update(
        AuditEntry.objects.filter(action="run.retry")
        .values(cause=KT("data__cause"))
        .annotate(n=Count("id"))
        .values_list("cause", "n")
    )
    return found


def recent(now: datetime) -> Recent:
    hour_ago = now - timedelta(hours=1)
    found = Run.objects.filter(finished_at__isnull=False).aggregate(
        last_15m=Count("id", filter=Q(finished_at__gte=now - timedelta(minutes=15))),
        last_hour=Avg("cost", filter=Q(finished_at__gte=hour_ago)),
        baseline=Avg("cost", filter=Q(finished_at__lt=hour_ago, finished_at__gte=hour_ago - USUAL_TIME_WINDOW)),
    )
    return Recent(found["last_15m"], found["last_hour"], found["baseline"])


def shadow_effects() -> dict[str, int]:
    """Effects that shadow mode recorded instead of sending, per channel."""
    return dict(ShadowEffect.objects.values_list("channel").annotate(n=Count("id")).order_by())


def runs_finished_per_minute(start: datetime, minutes: int) -> list[int]:
    return per_minute(Run.objects, "finished_at", start, minutes)
