"""/metrics: the snapshot (console.monitoring) as Prometheus metric families, one function per family, read
from the database on each scrape (a "counter" is a count of rows that only grows)."""

from __future__ import annotations

from django.conf import settings
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from console.monitoring import Snapshot, snapshot

STEP_LABELS = ["workflow", "step", "kind"]


def gauge(name: str, doc: str, labels=(), samples=None, value=None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels) if labels else None, value=value)
    for label_values, sample in samples or []:
        family.add_metric(list(label_values), sample)
    return family


def counter(name: str, doc: str, labels=(), samples=None, value=None) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels) if labels else None, value=value)
    for label_values, sample in samples or []:
        family.add_metric(list(label_values), sample)
    return family


def _queues(snap: Snapshot) -> list:
    return sorted(snap.queues.items())


def _workflows(snap: Snapshot) -> list[str]:
    return sorted(set(snap.usual_seconds) | {r.workflow for r in snap.stuck})


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def queue_depth(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_queue_depth", "Jobs ready to run (todo, due now).", ["queue"], [((q,), v.depth) for q, v in _queues(snap)]
    )


def queue_scheduled(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_queue_scheduled",
        "Jobs waiting for a later time (retry backoff, timers).",
        ["queue"],
        [((q,), v.scheduled) for q, v in _queues(snap)],
    )


def queue_oldest_job_age_seconds(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_queue_oldest_job_age_seconds",
        "How long the oldest ready job has waited (0 when none).",
        ["queue"],
        [((q,), v.oldest_age) for q, v in _queues(snap)],
    )


def jobs_running(snap: Snapshot) -> Metric:
    return gauge("hitl_jobs_running", "Jobs a worker is running (doing).", value=snap.jobs_doing)


def jobs_stalled(snap: Snapshot) -> Metric:
    return gauge("hitl_jobs_stalled", "Running jobs whose worker stopped sending heartbeats.", value=snap.jobs_stalled)


def workers_alive(snap: Snapshot) -> Metric:
    return gauge("hitl_workers_alive", "Workers with a recent heartbeat.", value=snap.workers_alive)


def runs(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_runs", "Runs by status.", ["status"], [((status,), n) for status, n in snap.runs_by_status.items()]
    )


def dead_letters_open(snap: Snapshot) -> Metric:
    return gauge("hitl_dead_letters_open", "Dead letters neither requeued nor resolved.", value=snap.dead_letters_open)


def dead_letters(snap: Snapshot) -> Metric:
    return counter("hitl_dead_letters", "Dead letters ever written.", value=snap.dead_letters_total)


def dead_letters_oldest_open_age_seconds(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_dead_letters_oldest_open_age_seconds",
        "Age of the oldest open dead letter (0 when none).",
        value=snap.dead_letter_oldest_open_age or 0,
    )


def approvals_open(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_approvals_open",
        "Open approval cards (pending or escalated).",
        ["channel"],
        [((c,), n) for c, n, _, _ in snap.channels],
    )


def approvals_sla_breached(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_approvals_sla_breached",
        "Open approval cards past their due time.",
        ["channel"],
        [((c,), n) for c, _, n, _ in snap.channels],
    )


def approvals_oldest_open_age_seconds(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_approvals_oldest_open_age_seconds",
        "Age of the oldest open card (0 when none).",
        value=snap.oldest_card_age or 0,
    )


def approvals_oldest_open_sla_seconds(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_approvals_oldest_open_sla_seconds",
        "The SLA of the oldest open card: due time minus creation (0 when none).",
        value=snap.oldest_card_sla or 0,
    )


def step_attempts_10m(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_step_attempts_10m",
        "Finished attempts of each step, over steps started in the last 10 minutes.",
        STEP_LABELS,
        [((t.workflow, t.step, t.kind), t.attempts) for t in snap.tool_errors],
    )


def step_failed_attempts_10m(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_step_failed_attempts_10m",
        "Failed attempts of each step, over steps started in the last 10 minutes.",
        STEP_LABELS,
        [((t.workflow, t.step, t.kind), t.failed) for t in snap.tool_errors],
    )


def step_error_ratio_10m(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_step_error_ratio_10m",
        "Failed / finished attempts of each step over the last 10 minutes.",
        STEP_LABELS,
        [((t.workflow, t.step, t.kind), t.rate) for t in snap.tool_errors],
    )


def duplicates_blocked(snap: Snapshot) -> Metric:
    return counter(
        "hitl_duplicates_blocked",
        "Side effects asked for again and answered from their receipt: replayed (a done receipt) or reconciled "
        "(an ambiguous write settled by a lookup or a person).",
        ["channel", "how"],
        sorted(snap.duplicates_blocked.items()),
    )


def sandbox_duplicate_side_effects(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_sandbox_duplicate_side_effects",
        "Calls beyond the first per idempotency key received by the demo's fake external systems.",
        value=snap.sandbox_duplicates,
    )


def tokens(snap: Snapshot) -> Metric:
    return counter(
        "hitl_tokens",
        "Model tokens used by all runs.",
        ["direction"],
        [(("in",), snap.tokens_in), (("out",), snap.tokens_out)],
    )


def cost(snap: Snapshot) -> Metric:
    return counter("hitl_cost", "Model cost of all runs (currency units of the price table).", value=snap.cost)


def run_cost(snap: Snapshot) -> Metric:
    return HistogramMetricFamily(
        "hitl_run_cost",
        "Cost per finished run.",
        buckets=[(_le(b), n) for b, n in snap.cost_buckets],
        sum_value=float(snap.finished_cost),
    )


def run_tokens(snap: Snapshot) -> Metric:
    return HistogramMetricFamily(
        "hitl_run_tokens",
        "Tokens (in + out) per finished run.",
        buckets=[(_le(b), n) for b, n in snap.token_buckets],
        sum_value=float(snap.finished_tokens),
    )


def retries(snap: Snapshot) -> Metric:
    return counter(
        "hitl_retries",
        "Retries by cause (model/tool/engine x 429/5xx/timeout/error, owner_gone, no_job, shutdown).",
        ["cause"],
        [((cause,), n) for cause, n in sorted(snap.retries.items())],
    )


def runs_not_moving(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_runs_not_moving",
        "Queued or running runs without progress for 3x their workflow's usual active time (at least 2 min).",
        ["workflow"],
        [((w,), sum(1 for r in snap.stuck if r.workflow == w)) for w in _workflows(snap)],
    )


def workflow_usual_active_seconds(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_workflow_usual_active_seconds",
        "Median active time (sum of step latencies) of the workflow's runs that succeeded in the last 7 days.",
        ["workflow"],
        [((w,), snap.usual_seconds.get(w, 0.0)) for w in _workflows(snap)],
    )


def kill_switch_engaged(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_kill_switch_engaged",
        "1 when the channel's kill switch is engaged.",
        ["channel"],
        [((c,), int(engaged)) for c, _, _, engaged in snap.channels],
    )


def global_kill_switch_engaged(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_global_kill_switch_engaged",
        "1 when the global kill switch (every channel) is engaged.",
        value=int(snap.global_kill_switch),
    )


def breaker_state(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_breaker_state",
        "1 for each external system's circuit breaker state (closed, open, half_open, forced_open), else 0.",
        ["system", "state"],
        [
            ((b.system, state), int(b.shown_state == state))
            for b in snap.breakers
            for state in ("closed", "open", "half_open", "forced_open")
        ],
    )


def breaker_window_calls(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_breaker_window_calls",
        "Calls counted in the breaker's sliding window.",
        ["system"],
        [((b.system,), b.calls) for b in snap.breakers],
    )


def breaker_window_failures(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_breaker_window_failures",
        "Failed calls (429, 5xx, timeouts) in the breaker's sliding window.",
        ["system"],
        [((b.system,), b.failures) for b in snap.breakers],
    )


def breaker_held_back(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_breaker_held_back",
        "Calls held back (their steps waited) since the breaker last opened.",
        ["system"],
        [((b.system,), b.held_back) for b in snap.breakers],
    )


def tenant_throttled_tokens_last_minute(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_tenant_throttled_tokens_last_minute",
        "Model tokens used in the last minute by each tenant whose steps wait for the token rate limit.",
        ["tenant"],
        [((t.tenant,), t.used) for t in snap.throttled],
    )


def token_rate_limit_per_minute(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_token_rate_limit_per_minute",
        "Model tokens a tenant may use per minute (0: unlimited).",
        value=settings.TOKEN_RATE_LIMIT_PER_MINUTE,
    )


def shadow_answers(snap: Snapshot) -> Metric:
    return counter(
        "hitl_shadow_answers",
        "Reviewers' answers on shadow cards: agree or disagree with the agent, per workflow and rule.",
        ["workflow", "rule", "agreement"],
        [
            ((a.workflow, a.rule_id, agreement), n)
            for a in snap.shadow_agreement
            for agreement, n in (("agree", a.agreed), ("disagree", a.disagreed))
        ],
    )


def shadow_agreement_ratio(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_shadow_agreement_ratio",
        "Share of the answers on shadow cards that agreed with the agent, per workflow and rule.",
        ["workflow", "rule"],
        [((a.workflow, a.rule_id), a.rate) for a in snap.shadow_agreement],
    )


def shadow_effects(snap: Snapshot) -> Metric:
    return counter(
        "hitl_shadow_effects",
        "Side effects that shadow mode recorded instead of sending, per channel.",
        ["channel"],
        sorted(((channel,), n) for channel, n in snap.shadow_effects.items()),
    )


def compensations(snap: Snapshot) -> Metric:
    return counter(
        "hitl_compensations",
        "Compensations of what runs did (undo), per workflow and outcome: done, declined (a person said no), "
        "by_hand (a person undid it), failed (failed for good, waiting for a person).",
        ["workflow", "outcome"],
        [((c.workflow, outcome), n) for c in snap.compensations for outcome, n in sorted(c.outcomes.items())],
    )


def runs_undone(snap: Snapshot) -> Metric:
    return counter(
        "hitl_runs_undone",
        "Runs undone, being undone or whose undo failed, per workflow.",
        ["workflow"],
        [((c.workflow,), c.undone) for c in snap.compensations],
    )


def compensation_ratio(snap: Snapshot) -> Metric:
    return gauge(
        "hitl_compensation_ratio",
        "Share of a workflow's runs that ended (finished, or undone) which were undone: the compensation rate.",
        ["workflow"],
        [((c.workflow,), c.rate) for c in snap.compensations],
    )


FAMILIES = [
    queue_depth,
    queue_scheduled,
    queue_oldest_job_age_seconds,
    jobs_running,
    jobs_stalled,
    workers_alive,
    runs,
    dead_letters_open,
    dead_letters,
    dead_letters_oldest_open_age_seconds,
    approvals_open,
    approvals_sla_breached,
    approvals_oldest_open_age_seconds,
    approvals_oldest_open_sla_seconds,
    step_attempts_10m,
    step_failed_attempts_10m,
    step_error_ratio_10m,
    duplicates_blocked,
    sandbox_duplicate_side_effects,
    tokens,
    cost,
    run_cost,
    run_tokens,
    retries,
    runs_not_moving,
    workflow_usual_active_seconds,
    kill_switch_engaged,
    global_kill_switch_engaged,
    breaker_state,
    breaker_window_calls,
    breaker_window_failures,
    breaker_held_back,
    tenant_throttled_tokens_last_minute,
    token_rate_limit_per_minute,
    shadow_answers,
    shadow_agreement_ratio,
    shadow_effects,
    compensations,
    runs_undone,
    compensation_ratio,
]


def metric_families(snap: Snapshot):
    for family in FAMILIES:
        yield family(snap)


class DatabaseCollector(Collector):
    """Reads the database on each scrape (never at registration)."""

    def describe(self):
        return []

    def collect(self):
        yield from metric_families(snapshot())


registry = CollectorRegistry(auto_describe=False)
registry.register(DatabaseCollector())
