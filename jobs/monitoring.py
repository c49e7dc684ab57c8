"""The figures of the job queue (Procrastinate's tables), the workers and the dead-letter queue, for monitoring
(console.monitoring). Procrastinate's tables and columns read here are checked at start-up (jobs.internals)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Min, Q
from procrastinate.contrib.django.models import ProcrastinateJob, ProcrastinateWorker

from core.monitoring import per_minute, rows
from jobs.models import DeadLetter

QUEUES = ["agent", "outbound", "hitl", "maintenance"]  # DESIGN's queues; others are shown when they have jobs


@dataclass
class Queue:
    depth: int = 0  # todo jobs whose time has come
    scheduled: int = 0  # todo jobs scheduled later (retries with backoff, timers)
    oldest_age: float = 0.0  # seconds the oldest ready job has waited


@dataclass
class DeadLetters:
    open: int
    total: int
    oldest_open_age: float | None  # seconds


def queues(now: datetime) -> dict[str, Queue]:
    """Todo jobs per queue. A job waits from its scheduled time, or from when it was deferred."""
    found = {name: Queue() for name in QUEUES}
    for name, depth, scheduled, oldest in rows(
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


def jobs_running(now: datetime) -> tuple[int, int]:
    """Jobs a worker is running, and how many of those are stalled (their worker sent no recent heartbeat)."""
    doing = ProcrastinateJob.objects.filter(status="doing")
    stalled_since = now - timedelta(seconds=settings.STALLED_AFTER_SECONDS)
    stalled = doing.filter(Q(worker__isnull=True) | Q(worker__last_heartbeat__lt=stalled_since))
    return doing.count(), stalled.count()


def workers_alive(now: datetime) -> int:
    since = now - timedelta(seconds=settings.READY_HEARTBEAT_MAX_AGE)
    return ProcrastinateWorker.objects.filter(last_heartbeat__gte=since).count()


def dead_letters(now: datetime) -> DeadLetters:
    letters = DeadLetter.objects.aggregate(
        total=Count("id"),
        open=Count("id", filter=Q(resolved_at__isnull=True)),
        oldest=Min("created_at", filter=Q(resolved_at__isnull=True)),
    )
    oldest = (now - letters["oldest"]).total_seconds() if letters["oldest"] else None
    return DeadLetters(letters["open"], letters["total"], oldest)


def dead_letters_per_minute(start: datetime, minutes: int) -> list[int]:
    return per_minute(DeadLetter.objects, "created_at", start, minutes)
