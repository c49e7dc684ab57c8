"""A real worker runs the periodic sweep for stalled jobs at its period (the schedules themselves:
tests/unit/test_schedules.py)."""

from __future__ import annotations

from django.db import connection

from tests.worker import wait_with_logs


def test_a_real_worker_sweeps_for_stalled_jobs_every_period(start_worker):
    period = 2
    worker = start_worker(STALLED_SWEEP_SECONDS=period)

    def sweeps() -> list[tuple[int, float]]:
        # Each tick is one job whose `timestamp` argument is the tick; its `started` event is when it ran.
        with connection.cursor() as cursor:
            cursor.execute(
                """SELECT (j.args->>'timestamp')::bigint, extract(epoch FROM e.at)::float
                   FROM procrastinate_jobs j JOIN procrastinate_events e ON e.job_id = j.id AND e.type = 'started'
                   WHERE j.task_name = 'requeue_stalled_jobs' AND j.status = 'succeeded' ORDER BY 1"""
            )
            return cursor.fetchall()

    ran = wait_with_logs(lambda: len(found := sweeps()) >= 5 and found, "five stalled-job sweeps", [worker], 60)
    ticks = [tick for tick, _ in ran]
    assert all(tick % period == 0 for tick in ticks), ticks
    assert [b - a for a, b in zip(ticks, ticks[1:], strict=False)] == [period] * (len(ticks) - 1), ticks
    started = [at for _, at in ran][1:]  # the first is the tick just before the worker started, run at once
    for a, b in zip(started, started[1:], strict=False):
        assert period - 1 < b - a < period + 1, started
