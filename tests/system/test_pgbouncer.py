"""Workers and PgBouncer (docs/deploy.md, "Connections and PgBouncer").

* A worker holds exactly `jobs.sessions.connections_per_worker(concurrency, pool size)` connections, counted at
  the server by the names its connections give themselves (`worker:<pid>:<role>`), at two concurrencies.
* A worker behind a transaction-mode PgBouncer stops at start-up with the clear message, and claims nothing.
* 16 worker processes through a session-mode PgBouncer, the web tier through a transaction-mode one, while runs
  flow and workers are SIGKILLed at random: every run settles once (no duplicate effect, nothing left doing), and
  the clients PgBouncer sees never exceed the formula.

Debian's PgBouncer (`make pgbouncer`, which `make test` runs) is started by the test on a free port with an ini of
its own (tests/pgbouncer.py). Sizes: PGBOUNCER_WORKERS (16), PGBOUNCER_RUNS (40), PGBOUNCER_KILLS (6),
PGBOUNCER_SEED.
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import psycopg
import psycopg_pool
import pytest
from django.core.management import call_command
from django.db import connection
from procrastinate.contrib.django.models import ProcrastinateJob

from core.models import AuditEntry
from jobs.sessions import SessionPoolingRequired, check_own_sessions, connections_per_worker
from runs import submission
from runs.models import Run
from tests.engine_helpers import SMALL_REFUND
from tests.pgbouncer import PGBOUNCER, PgBouncer
from tests.system.conftest import (
    Approver,
    describe_runs,
    effects_per_run,
    env_int,
    jobs_doing,
    report,
    sandbox_stats,
)
from tests.system.test_chaos import chaos_input
from tests.worker import database_url, wait_until

pytestmark = pytest.mark.skipif(not Path(PGBOUNCER).exists(), reason=f"no PgBouncer at {PGBOUNCER}: make pgbouncer")

WORKERS = env_int("PGBOUNCER_WORKERS", 16)
RUNS = env_int("PGBOUNCER_RUNS", 40)
KILLS = env_int("PGBOUNCER_KILLS", 6)
SPACING = 0.5  # seconds between two submissions
SEED = env_int("PGBOUNCER_SEED", 20261202)
# Small workers: 16 of them share 2 cores with the web server and PostgreSQL.
CONCURRENCY = 1
POOL_SIZE = 2


def worker_connections(pid: int) -> Counter:
    """The connections of the worker process `pid` open at the server, by role (pool, listen, job)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT split_part(application_name, ':', 3), count(*) FROM pg_stat_activity"
            " WHERE application_name LIKE %s GROUP BY 1",
            [f"worker:{pid}:%"],
        )
        return Counter(dict(cursor.fetchall()))


@pytest.mark.parametrize("concurrency", [1, 8])
def test_a_worker_holds_the_connections_the_formula_says(start_worker, concurrency):
    """Once `concurrency` jobs have run at once, a worker holds its pool, one LISTEN connection and one connection
    per job thread, and no more however many jobs follow. 8 is more than asyncio's default executor has threads on
    a 2-core machine (cores + 4), which once capped a worker's sync jobs there."""
    call_command("demo_setup", verbosity=0)
    pool_size = 3
    worker = start_worker(WORKER_CONCURRENCY=concurrency, WORKER_POOL_SIZE=pool_size)
    # Counted once it has started (procrastinate's "Starting worker", after jobs.worker's _register): its start-up
    # probe closes a connection of its pool, whose backend can still stand beside the one the pool opens in its
    # place (a peak of pool 4 of 3, seen once in CI on a loaded machine).
    wait_until(lambda: "Starting worker" in worker.log(), timeout=60, message="the worker to start")
    # Slow runs, several times as many as the worker runs at once: every job thread has run one.
    runs = [
        submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {"classify": ["latency:400"]}})[0]
        for _ in range(3 * concurrency)
    ]
    peak: Counter = Counter()

    def settled() -> bool:
        for role, n in worker_connections(worker.pid).items():
            peak[role] = max(peak[role], n)
        return not Run.objects.filter(pk__in=[run.pk for run in runs]).exclude(status=Run.Status.SUCCEEDED).exists()

    wait_until(settled, timeout=60, message="the runs to succeed")
    held = worker_connections(worker.pid)
    report(f"connections of one worker, concurrency {concurrency}", held=dict(held), peak=dict(peak))
    expected = {"pool": pool_size, "listen": 1, "job": concurrency}
    assert held == peak == expected, worker.log()[-3000:]
    assert sum(held.values()) == connections_per_worker(concurrency, pool_size)


@pytest.fixture
def test_db(django_db_setup) -> dict:
    """The test database's connection settings (its name once pytest-django has created it)."""
    return dict(connection.settings_dict)


def test_a_worker_behind_a_transaction_pool_refuses_to_start_and_claims_nothing(start_worker, test_db):
    call_command("demo_setup", verbosity=0)
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    bouncer = PgBouncer(test_db, "transaction")
    try:
        # The web tier's URL stays direct; only the worker's goes through the transaction pool.
        worker = start_worker(WORKER_DATABASE_URL=bouncer.url(test_db["NAME"]))
        code = worker.wait(60)
        log = worker.log()
    finally:
        bouncer.stop()
    assert code != 0, log[-3000:]
    assert "CommandError: This worker's database connections do not keep their PostgreSQL session" in log, log[-3000:]
    assert "Point WORKER_DATABASE_URL at PostgreSQL directly or at a session-mode pool" in log
    assert "Starting worker" not in log
    # Nothing claimed, nothing registered: the run waits for a worker that can own it.
    assert list(ProcrastinateJob.objects.values_list("status", "attempts", "worker_id")) == [("todo", 0, None)]
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM procrastinate_workers")
        assert cursor.fetchone()[0] == 0
    assert Run.objects.get(pk=run.pk).status == Run.Status.QUEUED


@pytest.mark.parametrize(
    ("pool_mode", "refused"),
    [
        (None, None),  # PostgreSQL itself
        ("session", None),
        ("transaction", "one connection's transaction ran on another's backend"),
        ("statement", "a transaction block was refused (transaction blocks not allowed in statement pooling mode)"),
    ],
)
def test_the_probe_tells_a_session_from_a_pooled_transaction(test_db, pool_mode, refused):
    """jobs.sessions.check_own_sessions on a pool of two connections, as a worker's, directly and through each of
    PgBouncer's modes."""
    bouncer = PgBouncer(test_db, pool_mode) if pool_mode else None
    url = bouncer.url(test_db["NAME"]) if bouncer else database_url(test_db)

    async def probe() -> None:
        async with psycopg_pool.AsyncConnectionPool(url, min_size=2, open=False) as pool:
            await check_own_sessions(pool)

    try:
        if refused is None:
            asyncio.run(probe())
        else:
            with pytest.raises(SessionPoolingRequired, match=re.escape(refused)):
                asyncio.run(probe())
    finally:
        if bouncer:
            bouncer.stop()


@pytest.fixture
def bouncers(test_db):
    """A session-mode PgBouncer for the workers, a transaction-mode one for the web tier."""
    session = PgBouncer(test_db, "session", default_pool_size=WORKERS * connections_per_worker(CONCURRENCY, POOL_SIZE))
    transaction = PgBouncer(test_db, "transaction", default_pool_size=4)
    yield session, transaction
    session.stop()
    transaction.stop()


@pytest.fixture
def system_env(bouncers, test_db, monkeypatch) -> dict:
    """The system (tests/system/conftest.py) with its web server on the transaction pool and WORKERS small workers
    on the session pool, polling less often than other system tests do: 16 idle workers polling 5 times a second
    would take a core of their own."""
    session, transaction = bouncers
    monkeypatch.setenv("SYSTEM_WORKERS", str(WORKERS))
    return {
        "DATABASE_URL": transaction.url(test_db["NAME"]),
        "DATABASE_TRANSACTION_POOL": "1",
        "WORKER_DATABASE_URL": session.url(test_db["NAME"]),
        "WORKER_CONCURRENCY": str(CONCURRENCY),
        "WORKER_POOL_SIZE": str(POOL_SIZE),
        "WORKER_POLL_INTERVAL": "1",  # LISTEN wakes a worker at once; the poll is the fallback
        "WORKER_HEARTBEAT_INTERVAL": "1",
        "STALLED_AFTER_SECONDS": "4",
        "STALLED_SWEEP_SECONDS": "2",
        "TENANT_MAX_RUNNING": "4",
    }


class ConnectionWatch(threading.Thread):
    """Samples, every half second, the connections the workers hold: the clients the session-mode PgBouncer sees,
    by worker pid (from their application_name, worker:<pid>:<role>), and the server connections it holds."""

    def __init__(self, session: PgBouncer, database: str):
        super().__init__(daemon=True, name="connection-watch")
        self.session = session
        self.database = database
        self.stopping = threading.Event()
        self.max_clients = 0
        self.max_servers = 0
        self.max_per_worker: Counter = Counter()  # pid -> most connections seen at once
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stopping.wait(0.5):
            try:
                clients = [c for c in self.session.admin("SHOW CLIENTS") if c["database"] == self.database]
                servers = [s for s in self.session.admin("SHOW SERVERS") if s["database"] == self.database]
            except psycopg.Error as exc:
                self.errors.append(str(exc))
                continue
            self.max_clients = max(self.max_clients, len(clients))
            self.max_servers = max(self.max_servers, len(servers))
            for pid, n in Counter(c["application_name"].split(":")[1] for c in clients).items():
                self.max_per_worker[pid] = max(self.max_per_worker[pid], n)

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)


def test_sixteen_workers_behind_pgbouncer_finish_every_run_once_while_some_are_killed(system, bouncers, test_db):
    """16 small workers (concurrency 1, a pool of 2: 4 connections each) through a session-mode PgBouncer, the web
    tier through a transaction-mode one; runs arrive through the API while workers are SIGKILLed and replaced."""
    session, _ = bouncers
    rng = random.Random(SEED)
    per_worker = connections_per_worker(CONCURRENCY, POOL_SIZE)
    watch = ConnectionWatch(session, test_db["NAME"])
    watch.start()
    approver = Approver(system.reviewer)
    approver.start()
    inputs = [chaos_input(i, rng) for i in range(RUNS)]
    started = time.monotonic()
    submit_errors: list[str] = []

    def submit_all() -> None:
        for i, run_input in enumerate(inputs):
            try:
                system.submit(run_input, tenant=f"tenant-{i % 4}")
            except AssertionError as exc:
                submit_errors.append(str(exc))
            time.sleep(SPACING)

    submitter = threading.Thread(target=submit_all, name="submitter", daemon=True)
    submitter.start()
    kills = 0
    while kills < KILLS:
        time.sleep(rng.uniform(1.5, 3))
        working = [w for w in system.workers.all if w.ready]
        if not working:
            continue
        victim = rng.choice(working)
        victim.kill(signal.SIGKILL)
        victim.wait(10)
        kills += 1
        system.workers.start()
    chaos_ended = time.monotonic()
    submitter.join(120)
    statuses = system.wait_for_runs(system.submitted, timeout=120)
    settled = time.monotonic()
    approver.stop()
    watch.stop()
    run_ids = list(system.submitted)
    stats = sandbox_stats()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name LIKE 'worker:%%'",
            [test_db["NAME"]],
        )
        at_server = cursor.fetchone()[0]
    report(
        "16 workers behind PgBouncer",
        workers=WORKERS,
        connections_per_worker=per_worker,
        kills=kills,
        runs=len(run_ids),
        statuses=dict(statuses),
        most_worker_clients_at_once=watch.max_clients,
        most_server_connections_at_once=watch.max_servers,
        worker_connections_at_the_server_after=at_server,
        most_connections_of_one_worker=max(watch.max_per_worker.values(), default=0),
        retries_by_cause=dict(
            Counter(AuditEntry.objects.filter(action="run.retry").values_list("data__cause", flat=True))
        ),
        cards_decided=dict(approver.decided),
        sandbox=stats,
        chaos_s=chaos_ended - started,
        settle_after_chaos_s=settled - chaos_ended,
    )
    assert not submit_errors, submit_errors[:5]
    assert not approver.errors, approver.errors[:5]
    assert not watch.errors, watch.errors[:5]
    not_succeeded = [r for r, s in Run.objects.filter(pk__in=run_ids).values_list("id", "status") if s != "succeeded"]
    assert len(run_ids) == RUNS and not not_succeeded, (
        f"{dict(statuses)}\n{describe_runs(map(str, not_succeeded))}\n{system.server.errors()}"
    )
    payments, emails = effects_per_run(run_ids, "payments"), effects_per_run(run_ids, "email")
    assert set(payments.values()) == {1}, {r: n for r, n in payments.items() if n != 1}
    assert set(emails.values()) == {1}, {r: n for r, n in emails.items() if n != 1}
    assert stats["duplicates"] == 0
    assert jobs_doing() == []
    # The connections: no worker above the formula, and never more than the workers' sum, at PgBouncer (its
    # clients and the server connections it opened for them) and at the server.
    assert max(watch.max_per_worker.values()) <= per_worker, watch.max_per_worker
    assert watch.max_clients <= WORKERS * per_worker
    assert watch.max_servers <= WORKERS * per_worker
    assert at_server <= WORKERS * per_worker
