from __future__ import annotations

import contextvars

import structlog
from django.conf import settings
from procrastinate.contrib.django import app

from jobs.retry import BackoffWithJitter
from runs import engine

log = structlog.get_logger("runs.tasks")

_worker = contextvars.ContextVar("procrastinate_worker", default=None)


def _expose_worker(call_next, context, worker):
    """Task middleware: lets the engine see that its worker was asked to stop (SIGTERM) before the graceful
    timeout runs out, so it stops between steps at once rather than when the job is aborted."""
    token = _worker.set(worker)
    try:
        return call_next()
    finally:
        _worker.reset(token)


def _worker_stopping() -> bool:
    worker = _worker.get()
    # procrastinate sets this event when the worker is told to stop; it has no public accessor.
    return worker is not None and worker._stop_event.is_set()


@app.task(
    name="advance_run",
    queue="agent",
    pass_context=True,
    retry=BackoffWithJitter(),
    task_middleware=[_expose_worker],
)
def advance_run(context, run_id: str) -> None:
    engine.advance(
        run_id,
        engine.JobInfo(
            job_id=context.job.id,
            attempts=context.job.attempts,
            should_stop=lambda: context.should_abort() or _worker_stopping(),
        ),
    )


@app.periodic(cron=settings.STALLED_SWEEP_CRON)
@app.task(name="requeue_stalled_jobs", queue="maintenance", queueing_lock="requeue_stalled_jobs", pass_context=True)
async def requeue_stalled_jobs(context, timestamp: int) -> None:
    """Jobs whose worker stopped sending heartbeats (killed, or its machine died) go back to the queue; the
    run then resumes from its last checkpoint."""
    manager = context.app.job_manager
    stalled = await manager.get_stalled_jobs(seconds_since_heartbeat=settings.STALLED_AFTER_SECONDS)
    for job in stalled:
        await manager.retry_job(job)
        log.warning(
            "requeued a stalled job",
            job_id=job.id,
            task=job.task_name,
            job_lock=job.lock,
            cause="worker crash",
        )
