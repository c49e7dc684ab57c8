"""The jobs as they reach the queue, on Procrastinate's in-memory connector (procrastinate.testing): the run's job
with its locks, priority and delay, the periodic sweeps with their schedules and queueing locks, and the retry
strategy driving a failing job's retries in a real Procrastinate worker loop. That the queue keeps them through a
crash, a restart or a transaction that rolls back is PostgreSQL's, proved against it: tests/integration (e.g.
runs/test_api_runs.py, approvals/test_sla.py, approvals/test_notify.py) and tests/system (the workers)."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import procrastinate
import pytest
from procrastinate import exceptions
from procrastinate.contrib.django import app
from procrastinate.periodic import PeriodicDeferrer
from procrastinate.testing import InMemoryConnector

from approvals import tasks as approval_tasks
from jobs.retry import BackoffWithJitter
from runs import tasks as run_tasks
from runs.models import Run


def run_async(coroutine):
    """asyncio.run in a thread of its own: in the whole suite, Playwright's sync API (the browser tests' session
    fixture) may keep an event loop running in the main thread, where asyncio.run refuses to start."""
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(asyncio.run, coroutine).result()


@pytest.fixture
def queue():
    """The project's app on an in-memory queue: what `.defer()` writes lands in `queue.jobs`."""
    connector = InMemoryConnector()
    with app.replace_connector(connector):
        yield connector


# --- a run's job ------------------------------------------------------------------------------------------------------


def test_a_runs_job_waits_alone_for_it_and_runs_alone(queue):
    run = Run(priority=3)
    run.advance_job().defer()
    (job,) = queue.jobs.values()
    lock = f"run:{run.pk}"
    assert (job["task_name"], job["queue_name"], job["priority"]) == ("advance_run", "agent", 3)
    assert (job["lock"], job["queueing_lock"], job["args"]) == (lock, lock, {"run_id": str(run.pk)})
    assert job["scheduled_at"] is None  # at once
    # A second job while the first waits is refused: Run.enqueue reads that as "the waiting job will see it".
    with pytest.raises(exceptions.AlreadyEnqueued):
        run.advance_job().defer()
    # Once the first is taken, the next may wait behind it, under the same lock.
    job["status"] = "doing"
    run.advance_job().defer()
    assert len(queue.jobs) == 2


def test_a_runs_job_may_wait_a_delay_first(queue):
    before = datetime.now(UTC)
    Run(priority=0).advance_job(2.5).defer()
    (job,) = queue.jobs.values()
    assert before + timedelta(seconds=2.5) <= job["scheduled_at"] <= datetime.now(UTC) + timedelta(seconds=2.5)


def test_each_runs_job_has_a_lock_of_its_own(queue):
    first, second = Run(), Run()
    first.advance_job().defer()
    second.advance_job().defer()
    assert {job["lock"] for job in queue.jobs.values()} == {f"run:{first.pk}", f"run:{second.pk}"}


# --- the tasks: where they run and how they retry -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "queue_name", "retried"),
    [
        (run_tasks.advance_run, "agent", True),  # a failure outside any step: backoff, then the backstop
        (approval_tasks.send_notification, "outbound", True),  # a receiver down: backoff until NOTIFY_MAX_ATTEMPTS
        (approval_tasks.card_due, "hitl", False),  # a timer: the SLA sweep is behind it
        (run_tasks.requeue_stalled_jobs, "maintenance", False),  # periodic: the next tick is the retry
        (run_tasks.recover_runs, "maintenance", False),
        (approval_tasks.sla_sweep, "hitl", False),
        (approval_tasks.compact_inbox_counts, "maintenance", False),  # periodic: the next tick is the retry
    ],
)
def test_each_task_runs_on_its_queue_and_retries_only_with_backoff(task, queue_name, retried):
    assert task.queue == queue_name
    assert isinstance(task.retry_strategy, BackoffWithJitter) if retried else task.retry_strategy is None


def test_every_task_of_ours_is_on_a_queue_of_ours():
    """Not procrastinate's default queue, which a worker started with our queues would never read."""
    # The apps' own tasks: tests register tasks of their own on the same app, which a test may have imported first.
    apps = {"core", "jobs", "runs", "approvals", "external", "slackapp", "demo", "console"}
    ours = [task for task in app.tasks.values() if task.func.__module__.split(".")[0] in apps]
    assert len(ours) == 7
    assert {task.queue for task in ours} == {"agent", "outbound", "hitl", "maintenance"}


# --- the periodic sweeps ----------------------------------------------------------------------------------------------

TICK = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC).timestamp()  # a minute's start: every period's tick
SOON_AFTER = 0.5  # the deferrer wakes just after a tick (at the tick itself, the tick before is the last one)


def _defer_ticks_at(at: float, deferrer: PeriodicDeferrer | None = None) -> PeriodicDeferrer:
    deferrer = deferrer or PeriodicDeferrer(app.periodic_registry)

    async def defer():
        await deferrer.defer_jobs(jobs_to_defer=deferrer.get_previous_tasks(at=at))

    run_async(defer())
    return deferrer


def _waiting(queue) -> dict[str, list]:
    waiting: dict[str, list] = {}
    for job in queue.jobs.values():
        if job["status"] == "todo":
            waiting.setdefault(job["task_name"], []).append(job["args"]["timestamp"])
    return waiting


def test_the_sweeps_are_deferred_at_their_periods_one_waiting_at_a_time(queue, settings):
    assert (settings.STALLED_SWEEP_SECONDS, settings.SLA_SWEEP_SECONDS) == (10, 30)
    deferrer = _defer_ticks_at(TICK + SOON_AFTER)
    tick = int(TICK)
    assert _waiting(queue) == {
        "requeue_stalled_jobs": [tick],
        "runs.tasks.recover_runs": [tick],
        "approvals.tasks.sla_sweep": [tick],
        "approvals.tasks.compact_inbox_counts": [tick],
    }
    by_task = {job["task_name"]: job for job in queue.jobs.values()}
    assert by_task["requeue_stalled_jobs"]["queue_name"] == "maintenance"
    assert by_task["approvals.tasks.sla_sweep"]["queue_name"] == "hitl"
    assert {job["queueing_lock"] for job in queue.jobs.values()} == {
        "requeue_stalled_jobs",
        "recover_runs",
        "sla_sweep",
        "compact_inbox_counts",
    }

    # 10 s later the stalled-job sweeps are due again, but theirs still wait: a slow sweep is not stacked up.
    _defer_ticks_at(TICK + 10 + SOON_AFTER, deferrer)
    assert len(queue.jobs) == 4
    # Once they ran, the next tick defers them again; the SLA sweep and the compaction wait for their 30 s.
    for job in queue.jobs.values():
        job["status"] = "succeeded"
    _defer_ticks_at(TICK + 20 + SOON_AFTER, deferrer)
    assert _waiting(queue) == {"requeue_stalled_jobs": [tick + 20], "runs.tasks.recover_runs": [tick + 20]}
    _defer_ticks_at(TICK + 30 + SOON_AFTER, deferrer)
    assert _waiting(queue)["approvals.tasks.sla_sweep"] == [tick + 30]
    assert _waiting(queue)["approvals.tasks.compact_inbox_counts"] == [tick + 30]


def test_a_periodic_sweep_is_not_deferred_for_a_tick_long_past(queue):
    """A worker started after a long stop does not catch up on every tick it missed: at most one, recent."""
    deferrer = PeriodicDeferrer(app.periodic_registry, max_delay=5)
    _defer_ticks_at(TICK + 7, deferrer)  # the 10 s sweeps' tick was 7 s ago: ignored; the SLA sweep's too
    assert queue.jobs == {}


# --- retries, driven by a worker --------------------------------------------------------------------------------------


def test_a_failing_job_is_retried_after_a_jittered_backoff_until_the_backstop(settings):
    settings.RETRY_BASE_SECONDS, settings.RETRY_CAP_SECONDS = 1.0, 4.0
    connector = InMemoryConnector()
    own = procrastinate.App(connector=connector)
    calls = []

    @own.task(name="flaky", queue="test", retry=BackoffWithJitter(random.Random(5)))
    def flaky(n: int) -> None:
        calls.append(n)
        raise RuntimeError("the receiver is down")

    async def work():
        async with own.open_async():
            await own.run_worker_async(queues=["test"], wait=False, install_signal_handlers=False, listen_notify=False)

    flaky.defer(n=1)
    bounds = []
    for attempt in range(BackoffWithJitter.MAX_JOB_ATTEMPTS):
        before = datetime.now(UTC)
        run_async(work())
        (job,) = connector.jobs.values()
        if job["status"] == "failed":
            break
        assert (job["status"], job["attempts"]) == ("todo", attempt + 1)
        delay = (job["scheduled_at"] - before).total_seconds()
        bound = min(4.0, 1.0 * 2**attempt)
        assert -0.01 <= delay <= bound + 1, (attempt, delay)  # (+1: the worker's own time)
        bounds.append(bound)
        job["scheduled_at"] = datetime.now(UTC)  # the backoff waited out
    assert job["status"] == "failed" and len(calls) == BackoffWithJitter.MAX_JOB_ATTEMPTS
    assert bounds == [1, 2, 4, 4, 4, 4, 4, 4, 4]  # capped
