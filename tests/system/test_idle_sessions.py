"""Idle timeouts and session resets must not end, or outlive, a worker's run locks (issue 24, defect 11).

A job holds its run's advisory lock for as long as its session lives (runs.ownership). While a step waits on a slow
external call, that session sits idle: PostgreSQL's `idle_session_timeout` (or, in a transaction,
`idle_in_transaction_session_timeout`) would end it, the lock with it, and another worker would take the run while
the call is still in flight. And a session pool whose reset does not release advisory locks (PgBouncer with an
emptied `server_reset_query`) keeps a dead worker's locks on a pooled server connection, so its runs are never
recovered.

* A worker whose database role has `idle_session_timeout = 1s` (a role of the test's own: the server and its other
  databases are left alone) drives a run whose effect takes 4 s: its sessions live through it (workers set both
  timeouts to 0 on every session they open), the effect happens once and nobody else takes the run.
* The start-up probe (jobs.sessions.check_locks_end_with_sessions), directly and through PgBouncer session pools
  with several `server_reset_query` values; and a real worker behind a session pool with an empty one refuses to
  start, naming the setting, and claims nothing.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections import Counter
from pathlib import Path

import psycopg
import psycopg_pool
import pytest
from django.core.management import call_command
from django.db import connection
from procrastinate.contrib.django.models import ProcrastinateJob
from psycopg import sql

import tests.agent_workflows  # noqa: F401 - registers test_agent in this process too
from core.models import AuditEntry
from demo.models import SandboxCall
from jobs.session_life import LocksOutliveSessions, check_locks_end_with_sessions
from runs import submission
from runs.models import Run
from tests.engine_helpers import SMALL_REFUND
from tests.pgbouncer import PGBOUNCER, PgBouncer
from tests.system.conftest import describe_runs, jobs_doing
from tests.worker import database_url, settles_as, wait_with_logs

IDLE_TIMEOUT = "1s"
# The note's external call: in flight this long before it is applied, four times the idle timeout.
EFFECT_SECONDS = 4
SETTLE = 60


@pytest.fixture
def idle_role(transactional_db) -> str:
    """A login role of the test's own whose sessions on the test database end after 1 s idle. Superuser, so that it
    reads and writes every table as the test's own role does: what differs is only the timeouts."""
    db = dict(connection.settings_dict)
    name = f"idle_worker_{secrets.token_hex(4)}"
    role = sql.Identifier(name)
    with psycopg.connect(database_url(db), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(role))
        for setting in ("idle_session_timeout", "idle_in_transaction_session_timeout"):
            admin.execute(
                sql.SQL("ALTER ROLE {} IN DATABASE {} SET {} = {}").format(
                    role, sql.Identifier(db["NAME"]), sql.Identifier(setting), sql.Literal(IDLE_TIMEOUT)
                )
            )
    yield name
    with psycopg.connect(database_url(db), autocommit=True) as admin:
        # The workers are stopped (the system fixture ends first); a session that lingers must not keep the role.
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [name])
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(role))


@pytest.fixture
def system_env(idle_role) -> dict:
    """The test agent (tests.agent_workflows) on workers that connect as the idle role; the web tier as before."""
    return {
        "WORKFLOW_MODULES": "tests.agent_workflows",
        "AGENT_MODEL": "tests.agent_workflows.ScriptedChat",
        "STALLED_SWEEP_SECONDS": "1",
        "WORKER_DATABASE_URL": database_url({**connection.settings_dict, "USER": idle_role, "PASSWORD": ""}),
    }


def worker_backends(role: str) -> dict[int, str]:
    """The workers' sessions as `role`, by backend pid, with their names (`<name>:<pid>:<role>`: jobs.sessions). A
    session without a name is not a worker's: the test's own probe, whose backend may still be leaving
    pg_stat_activity after it closed."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, application_name FROM pg_stat_activity WHERE usename = %s AND application_name <> ''", [role]
        )
        return dict(cursor.fetchall())


def test_a_worker_keeps_its_run_lock_through_a_call_longer_than_the_idle_timeout(system, idle_role):
    """Before the fix, PostgreSQL ended the job's session 1 s into the note's 4 s call: the run's lock went with
    it, the sweep gave the run to another job (an `owner_gone` retry), the old job lost ownership, and the
    worker's pool and LISTEN connections died too (an outage in the log)."""
    url = database_url({**connection.settings_dict, "USER": idle_role, "PASSWORD": ""})
    with psycopg.connect(url) as probe:  # the role's sessions do have the timeout
        assert probe.execute("SHOW idle_session_timeout").fetchone()[0] == IDLE_TIMEOUT

    run_id = system.submit(
        {
            "message": "my order never came",
            "script": [{"calls": [["note", {"text": "customer asked for a refund"}]]}, {"answer": "Noted."}],
            "slow": {"helper.turn1.1.note": EFFECT_SECONDS},
        },
        workflow="test_agent",
    )
    run = Run.objects.get(pk=run_id)
    # The note's receipt is written before its call: pending while the call is in flight.
    wait_with_logs(
        lambda: run.receipts.filter(status="pending").exists(), "the note's call to start", system.workers.all
    )
    # Both workers past their start-up (jobs.worker's _register): its probe closes a connection of the pool, whose
    # backend, sampled here while it leaves, would read as a session that ended (seen once, on a loaded machine).
    wait_with_logs(lambda: all(w.ready for w in system.workers.all), "both workers to start", system.workers.all)
    # The sessions there in two samples 0.5 s apart, while the call is in flight (4 s): a backend leaving as the
    # first is taken (the start-up probe's, once more in CI on 2026-12-06) is not one the call must keep, and one
    # the idle timeout would end (1 s) is in both and still ends before the call does.
    first = worker_backends(idle_role)
    time.sleep(0.5)
    before = {pid: name for pid, name in worker_backends(idle_role).items() if first.get(pid) == name}

    settles_as(run, Run.Status.SUCCEEDED, system.workers.all, timeout=SETTLE)
    after = worker_backends(idle_role)
    logs = system.workers.logs()
    notes = SandboxCall.objects.filter(run_id=run.id, system="crm").values_list("payload__text", flat=True)
    assert list(notes) == ["customer asked for a refund"], describe_runs([run.id])
    turns = Counter(SandboxCall.objects.filter(run_id=run.id, system="model").values_list("payload__turn", flat=True))
    assert turns == {1: 1, 2: 1}, describe_runs([run.id])
    assert list(run.steps.order_by("seq").values_list("name", "status", "attempt")) == [
        ("helper.turn1", "done", 1),
        ("helper.turn1.1.note", "done", 1),
        ("helper.turn2", "done", 1),
        ("helper", "done", 1),
        ("after", "done", 1),
    ], describe_runs([run.id])
    assert not AuditEntry.objects.filter(action="run.retry", run_id=run.id).exists(), describe_runs([run.id])
    assert "lost ownership of the run" not in logs, logs
    assert "database unreachable" not in logs, logs
    # No session of the workers ended: every backend they held while the call was in flight is still there.
    ended = {pid: name for pid, name in before.items() if after.get(pid) != name}
    assert not ended, (ended, logs)
    assert jobs_doing() == []
    # Each worker said at start-up what its pooler must not do.
    for worker in system.workers.all:
        assert "client_idle_timeout" in worker.log(), worker.log()[-3000:]


# --- session resets ---------------------------------------------------------------------------------------------

needs_pgbouncer = pytest.mark.skipif(not Path(PGBOUNCER).exists(), reason=f"no PgBouncer at {PGBOUNCER}")


@pytest.fixture
def test_db(db) -> dict:
    """The test database's connection settings (its name once pytest-django has created it and given the test its
    connection)."""
    return dict(connection.settings_dict)


@needs_pgbouncer
@pytest.mark.parametrize(
    ("reset", "refused"),
    [
        (None, False),  # PostgreSQL itself: a closed connection's backend exits
        ("DISCARD ALL", False),  # PgBouncer's default
        ("SELECT pg_advisory_unlock_all()", False),
        ("", True),
        ("RESET ALL", True),
    ],
)
def test_the_probe_tells_whether_a_session_ends_with_its_locks(test_db, reset, refused):
    """jobs.sessions.check_locks_end_with_sessions on a pool of two connections, as a worker's, directly and
    through PgBouncer session pools with each `server_reset_query`."""
    bouncer = PgBouncer(test_db, "session", server_reset_query=reset) if reset is not None else None
    url = bouncer.url(test_db["NAME"]) if bouncer else database_url(test_db)

    async def probe() -> None:
        async with psycopg_pool.AsyncConnectionPool(url, min_size=2, open=False) as pool:
            await check_locks_end_with_sessions(pool)

    try:
        if refused:
            with pytest.raises(LocksOutliveSessions, match=re.escape("server_reset_query")):
                asyncio.run(probe())
        else:
            asyncio.run(probe())
        # Nothing of the probe is left behind, refused or not: no advisory lock is held in the test database (a
        # refusal ends the pooled session that kept it).
        with psycopg.connect(database_url(test_db), autocommit=True) as admin:
            held = admin.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ).fetchone()
        assert held == (0,)
    finally:
        if bouncer:
            bouncer.stop()


@needs_pgbouncer
def test_a_worker_behind_a_session_pool_that_keeps_locks_refuses_to_start_and_claims_nothing(start_worker, test_db):
    """Before the fix the worker started, and a run's lock left by a dead worker on a pooled server connection
    would have kept the run from ever being recovered."""
    call_command("demo_setup", verbosity=0)
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    bouncer = PgBouncer(test_db, "session", server_reset_query="")
    try:
        worker = start_worker(WORKER_DATABASE_URL=bouncer.url(test_db["NAME"]))
        code = worker.wait(60)
        log = worker.log()
    finally:
        bouncer.stop()
    assert code != 0, log[-3000:]
    assert "CommandError: A session of this worker's database connections outlives its connection" in log, log[-3000:]
    assert "server_reset_query = DISCARD ALL" in log, log[-3000:]
    assert "Starting worker" not in log
    assert list(ProcrastinateJob.objects.values_list("status", "attempts", "worker_id")) == [("todo", 0, None)]
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM procrastinate_workers")
        assert cursor.fetchone()[0] == 0
    assert Run.objects.get(pk=run.pk).status == Run.Status.QUEUED
