"""The engine's worker tasks (procrastinate): `advance_run` drives a run, and two periodic sweeps requeue the jobs
of dead workers and give a job to the runs whose owner is gone and the queued runs without one (runs.recovery)."""

from __future__ import annotations

import contextvars

import structlog
from django.conf import settings
from procrastinate import exceptions
from procrastinate.contrib.django import app
from procrastinate.jobs import Status

from jobs.retry import BackoffWithJitter
from runs import engine, recovery

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
            worker=context.worker_name,
        ),
    )


@app.periodic(cron=settings.STALLED_SWEEP_CRON)
@app.task(name="requeue_stalled_jobs", queue="maintenance", queueing_lock="requeue_stalled_jobs", pass_context=True)
async def requeue_stalled_jobs(context, timestamp: int) -> None:
    """Jobs whose worker stopped sending heartbeats (killed, or its machine died) go back to the queue. For
    runs this is only a wake-up: a requeued job drives its run only if it can take the run's lock, which a
    live owner still holds (runs.ownership), and runs whose owner died are also found by `recover_runs`."""
    manager = context.app.job_manager
    stalled = await manager.get_stalled_jobs(seconds_since_heartbeat=settings.STALLED_AFTER_SECONDS)
    for job in stalled:
        try:
            await manager.retry_job(job)
        except exceptions.UniqueViolation:
            # Another job of the same queueing lock already waits (a run re-enqueued meanwhile, or the next tick
            # of a periodic task): that one carries on, and this one must leave `doing`, or its lock would keep the
            # waiting one from starting. Aborted, not failed: its worker died, the job did not fail.
            try:
                await manager.finish_job_by_id_async(job.id, status=Status.ABORTED, delete_job=False)
            except exceptions.ProcrastinateException:
                continue  # finished meanwhile (the recovery sweep got there first): nothing left to do
            outcome = "finished: a newer job of its lock waits"
        except Exception as exc:  # noqa: BLE001 - one bad job must not stop the sweep for the others
            log.exception("could not requeue a stalled job", job_id=job.id, task=job.task_name, error=str(exc))
            continue
        else:
            outcome = "requeued"
        log.warning(
            "stalled job", outcome=outcome, job_id=job.id, task=job.task_name, job_lock=job.lock, cause="worker crash"
        )


@app.periodic(cron=settings.STALLED_SWEEP_CRON)
@app.task(name="runs.tasks.recover_runs", queue="maintenance", queueing_lock="recover_runs")
def recover_runs(timestamp: int) -> dict[str, int]:
    """Runs whose owner's session ended, and queued runs without a job, get a job (runs.recovery)."""
    return recovery.sweep()
