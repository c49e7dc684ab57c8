"""The figures that say whether the console is healthy, read from the database each time they are asked for.

The dashboard (console.dashboard) and /metrics (`DatabaseCollector`, Prometheus) show the same numbers. The
web server and the workers are different processes, so nothing here is a process-local counter: every figure
is a query, and a "counter" is a count of rows that only grows (dead letters, retry audit entries, receipts).
This module sits on top with the views (it reads runs, approvals and Procrastinate's tables); nothing below
imports it.

Where a figure comes from, when it is not obvious:
- retries by cause: the `run.retry` audit entries the engine writes (runs.engine.record_retry); a retried
  step's row is reused, so the database would not otherwise keep them.
- duplicate side effects blocked by receipts: done receipts whose effect was asked for again and answered
  from the receipt. Two kinds leave a trace: `replayed` (the receipt was completed before a later attempt of
  its step started, so that attempt found it done: a no-op) and `reconciled` (an ambiguous write completed
  by the tool's lookup or a person instead of a blind retry). Not counted: a second run that reuses another
  run's natural key (the no-op leaves no row).
- shadow agreement: the answers (Decision.agreement) that reviewers gave on shadow cards, per workflow and rule
  (the card's rule_id), counting every answer (under the two-person rule, each person's); the share that agreed
  with the agent is what a team reads to decide when a workflow goes live.
- runs not moving: queued or running, with no progress (updated_at) for longer than
  max(STUCK_FLOOR, STUCK_FACTOR x the workflow's usual active time), the usual active time being the median
  sum of step latencies of its latest 200 runs that succeeded in the last 7 days (waits for people are not
  counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from django.apps import apps
from django.conf import settings
from django.db import connection
from django.db.models import Avg, Count, F, Min, Q, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import TruncMinute
from django.utils import timezone
from procrastinate.contrib.django.models import ProcrastinateJob, ProcrastinateWorker
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from approvals.models import Agreement, Approval, Decision
from core.models import AuditEntry, Channel, GlobalKillSwitch
from jobs.models import DeadLetter
from runs import breakers, ratelimit
from runs.models import Run, ShadowEffect

QUEUES = ["agent", "outbound", "hitl", "maintenance"]  # DESIGN's queues; others are shown when they have jobs
RETRY_CAUSES = [
    f"{source}_{how}" for source in ("model", "tool", "engine") for how in ("429", "5xx", "timeout", "error")
] + ["owner_gone", "no_job", "shutdown", "worker_crash"]  # worker_crash: entries written before owner_gone

# The seed's alert thresholds (docs/RUNBOOK.md); the queue's SLA is a setting (QUEUE_SLA_SECONDS).
DEAD_LETTER_ALERT_AFTER = timedelta(minutes=30)
ERROR_RATE_WINDOW = timedelta(minutes=10)
ERROR_RATE_LIMIT = 0.05
ERROR_RATE_MIN_ATTEMPTS = 20  # below this a single failure is not a rate (shown as warn, not alert)
CARD_SLA_WARN = 0.75  # share of a card's SLA used before the backlog warns
STUCK_FACTOR = 3
STUCK_FLOOR = timedelta(minutes=2)  # above the retry backoff cap, so a run waiting for its retry is moving
USUAL_TIME_WINDOW = timedelta(days=7)
USUAL_TIME_SAMPLE = 200  # the latest runs of each workflow that the median is taken over
COST_FACTOR = 2
BACKLOG_MINUTES = 15  # queue depth above this many minutes of the last 15 minutes' throughput

COST_BUCKETS = [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5]
TOKEN_BUCKETS = [100, 500, 1_000, 5_000, 10_000, 50_000, 100_000]


@dataclass
class Queue:
    depth: int = 0  # todo jobs whose time has come
    scheduled: int = 0  # todo jobs scheduled later (retries with backoff, timers)
    oldest_age: float = 0.0  # seconds the oldest ready job has waited


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


@dataclass
class StuckRun:
    id: str
    workflow: str
    status: str
    still_for: float  # seconds since it last moved
    usual: float  # its workflow's usual active time, seconds


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
    sandbox_duplicates: int
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


def _sandbox_duplicates() -> int:
    """Duplicate side effects the demo's fake external systems received (0 where the demo is not installed)."""
    if not apps.is_installed("demo"):
        return 0
    from demo import sandbox

    return sandbox.stats()["duplicates"]


def stuck_after(usual_seconds: float) -> float:
    """Seconds without progress after which a queued or running run is "not moving"."""
    return max(STUCK_FLOOR.total_seconds(), STUCK_FACTOR * usual_seconds)


def _rows(sql: str, params) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def queues(now: datetime) -> dict[str, Queue]:
    """Todo jobs per queue. A job waits from its scheduled time, or from when it was deferred."""
    found = {name: Queue() for name in QUEUES}
    for name, depth, scheduled, oldest in _rows(
        """
        SELECT j.queue_name,
               count(*) FILTER (WHERE j.scheduled_at IS NULL OR j.scheduled_at <= %(now)s),
               count(*) FILTER (WHERE j.scheduled_at > %(now)s),
               min(COALESCE(j.scheduled_at, d.at)) FILTER (WHERE j.scheduled_at IS NULL OR j.scheduled_at <= %(now)s)
        FROM procrastinate_jobs j
        LEFT JOIN LATERAL (
            SELECT min(e.at) AS at FROM procrastinate_events e WHERE e.job_id = j.id AND e.type = 'deferred'
        ) d ON true
        WHERE j.status = 'todo'
        GROUP BY j.queue_name
        """,
        {"now": now},
    ):
        found[name] = Queue(depth, scheduled, max(0.0, (now - oldest).total_seconds()) if oldest else 0.0)
    return found


def tool_errors(now: datetime) -> list[ToolErrors]:
    """Finished attempts and failed ones per step of each workflow, over steps started in the window. A step
    row keeps its attempt count: every finished attempt but a final `done` one failed."""
    return [
        ToolErrors(*row)
        for row in _rows(
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
    found = {}
    for channel, reconciled in _rows(
        "SELECT channel, count(*) FILTER (WHERE reconciled) FROM runs_receipt WHERE status = 'done' GROUP BY channel",
        [],
    ):
        found[(channel, "replayed")], found[(channel, "reconciled")] = 0, reconciled
    # An effect step attempted again after its receipt was done (its worker died between the two commits): that
    # attempt found the receipt done and did nothing. The engine never deletes step rows, so attempt > 1 holds.
    for channel, replayed in _rows(
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
        for workflow, seconds in _rows(
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


def _histogram(runs, value, buckets) -> tuple[list[tuple[float, int]], int, object]:
    counts = runs.aggregate(
        n=Count("id"),
        total=Sum(value),
        **{f"le{i}": Count("id", filter=Q(**{f"{value}__lte": bound})) for i, bound in enumerate(buckets)},
    )
    cumulative = [(float(bound), counts[f"le{i}"]) for i, bound in enumerate(buckets)]
    return [*cumulative, (float("inf"), counts["n"])], counts["n"], counts["total"] or 0


def snapshot(now: datetime | None = None) -> Snapshot:
    now = now or timezone.now()
    stalled_since = now - timedelta(seconds=settings.STALLED_AFTER_SECONDS)
    doing = ProcrastinateJob.objects.filter(status="doing")

    open_cards = Approval.objects.filter(status__in=Approval.OPEN)
    per_channel = dict(open_cards.values_list("channel__name").annotate(n=Count("id")))
    breached = dict(open_cards.filter(due_at__lt=now).values_list("channel__name").annotate(n=Count("id")))
    oldest_card = open_cards.order_by("created_at").values("created_at", "due_at").first()

    letters = DeadLetter.objects.aggregate(
        total=Count("id"),
        open=Count("id", filter=Q(resolved_at__isnull=True)),
        oldest=Min("created_at", filter=Q(resolved_at__isnull=True)),
    )

    totals = Run.objects.aggregate(tokens_in=Sum("tokens_in"), tokens_out=Sum("tokens_out"), cost=Sum("cost"))
    finished = Run.objects.filter(status__in=Run.FINISHED).annotate(tokens=F("tokens_in") + F("tokens_out"))
    cost_buckets, finished_runs, finished_cost = _histogram(finished, "cost", COST_BUCKETS)
    token_buckets, _, finished_tokens = _histogram(finished, "tokens", TOKEN_BUCKETS)

    retries = dict.fromkeys(RETRY_CAUSES, 0)
    retries.update(
        AuditEntry.objects.filter(action="run.retry")
        .values(cause=KT("data__cause"))
        .annotate(n=Count("id"))
        .values_list("cause", "n")
    )

    hour_ago = now - timedelta(hours=1)
    recent = Run.objects.filter(finished_at__isnull=False).aggregate(
        last_15m=Count("id", filter=Q(finished_at__gte=now - timedelta(minutes=15))),
        last_hour=Avg("cost", filter=Q(finished_at__gte=hour_ago)),
        baseline=Avg("cost", filter=Q(finished_at__lt=hour_ago, finished_at__gte=hour_ago - USUAL_TIME_WINDOW)),
    )

    usual = usual_seconds(now)
    stuck = [
        StuckRun(str(run_id), workflow, status, (now - updated_at).total_seconds(), usual.get(workflow, 0.0))
        for run_id, workflow, status, updated_at in Run.objects.filter(
            status__in=[Run.Status.QUEUED, Run.Status.RUNNING], updated_at__lt=now - STUCK_FLOOR
        )
        .order_by("updated_at")
        .values_list("id", "workflow", "status", "updated_at")
        if (now - updated_at).total_seconds() > stuck_after(usual.get(workflow, 0.0))
    ]

    return Snapshot(
        at=now,
        queues=queues(now),
        jobs_doing=doing.count(),
        jobs_stalled=doing.filter(Q(worker__isnull=True) | Q(worker__last_heartbeat__lt=stalled_since)).count(),
        workers_alive=ProcrastinateWorker.objects.filter(
            last_heartbeat__gte=now - timedelta(seconds=settings.READY_HEARTBEAT_MAX_AGE)
        ).count(),
        runs_by_status={
            **dict.fromkeys(Run.Status.values, 0),
            **dict(Run.objects.values_list("status").annotate(n=Count("id"))),
        },
        dead_letters_open=letters["open"],
        dead_letters_total=letters["total"],
        dead_letter_oldest_open_age=(now - letters["oldest"]).total_seconds() if letters["oldest"] else None,
        approvals_open=per_channel,
        approvals_breached=breached,
        oldest_card_age=(now - oldest_card["created_at"]).total_seconds() if oldest_card else None,
        oldest_card_sla=(oldest_card["due_at"] - oldest_card["created_at"]).total_seconds() if oldest_card else None,
        tool_errors=tool_errors(now),
        duplicates_blocked=duplicates_blocked(),
        sandbox_duplicates=_sandbox_duplicates(),
        tokens_in=totals["tokens_in"] or 0,
        tokens_out=totals["tokens_out"] or 0,
        cost=totals["cost"] or Decimal(0),
        cost_buckets=cost_buckets,
        token_buckets=token_buckets,
        finished_runs=finished_runs,
        finished_tokens=finished_tokens,
        finished_cost=finished_cost,
        retries=retries,
        usual_seconds=usual,
        stuck=stuck,
        kill_switches=dict(Channel.objects.values_list("name", "kill_switch_engaged")),
        global_kill_switch=GlobalKillSwitch.objects.filter(kill_switch_engaged=True).exists(),
        finished_last_15m=recent["last_15m"],
        cost_last_hour=recent["last_hour"],
        cost_baseline=recent["baseline"],
        shadow_agreement=shadow_agreement(),
        shadow_effects=dict(ShadowEffect.objects.values_list("channel").annotate(n=Count("id")).order_by()),
        breakers=breakers.states(now),
        throttled=ratelimit.throttled(now),
    )


# The dashboard's states: the seed's alert thresholds (each with its runbook section).

OK, WARN, ALERT = "ok", "warn", "alert"


@dataclass
class Signal:
    title: str
    state: str
    value: str
    rule: str
    runbook: str  # anchor in docs/RUNBOOK.md


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0, round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def signals(snap: Snapshot) -> list[Signal]:
    sla = settings.QUEUE_SLA_SECONDS
    oldest = snap.queue_oldest_age
    ready = sum(q.depth for q in snap.queues.values())
    per_minute = snap.finished_last_15m / 15
    depth = snap.queues["agent"].depth
    letters_age = snap.dead_letter_oldest_open_age
    card_share = (snap.oldest_card_age / snap.oldest_card_sla) if snap.oldest_card_sla else 0.0
    worst_tool = max(snap.tool_errors, key=lambda t: (t.rate, t.attempts), default=None)
    cost_now, cost_base = snap.cost_last_hour, snap.cost_baseline
    return [
        Signal(
            "Oldest queued job",
            ALERT if oldest > 2 * sla else WARN if oldest > sla else OK,
            _age(oldest) if ready else "queue empty",
            f"warn over the queue SLA ({_age(sla)}), alert over 2x ({_age(2 * sla)})",
            "a-worker-is-stuck",
        ),
        Signal(
            "Agent queue depth",
            WARN if depth > max(1.0, BACKLOG_MINUTES * per_minute) else OK,
            f"{depth} ready, {per_minute:.1f} runs finished/min (15 min)",
            f"warn above {BACKLOG_MINUTES} minutes of the last 15 minutes' throughput",
            "a-worker-is-stuck",
        ),
        Signal(
            "Workers",
            ALERT
            if snap.workers_alive == 0 and ready
            else WARN
            if snap.jobs_stalled or snap.workers_alive == 0
            else OK,
            f"{snap.workers_alive} alive, {snap.jobs_doing} jobs running, {snap.jobs_stalled} stalled",
            "alert when work waits and no worker sends heartbeats; warn on stalled jobs",
            "a-worker-is-stuck",
        ),
        Signal(
            "Dead letters",
            ALERT
            if letters_age is not None and letters_age >= DEAD_LETTER_ALERT_AFTER.total_seconds()
            else WARN
            if snap.dead_letters_open
            else OK,
            f"{snap.dead_letters_open} open" + (f", oldest {_age(letters_age)}" if letters_age is not None else ""),
            "warn on any open letter, alert when one has been open 30 min",
            "the-crm-api-is-down",
        ),
        Signal(
            "Duplicate outbound",
            ALERT if snap.sandbox_duplicates else OK,
            f"{snap.sandbox_duplicates} duplicates received, {sum(snap.duplicates_blocked.values())} blocked",
            "alert on any duplicate side effect received by the (demo) external systems",
            "a-customer-got-the-same-message-twice",
        ),
        Signal(
            "Approvals backlog",
            ALERT if snap.sla_breaches else WARN if card_share >= CARD_SLA_WARN else OK,
            f"{snap.approvals_backlog} open, {snap.sla_breaches} past their SLA; oldest "
            f"{_age(snap.oldest_card_age)} of {_age(snap.oldest_card_sla)}",
            f"warn when the oldest card has used {CARD_SLA_WARN:.0%} of its SLA, alert on any card past it",
            "the-approvals-backlog-is-over-sla",
        ),
        Signal(
            "Runs not moving",
            ALERT if snap.stuck else OK,
            f"{len(snap.stuck)} runs",
            f"queued or running without progress for {STUCK_FACTOR}x their workflow's usual time "
            f"(at least {_age(STUCK_FLOOR.total_seconds())})",
            "a-worker-is-stuck",
        ),
        Signal(
            "Tool error rate (10 min)",
            OK
            if worst_tool is None or worst_tool.rate <= ERROR_RATE_LIMIT
            else ALERT
            if worst_tool.attempts >= ERROR_RATE_MIN_ATTEMPTS
            else WARN,
            f"worst: {worst_tool.step} {worst_tool.rate:.0%} of {worst_tool.attempts}" if worst_tool else "no attempts",
            f"alert above {ERROR_RATE_LIMIT:.0%} over {ERROR_RATE_MIN_ATTEMPTS}+ attempts; warn on fewer",
            "the-model-answers-429",
        ),
        Signal(
            "Circuit breakers",
            ALERT
            if any(b.state == "open" for b in snap.breakers)
            else WARN
            if any(b.state == "half_open" for b in snap.breakers) or snap.throttled
            else OK,
            (
                ", ".join(f"{b.system} {b.shown_state.replace('_', ' ')}" for b in snap.breakers if b.state != "closed")
                or "all closed"
            )
            + (f"; {len(snap.throttled)} tenants throttled" if snap.throttled else ""),
            "alert while a system's breaker is open (its steps wait), warn while it probes or a tenant is "
            "throttled by the token rate limit",
            "the-crm-api-is-down",
        ),
        Signal(
            "Cost per run",
            WARN if cost_now and cost_base and cost_now > COST_FACTOR * cost_base else OK,
            f"{cost_now:.6f} last hour vs " + (f"{cost_base:.6f} before" if cost_base else "no baseline yet")
            if cost_now
            else "no run finished in the last hour",
            f"warn above {COST_FACTOR}x the mean of the previous 7 days",
            "the-model-answers-429",
        ),
    ]


# Charts of the last hour, one point a minute, drawn as inline SVG by the dashboard.


@dataclass
class Sparkline:
    title: str
    values: list[int]
    width: int = 240
    height: int = 40

    @property
    def peak(self) -> int:
        return max(self.values, default=0)

    @property
    def last(self) -> int:
        return self.values[-1] if self.values else 0

    @property
    def points(self) -> str:
        step = self.width / max(1, len(self.values) - 1)
        scale = (self.height - 4) / (self.peak or 1)
        return " ".join(f"{i * step:.1f},{self.height - 2 - v * scale:.1f}" for i, v in enumerate(self.values))


def _per_minute(queryset, field: str, start: datetime, minutes: int) -> list[int]:
    counts = dict(
        queryset.filter(**{f"{field}__gte": start})
        .annotate(minute=TruncMinute(field))
        .values_list("minute")
        .annotate(n=Count("id"))
    )
    return [counts.get(start + timedelta(minutes=i), 0) for i in range(minutes)]


def charts(now: datetime | None = None, minutes: int = 60) -> list[Sparkline]:
    now = (now or timezone.now()).replace(second=0, microsecond=0)
    start = now - timedelta(minutes=minutes - 1)
    open_cards = [
        n
        for _, n in _rows(
            """
            SELECT g.t, count(a.id)
            FROM generate_series(%(start)s::timestamptz, %(end)s::timestamptz, interval '1 minute') g(t)
            LEFT JOIN approvals_approval a
                   ON a.created_at < g.t + interval '1 minute'
                  AND (a.decided_at IS NULL OR a.decided_at >= g.t + interval '1 minute')
            GROUP BY g.t ORDER BY g.t
            """,
            {"start": start, "end": now},
        )
    ]
    return [
        Sparkline("Runs finished per minute", _per_minute(Run.objects, "finished_at", start, minutes)),
        Sparkline("Dead letters per minute", _per_minute(DeadLetter.objects, "created_at", start, minutes)),
        Sparkline("Open approval cards", open_cards),
    ]


# /metrics


def metric_families(snap: Snapshot):
    def gauge(name, doc, labels=(), samples=None, value=None):
        family = GaugeMetricFamily(name, doc, labels=list(labels) if labels else None, value=value)
        for label_values, sample in samples or []:
            family.add_metric(list(label_values), sample)
        return family

    def counter(name, doc, labels=(), samples=None, value=None):
        family = CounterMetricFamily(name, doc, labels=list(labels) if labels else None, value=value)
        for label_values, sample in samples or []:
            family.add_metric(list(label_values), sample)
        return family

    queues = sorted(snap.queues.items())
    yield gauge(
        "hitl_queue_depth", "Jobs ready to run (todo, due now).", ["queue"], [((q,), v.depth) for q, v in queues]
    )
    yield gauge(
        "hitl_queue_scheduled",
        "Jobs waiting for a later time (retry backoff, timers).",
        ["queue"],
        [((q,), v.scheduled) for q, v in queues],
    )
    yield gauge(
        "hitl_queue_oldest_job_age_seconds",
        "How long the oldest ready job has waited (0 when none).",
        ["queue"],
        [((q,), v.oldest_age) for q, v in queues],
    )
    yield gauge("hitl_jobs_running", "Jobs a worker is running (doing).", value=snap.jobs_doing)
    yield gauge("hitl_jobs_stalled", "Running jobs whose worker stopped sending heartbeats.", value=snap.jobs_stalled)
    yield gauge("hitl_workers_alive", "Workers with a recent heartbeat.", value=snap.workers_alive)
    yield gauge(
        "hitl_runs", "Runs by status.", ["status"], [((status,), n) for status, n in snap.runs_by_status.items()]
    )
    yield gauge("hitl_dead_letters_open", "Dead letters neither requeued nor resolved.", value=snap.dead_letters_open)
    yield counter("hitl_dead_letters", "Dead letters ever written.", value=snap.dead_letters_total)
    yield gauge(
        "hitl_dead_letters_oldest_open_age_seconds",
        "Age of the oldest open dead letter (0 when none).",
        value=snap.dead_letter_oldest_open_age or 0,
    )
    yield gauge(
        "hitl_approvals_open",
        "Open approval cards (pending or escalated).",
        ["channel"],
        [((c,), n) for c, n, _, _ in snap.channels],
    )
    yield gauge(
        "hitl_approvals_sla_breached",
        "Open approval cards past their due time.",
        ["channel"],
        [((c,), n) for c, _, n, _ in snap.channels],
    )
    yield gauge(
        "hitl_approvals_oldest_open_age_seconds",
        "Age of the oldest open card (0 when none).",
        value=snap.oldest_card_age or 0,
    )
    yield gauge(
        "hitl_approvals_oldest_open_sla_seconds",
        "The SLA of the oldest open card: due time minus creation (0 when none).",
        value=snap.oldest_card_sla or 0,
    )
    labels = ["workflow", "step", "kind"]
    yield gauge(
        "hitl_step_attempts_10m",
        "Finished attempts of each step, over steps started in the last 10 minutes.",
        labels,
        [((t.workflow, t.step, t.kind), t.attempts) for t in snap.tool_errors],
    )
    yield gauge(
        "hitl_step_failed_attempts_10m",
        "Failed attempts of each step, over steps started in the last 10 minutes.",
        labels,
        [((t.workflow, t.step, t.kind), t.failed) for t in snap.tool_errors],
    )
    yield gauge(
        "hitl_step_error_ratio_10m",
        "Failed / finished attempts of each step over the last 10 minutes.",
        labels,
        [((t.workflow, t.step, t.kind), t.rate) for t in snap.tool_errors],
    )
    yield counter(
        "hitl_duplicates_blocked",
        "Side effects asked for again and answered from their receipt: replayed (a done receipt) or reconciled "
        "(an ambiguous write settled by a lookup or a person).",
        ["channel", "how"],
        sorted(snap.duplicates_blocked.items()),
    )
    yield gauge(
        "hitl_sandbox_duplicate_side_effects",
        "Calls beyond the first per idempotency key received by the demo's fake external systems.",
        value=snap.sandbox_duplicates,
    )
    yield counter(
        "hitl_tokens",
        "Model tokens used by all runs.",
        ["direction"],
        [(("in",), snap.tokens_in), (("out",), snap.tokens_out)],
    )
    yield counter("hitl_cost", "Model cost of all runs (currency units of the price table).", value=snap.cost)
    yield HistogramMetricFamily(
        "hitl_run_cost",
        "Cost per finished run.",
        buckets=[(_le(b), n) for b, n in snap.cost_buckets],
        sum_value=float(snap.finished_cost),
    )
    yield HistogramMetricFamily(
        "hitl_run_tokens",
        "Tokens (in + out) per finished run.",
        buckets=[(_le(b), n) for b, n in snap.token_buckets],
        sum_value=float(snap.finished_tokens),
    )
    yield counter(
        "hitl_retries",
        "Retries by cause (model/tool/engine x 429/5xx/timeout/error, owner_gone, no_job, shutdown).",
        ["cause"],
        [((cause,), n) for cause, n in sorted(snap.retries.items())],
    )
    workflows = sorted(set(snap.usual_seconds) | {r.workflow for r in snap.stuck})
    yield gauge(
        "hitl_runs_not_moving",
        "Queued or running runs without progress for 3x their workflow's usual active time (at least 2 min).",
        ["workflow"],
        [((w,), sum(1 for r in snap.stuck if r.workflow == w)) for w in workflows],
    )
    yield gauge(
        "hitl_workflow_usual_active_seconds",
        "Median active time (sum of step latencies) of the workflow's runs that succeeded in the last 7 days.",
        ["workflow"],
        [((w,), snap.usual_seconds.get(w, 0.0)) for w in workflows],
    )
    yield gauge(
        "hitl_kill_switch_engaged",
        "1 when the channel's kill switch is engaged.",
        ["channel"],
        [((c,), int(engaged)) for c, _, _, engaged in snap.channels],
    )
    yield gauge(
        "hitl_global_kill_switch_engaged",
        "1 when the global kill switch (every channel) is engaged.",
        value=int(snap.global_kill_switch),
    )
    yield gauge(
        "hitl_breaker_state",
        "1 for each external system's circuit breaker state (closed, open, half_open, forced_open), else 0.",
        ["system", "state"],
        [
            ((b.system, state), int(b.shown_state == state))
            for b in snap.breakers
            for state in ("closed", "open", "half_open", "forced_open")
        ],
    )
    yield gauge(
        "hitl_breaker_window_calls",
        "Calls counted in the breaker's sliding window.",
        ["system"],
        [((b.system,), b.calls) for b in snap.breakers],
    )
    yield gauge(
        "hitl_breaker_window_failures",
        "Failed calls (429, 5xx, timeouts) in the breaker's sliding window.",
        ["system"],
        [((b.system,), b.failures) for b in snap.breakers],
    )
    yield gauge(
        "hitl_breaker_held_back",
        "Calls held back (their steps waited) since the breaker last opened.",
        ["system"],
        [((b.system,), b.held_back) for b in snap.breakers],
    )
    yield gauge(
        "hitl_tenant_throttled_tokens_last_minute",
        "Model tokens used in the last minute by each tenant whose steps wait for the token rate limit.",
        ["tenant"],
        [((t.tenant,), t.used) for t in snap.throttled],
    )
    yield gauge(
        "hitl_token_rate_limit_per_minute",
        "Model tokens a tenant may use per minute (0: unlimited).",
        value=settings.TOKEN_RATE_LIMIT_PER_MINUTE,
    )
    yield counter(
        "hitl_shadow_answers",
        "Reviewers' answers on shadow cards: agree or disagree with the agent, per workflow and rule.",
        ["workflow", "rule", "agreement"],
        [
            ((a.workflow, a.rule_id, agreement), n)
            for a in snap.shadow_agreement
            for agreement, n in (("agree", a.agreed), ("disagree", a.disagreed))
        ],
    )
    yield gauge(
        "hitl_shadow_agreement_ratio",
        "Share of the answers on shadow cards that agreed with the agent, per workflow and rule.",
        ["workflow", "rule"],
        [((a.workflow, a.rule_id), a.rate) for a in snap.shadow_agreement],
    )
    yield counter(
        "hitl_shadow_effects",
        "Side effects that shadow mode recorded instead of sending, per channel.",
        ["channel"],
        sorted(((channel,), n) for channel, n in snap.shadow_effects.items()),
    )


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class DatabaseCollector(Collector):
    """Reads the database on each scrape (never at registration)."""

    def describe(self):
        return []

    def collect(self):
        yield from metric_families(snapshot())


registry = CollectorRegistry(auto_describe=False)
registry.register(DatabaseCollector())
