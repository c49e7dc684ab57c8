"""The recovery sweep finishes an ownerless run's dead job through procrastinate's own procedure
(procrastinate_finish_job_v1), in the transaction that requeues the run, and only while that job is still `doing`."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, connections
from procrastinate.contrib.django.models import ProcrastinateJob

from runs import recovery, submission
from runs.models import Run
from tests.engine_helpers import SMALL_REFUND, queued_jobs
from tests.worker import database_url


@pytest.fixture
def demo(transactional_db):
    call_command("demo_setup", verbosity=0)


def _ownerless_run_and_its_dead_job(**job) -> tuple[Run, int]:
    """A run left `running` by a worker that died, and that worker's job of it, still `doing`."""
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    ProcrastinateJob.objects.filter(lock=f"run:{run.pk}").delete()
    columns = {"attempts": 0, "abort_requested": False, **job}
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO procrastinate_jobs (queue_name, task_name, lock, args, status, attempts, abort_requested)"
            " VALUES ('agent', 'advance_run', %s, '{}', 'doing', %s, %s) RETURNING id",
            [f"run:{run.pk}", columns["attempts"], columns["abort_requested"]],
        )
        dead_job = cursor.fetchone()[0]
    Run.objects.filter(pk=run.pk).update(status=Run.Status.RUNNING, owner="worker-that-died")
    return run, dead_job


def _job(job_id: int) -> tuple:
    return ProcrastinateJob.objects.values_list("status", "attempts", "abort_requested").get(pk=job_id)


def test_it_finishes_the_dead_job_as_procrastinate_finishes_a_job(demo):
    run, dead_job = _ownerless_run_and_its_dead_job(attempts=2, abort_requested=True)

    assert recovery.sweep()["owner_gone"] == 1

    # As a worker finishing it would: the attempt counted, the abort request cleared.
    assert _job(dead_job) == ("aborted", 3, False)
    assert Run.objects.values_list("status", "owner").get(pk=run.pk) == (Run.Status.QUEUED, "")
    assert queued_jobs(run) == 1


def test_the_job_stays_doing_when_the_run_cannot_be_recovered(demo):
    """All or nothing: the run's owner is not the one the sweep read (it moved meanwhile), so its recover() is
    refused, and the job's finish, made earlier in the same transaction, is rolled back with it."""
    run, dead_job = _ownerless_run_and_its_dead_job()

    assert recovery._recover_ownerless(run.pk, "another-owner") is False

    assert _job(dead_job) == ("doing", 0, False)
    assert Run.objects.values_list("status", "owner").get(pk=run.pk) == (Run.Status.RUNNING, "worker-that-died")
    assert queued_jobs(run) == 0


def test_a_job_requeued_while_the_sweep_waits_for_it_is_not_finished(demo):
    """The stalled-job sweep requeues the dead job (doing -> todo) in a transaction that commits while the
    recovery sweep waits for the row: the recovery sweep must read it again and leave it `todo` (procrastinate's
    procedure alone would finish a `todo` job too)."""
    run, dead_job = _ownerless_run_and_its_dead_job()
    outcome: dict = {}

    def sweep():
        try:
            outcome["repaired"] = recovery.sweep()
        finally:
            connections.close_all()

    url = database_url(connection.settings_dict)
    with psycopg.connect(url) as requeuer, psycopg.connect(url, autocommit=True) as watcher:
        requeuer.execute("UPDATE procrastinate_jobs SET status = 'todo' WHERE id = %s", [dead_job])  # row locked
        sweeper = threading.Thread(target=sweep)
        sweeper.start()
        deadline = time.monotonic() + 10
        while not _blocks_someone(watcher, requeuer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _blocks_someone(watcher, requeuer), "the sweep never waited for the job's row"
        requeuer.commit()
    sweeper.join(10)

    assert outcome["repaired"]["owner_gone"] == 1
    assert _job(dead_job) == ("todo", 0, False)


def _blocks_someone(watcher: psycopg.Connection, session: psycopg.Connection) -> bool:
    """Another backend waits for a lock that `session` holds (asked on `watcher`, in autocommit: pg_stat_activity
    is read once per transaction)."""
    row = watcher.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", [session.info.backend_pid]
    ).fetchone()
    return row[0] > 0
