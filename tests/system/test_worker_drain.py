"""A worker told to stop keeps heartbeating while its jobs finish, in a real worker process.

procrastinate 3.10 cancels the heartbeat before it waits for running jobs: a job longer than
STALLED_AFTER_SECONDS then looks stalled, and another worker's sweep requeues a job that is still running.
The task below is loaded by the worker through WORKFLOW_MODULES (only in these tests)."""

from __future__ import annotations

import signal
import time

from django.db import connection
from procrastinate import sql
from procrastinate.contrib.django import app
from procrastinate.contrib.django.models import ProcrastinateJob

from tests.worker import FAST_WORKER_ENV, wait_with_logs, worker_logs

STALLED_AFTER = float(FAST_WORKER_ENV["STALLED_AFTER_SECONDS"])
HEARTBEAT = float(FAST_WORKER_ENV["WORKER_HEARTBEAT_INTERVAL"])
JOB_SECONDS = 3 * STALLED_AFTER


@app.task(name="test_worker.sleep", queue="test_worker")
def sleep(seconds: float) -> None:
    time.sleep(seconds)


def _heartbeat_age() -> float | None:
    """Seconds since the newest worker heartbeat, by the database's clock; None without a worker row."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXTRACT(EPOCH FROM now() - max(last_heartbeat)) FROM procrastinate_workers")
        (age,) = cursor.fetchone()
    return None if age is None else float(age)


def _stalled_job_ids() -> set[int]:
    # What JobManager.get_stalled_jobs(seconds_since_heartbeat=STALLED_AFTER) returns, which the sweep requeues.
    rows = app.connector.get_sync_connector().execute_query_all(
        sql.queries["select_stalled_jobs_by_heartbeat"],
        seconds_since_heartbeat=STALLED_AFTER,
        queue=None,
        task_name=None,
    )
    return {row["id"] for row in rows}


def test_a_draining_worker_keeps_heartbeating_until_its_job_ends(start_worker):
    worker = start_worker(WORKFLOW_MODULES=__name__, WORKER_SHUTDOWN_GRACEFUL_TIMEOUT=JOB_SECONDS + 10)
    job_id = sleep.defer(seconds=JOB_SECONDS)
    wait_with_logs(
        lambda: ProcrastinateJob.objects.filter(pk=job_id, status="doing").exists(), "the job to start", [worker]
    )

    worker.kill(signal.SIGTERM)
    signalled = time.monotonic()
    ages = []
    while worker.proc.poll() is None and time.monotonic() - signalled < JOB_SECONDS + 10:
        age = _heartbeat_age()
        if ProcrastinateJob.objects.filter(pk=job_id, status="doing").exists():
            ages.append(age)
            assert job_id not in _stalled_job_ids(), f"reported stalled while running\n{worker_logs([worker])}"
        time.sleep(0.1)
    took = time.monotonic() - signalled

    assert worker.proc.poll() == 0, f"the worker did not exit cleanly\n{worker_logs([worker])}"
    assert ProcrastinateJob.objects.get(pk=job_id).status == "succeeded", worker_logs([worker])
    # It drained: it waited for the job (which had most of its JOB_SECONDS left), then exited.
    assert took > JOB_SECONDS - STALLED_AFTER, f"exited after {took:.1f} s\n{worker_logs([worker])}"
    # Heartbeats kept coming all along (well within the stall threshold), and the row is gone once it exits.
    assert ages and all(age is not None for age in ages)
    assert max(ages) < HEARTBEAT + 1, f"heartbeat ages while draining: {ages}\n{worker_logs([worker])}"
    assert _heartbeat_age() is None


def test_a_worker_whose_job_outlives_the_graceful_timeout_exits_at_the_timeout(start_worker):
    """The step still running when WORKER_SHUTDOWN_GRACEFUL_TIMEOUT ends is left `doing` for the stalled-job
    sweep; the worker exits then, not when the step's thread ends (Python joins an executor's threads at exit):
    a supervisor's stop grace period of the timeout plus a margin is enough (compose.yaml, systemd's units)."""
    graceful = 2.0
    worker = start_worker(WORKFLOW_MODULES=__name__, WORKER_SHUTDOWN_GRACEFUL_TIMEOUT=graceful)
    job_id = sleep.defer(seconds=30)
    try:
        wait_with_logs(
            lambda: ProcrastinateJob.objects.filter(pk=job_id, status="doing").exists(), "the job to start", [worker]
        )
        worker.kill(signal.SIGTERM)
        signalled = time.monotonic()
        while worker.proc.poll() is None and time.monotonic() - signalled < 30:
            time.sleep(0.1)
        took = time.monotonic() - signalled

        assert worker.proc.poll() == 0, f"the worker did not exit cleanly\n{worker_logs([worker])}"
        assert took < graceful + 5, f"exited {took:.1f} s after SIGTERM\n{worker_logs([worker])}"
        # Left for the sweep, as after a crash, and said so.
        assert ProcrastinateJob.objects.get(pk=job_id).status == "doing"
        assert "still running past the graceful timeout" in worker_logs([worker])
    finally:
        with connection.cursor() as cursor:  # no later test's worker should take the 30 s job up
            cursor.execute("DELETE FROM procrastinate_jobs WHERE id = %s", [job_id])
