"""Throughput of the engine against plain Procrastinate: runs of 5 no-op steps with 1, 2 and 4 worker processes.

    .venv/bin/python bench/throughput_workers.py [--database pg15|embedded] [--runs 1000] [--workers 1,2,4]

A fresh database (the machine's PostgreSQL 15 over TCP, `bench_throughput_<pid>`, created and dropped here; or a
new embedded PostgreSQL in a temporary folder), migrated and seeded here. Workers are the production command,
`manage.py worker` (default concurrency, DATABASE_CONN_MAX_AGE=300), with WORKFLOW_MODULES=bench.noop_workflow.

For each worker count, two batches of --runs, each with freshly started workers:
* baseline: plain Procrastinate, `bench_plain_run` (bench/noop_workflow.py): one job per run doing the same five
  step writes the cheapest durable way, each one INSERT in its own transaction;
* engine: `bench_noop5` runs (five empty compute steps) submitted as the API does (runs.submission.submit).
Each batch is committed with its jobs scheduled a few seconds ahead, so the statistics can be read before the
workers start on it and after they stopped (PostgreSQL publishes a backend's counters when it goes idle or exits):
* runs/s and steps/s over the batch's span in procrastinate_events (first `started` to last `succeeded`);
* per step: commits (pg_stat_database.xact_commit of the database, read-only transactions included), write
  transactions (transaction ids consumed: cluster-wide, so exact on the private embedded server, and including
  other sessions' writes on a shared one), rows written (tup_inserted + tup_updated + tup_deleted of the
  database) and WAL bytes (cluster-wide, same caveat).
Prints a table and one `BENCH_JSON {...}` line.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HOLD_SECONDS = 3.0
STATS = """
SELECT xact_commit, tup_inserted + tup_updated + tup_deleted, pg_current_wal_lsn(),
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint
FROM pg_stat_database WHERE datname = current_database()
"""


def snapshot(url: str) -> tuple:
    with psycopg.connect(url, autocommit=True) as conn:
        commits, rows, lsn, xid = conn.execute(STATS).fetchone()
        return commits, rows, lsn, xid


def wal_bytes(url: str, a: str, b: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return int(conn.execute("SELECT pg_wal_lsn_diff(%s, %s)", [b, a]).fetchone()[0])


def start_workers(env: dict, count: int, log: Path) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, "manage.py", "worker"],
            cwd=ROOT,
            env=env,
            stdout=open(log, "ab"),  # noqa: SIM115 - the child keeps it
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for _ in range(count)
    ]


def stop_workers(workers: list[subprocess.Popen]) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    for worker in workers:
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    sys.exit(f"timed out after {timeout:.0f} s waiting for {what}")


def submit(kind: str, runs: int, batch: str) -> list[int]:
    """Commit `runs` runs (or plain jobs) whose jobs start HOLD_SECONDS from now; return their job ids."""
    from django.contrib.auth.models import User
    from django.db import connection, transaction

    from bench.noop_workflow import bench_plain_run
    from runs import submission

    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT now() + %s * interval '1 second'", [HOLD_SECONDS])
            (release,) = cursor.fetchone()
        if kind == "engine":
            agent = User.objects.get(username="agent")
            for i in range(runs):
                submission.submit(workflow="bench_noop5", input={"i": i}, created_by=agent, tenant=f"{batch}-{i % 100}")
            with connection.cursor() as cursor:
                cursor.execute(
                    "UPDATE procrastinate_jobs SET scheduled_at = %s WHERE status = 'todo'"
                    " AND task_name = 'advance_run' RETURNING id",
                    [release],
                )
                ids = [row[0] for row in cursor.fetchall()]
        else:
            ids = [bench_plain_run.configure(schedule_at=release).defer(run=i) for i in range(runs)]
    connection.close()  # the backend exits and publishes its counters
    return ids


def measure(url: str, env: dict, tmp: Path, kind: str, workers_n: int, runs: int, batch: str = "") -> dict:
    """One batch of `kind` (plain or engine) on `workers_n` fresh workers. `batch`: its name, unique in the database
    (its runs' tenants; bench/tracing_cost.py measures several engine batches in one database)."""
    batch = batch or f"{kind}{workers_n}"
    workers = start_workers(env, workers_n, tmp / f"workers-{batch}.log")
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            wait_until(
                lambda: conn.execute("SELECT count(*) FROM procrastinate_workers").fetchone()[0] >= workers_n,
                120,
                f"{workers_n} worker heartbeats",
            )
        ids = submit(kind, runs, batch)
        with psycopg.connect(url, autocommit=True) as conn:
            # Statistics, as a production database has them: a new one has none until autovacuum's first ANALYZE,
            # which would otherwise land in the middle of the first batches (and their plans made without them).
            conn.execute("ANALYZE")
        time.sleep(0.3)
        before = snapshot(url)
        with psycopg.connect(url, autocommit=True) as conn:

            def finished():
                done = conn.execute(
                    "SELECT count(*) FROM procrastinate_jobs WHERE id = ANY(%s) AND status IN ('succeeded', 'failed')",
                    [ids],
                ).fetchone()[0]
                return done >= len(ids)

            wait_until(finished, 900, f"{kind} batch with {workers_n} workers", interval=0.2)
            failed = conn.execute(
                "SELECT count(*) FROM procrastinate_jobs WHERE id = ANY(%s) AND status = 'failed'", [ids]
            ).fetchone()[0]
            if kind == "engine":
                # A job can end while its run continues in a follow-up job (re-enqueued): wait for the runs.
                wait_until(
                    lambda: (
                        conn.execute(
                            "SELECT count(*) FROM runs_run WHERE workflow = 'bench_noop5' AND tenant LIKE %s"
                            " AND status = 'succeeded'",
                            [f"{batch}-%"],
                        ).fetchone()[0]
                        >= runs
                    ),
                    300,
                    "the runs to succeed",
                    interval=0.2,
                )
    finally:
        stop_workers(workers)
    time.sleep(0.5)
    after = snapshot(url)
    with psycopg.connect(url, autocommit=True) as conn:
        span = conn.execute(
            "SELECT extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded')"
            " - min(at) FILTER (WHERE type = 'started')) FROM procrastinate_events WHERE job_id = ANY(%s)",
            [ids],
        ).fetchone()[0]
    steps = runs * 5
    seconds = float(span)
    return {
        "kind": kind,
        "workers": workers_n,
        "runs": runs,
        "steps": steps,
        "seconds": round(seconds, 2),
        "runs_per_s": round(runs / seconds, 1),
        "steps_per_s": round(steps / seconds, 1),
        "commits_per_step": round((after[0] - before[0]) / steps, 2),
        "write_xacts_per_step": round((after[3] - before[3]) / steps, 2),
        "rows_per_step": round((after[1] - before[1]) / steps, 2),
        "wal_bytes_per_step": round(wal_bytes(url, before[2], after[2]) / steps),
        "failed_jobs": failed,
    }


@contextlib.contextmanager
def bench_database(args, name: str, drop_env: tuple[str, ...] = (), prefix: str = "bench"):
    """A fresh database for a throughput batch (the machine's PostgreSQL 15 over TCP, `<prefix>_<name>_<pid>`, or a
    new embedded one in a temporary folder), migrated, seeded and with the plain baseline's table; Django set up on
    it. Yields (url, server version, temporary folder, the workers' environment); drops the database after."""
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    if not os.environ.get("BENCH_KEEP_TMP"):
        # Registered before Django starts the embedded server, so it runs after the server's own stop handler.
        atexit.register(shutil.rmtree, tmp, True)
    for variable in list(os.environ):
        if variable.startswith(("DATABASE_", "EMBEDDED_PGDATA", *drop_env)):
            del os.environ[variable]
    admin = None
    dbname = f"{prefix}_{name}_{os.getpid()}"
    if args.database == "pg15":
        admin = psycopg.connect(f"{args.pg_url}/postgres", autocommit=True)
        admin.execute(f'DROP DATABASE IF EXISTS "{dbname}"')
        admin.execute(f'CREATE DATABASE "{dbname}"')
        os.environ["DATABASE_URL"] = f"{args.pg_url}/{dbname}"
    else:
        os.environ["EMBEDDED_PGDATA"] = str(tmp / "pgdata")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    os.environ["LOG_LEVEL"] = "WARNING"
    os.environ["WORKFLOW_MODULES"] = "bench.noop_workflow"
    import django
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection, connections

    try:
        django.setup()
        call_command("migrate", verbosity=0)
        call_command("demo_setup", verbosity=0)
        from bench.noop_workflow import PLAIN_TABLE

        with connection.cursor() as cursor:
            cursor.execute(
                f"CREATE TABLE IF NOT EXISTS {PLAIN_TABLE}"
                " (id bigserial PRIMARY KEY, run bigint NOT NULL, seq int NOT NULL, output jsonb NOT NULL)"
            )
        url = settings.DATABASE_URL
        with psycopg.connect(url, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
        connections.close_all()
        yield (
            url,
            version,
            tmp,
            {**os.environ, "DATABASE_URL": url, "DATABASE_CONN_MAX_AGE": "300", "PYTHONUNBUFFERED": "1"},
        )
    finally:
        connections.close_all()
        if admin is not None:
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
            admin.close()
        if os.environ.get("BENCH_KEEP_TMP"):
            print(f"kept {tmp}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=("pg15", "embedded"), default="pg15")
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--workers", default="1,2,4")
    args = parser.parse_args()
    with bench_database(args, "throughput") as (url, version, tmp, env):
        from django.conf import settings

        concurrency = settings.PROCRASTINATE_WORKER_DEFAULTS["concurrency"]
        load_before = os.getloadavg()[0]
        results = []
        for workers_n in [int(w) for w in args.workers.split(",")]:
            for kind in ("plain", "engine"):
                results.append(measure(url, env, tmp, kind, workers_n, args.runs))
                r = results[-1]
                print(
                    f"{kind:7s} {workers_n} worker(s): {r['runs_per_s']:7.1f} runs/s {r['steps_per_s']:8.1f} steps/s"
                    f"  per step: {r['commits_per_step']:.2f} commits, {r['write_xacts_per_step']:.2f} write xacts,"
                    f" {r['rows_per_step']:.2f} rows, {r['wal_bytes_per_step']} WAL bytes",
                    flush=True,
                )
        print(
            f"\nthroughput on {args.database} (PostgreSQL {version}), {args.runs} runs x 5 steps per batch, worker"
            f" concurrency {concurrency}; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        )
        print(
            f"{'workers':>7s} {'plain steps/s':>14s} {'engine steps/s':>15s} {'ratio':>6s} {'engine commits/step':>20s}"
            f" {'write xacts/step':>17s} {'rows/step':>10s} {'WAL B/step':>11s}"
        )
        ratios = {}
        for workers_n in sorted({r["workers"] for r in results}):
            plain = next(r for r in results if r["workers"] == workers_n and r["kind"] == "plain")
            engine = next(r for r in results if r["workers"] == workers_n and r["kind"] == "engine")
            ratios[workers_n] = round(engine["steps_per_s"] / plain["steps_per_s"], 3)
            print(
                f"{workers_n:7d} {plain['steps_per_s']:14.1f} {engine['steps_per_s']:15.1f} {ratios[workers_n]:6.2f}"
                f" {engine['commits_per_step']:20.2f} {engine['write_xacts_per_step']:17.2f}"
                f" {engine['rows_per_step']:10.2f} {engine['wal_bytes_per_step']:11d}"
            )
            print(
                f"{'':7s} {'(plain per step:':>14s} {plain['commits_per_step']:.2f} commits,"
                f" {plain['write_xacts_per_step']:.2f} write xacts, {plain['rows_per_step']:.2f} rows,"
                f" {plain['wal_bytes_per_step']} WAL B)"
            )
        print(
            "BENCH_JSON "
            + json.dumps(
                {
                    "bench": "throughput",
                    "database": args.database,
                    "server_version": version,
                    "concurrency": concurrency,
                    "results": results,
                    "ratio_steps_per_s": ratios,
                }
            )
        )


if __name__ == "__main__":
    main()
