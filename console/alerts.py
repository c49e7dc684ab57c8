"""The dashboard's states: each figure of the snapshot (console.monitoring) against the seed's alert thresholds
(docs/RUNBOOK.md, each signal with its runbook section); the queue's SLA is a setting (QUEUE_SLA_SECONDS)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings

from console.monitoring import Snapshot
from runs.monitoring import STUCK_FACTOR, STUCK_FLOOR

DEAD_LETTER_ALERT_AFTER = timedelta(minutes=30)
ERROR_RATE_LIMIT = 0.05
ERROR_RATE_MIN_ATTEMPTS = 20  # below this a single failure is not a rate (shown as warn, not alert)
CARD_SLA_WARN = 0.75  # share of a card's SLA used before the backlog warns
COST_FACTOR = 2  # the last hour's mean cost per run against the mean of runs.monitoring.USUAL_TIME_WINDOW before it
BACKLOG_MINUTES = 15  # queue depth above this many minutes of the last 15 minutes' throughput

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
