"""Runs per second through one worker: 500 refund demo runs without gates, against no-op workflows.

    .venv/bin/python bench/throughput.py [--runs 500] [--concurrency N]

Starts `manage.py serve --no-worker` (migrations, demo channels and users; DEMO_TRAFFIC=0) on a new embedded
PostgreSQL in a temporary folder (EMBEDDED_PGDATA), then one standalone worker, `manage.py procrastinate worker`
(WORKER_CONCURRENCY from the environment or --concurrency; the project's default is 4). Every process gets
WORKFLOW_MODULES=bench.noop_workflow, which registers the baselines.

Each batch is submitted by `manage.py shell -c` in ONE transaction, so all its runs (and their `advance_run`
jobs) appear at the same instant, while the worker already waits: the clock starts when this script sees the
committed batch and stops when it sees every run of it `succeeded` (polled every 10 ms with psycopg). Each
batch has its own tenant, so the batches are told apart. Batches, in this order:

1. `bench_noop` (1 step): the per-run cost of Procrastinate and the engine (fetch the job, claim the run,
   one checkpoint, finish the run, complete the job);
2. `bench_noop6` (6 steps, doing nothing): the same plus five more checkpoints; the refund's shape;
3. `refund` (6 steps) submitted with `manage.py demo_traffic --runs N --no-gates`: amounts below the auto-approve
   threshold, so the gate decides by itself and no run waits for a person. Its steps do the demo's real work:
   two scripted model calls, a CRM read, two effects through receipts on the fake (non-idempotent) systems.

The difference between 3 and 2 is the demo's own work; between 2 and 1, the engine's per-step cost. At the
end `manage.py sandbox_stats` must show payments == N and duplicates == 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.processes import free_port, manage  # noqa: E402

PY = sys.executable
TIMEOUT_SECONDS = 150  # per batch


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    sys.exit(f"timed out waiting for {what}")


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def submit_code(workflow: str, runs: int, tenant: str) -> str:
    if workflow == "refund":
        body = (
            "from django.core.management import call_command;"
            f"call_command('demo_traffic', runs={runs}, no_gates=True, seed=7, tenant={tenant!r}, verbosity=0)"
        )
    else:
        body = (
            "from runs import submission\n"
            f"    for i in range({runs}): submission.submit(workflow={workflow!r}, input={{'i': i}}, tenant={tenant!r})"
        )
    return f"from django.db import transaction\nwith transaction.atomic():\n    {body}\n"


def batch(env: dict, db: psycopg.Connection, workflow: str, runs: int, tenant: str) -> dict:
    """Submit `runs` runs of `workflow` in one transaction and time them until every one has succeeded."""
    submitter = subprocess.Popen(
        [PY, "manage.py", "shell", "-c", submit_code(workflow, runs, tenant)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def counts() -> dict[str, int]:
        rows = db.execute("SELECT status, count(*) FROM runs_run WHERE tenant = %s GROUP BY status", [tenant])
        return dict(rows.fetchall())

    deadline = time.monotonic() + TIMEOUT_SECONDS
    while sum(counts().values()) < runs:  # not committed yet: the submitter is still working
        if submitter.poll() not in (None, 0) or time.monotonic() > deadline:
            sys.exit(f"submitting {workflow} failed:\n{submitter.communicate()[1][-3000:]}")
        time.sleep(0.01)
    started = time.perf_counter()
    while True:
        now = counts()
        if now.get("succeeded", 0) == runs:
            elapsed = time.perf_counter() - started
            break
        if now.get("failed") or now.get("waiting_human") or now.get("paused"):
            sys.exit(f"{workflow}: some runs did not succeed: {now}")
        if time.monotonic() > deadline:
            sys.exit(f"{workflow}: not done after {TIMEOUT_SECONDS} s: {now}")
        time.sleep(0.01)
    submitter.wait(30)
    steps, db_seconds = db.execute(
        "SELECT count(*), extract(epoch FROM max(r.finished_at) - min(s.started_at))"
        " FROM runs_step s JOIN runs_run r ON r.id = s.run_id WHERE r.tenant = %s AND s.status = 'done'",
        [tenant],
    ).fetchone()
    return {"runs": runs, "steps": steps, "seconds": elapsed, "db_seconds": float(db_seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=None, help="WORKER_CONCURRENCY (default: the setting's)")
    args = parser.parse_args()
    if not 1 <= args.runs <= 5000:
        sys.exit("keep it bounded: 1 <= --runs <= 5000")

    tmp = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env |= {
        "EMBEDDED_PGDATA": str(tmp / "pgdata"),
        "RUN_WORKER": "0",
        "DEMO_TRAFFIC": "0",
        "WORKFLOW_MODULES": "bench.noop_workflow",
    }
    if args.concurrency:
        env["WORKER_CONCURRENCY"] = str(args.concurrency)
    server_log = open(tmp / "server.log", "wb")  # noqa: SIM115 - closed below
    worker_log = open(tmp / "worker.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [PY, "manage.py", "serve", "--no-worker", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=server_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    worker = None
    try:
        wait_for(lambda: healthy(port) or server.poll() is not None, 120, "the server")
        if server.poll() is not None:
            sys.exit(f"manage.py serve exited; see {tmp / 'server.log'}")
        settings = json.loads(
            manage(
                env,
                "shell",
                "-c",
                "import json; from django.conf import settings as s;"
                "print(json.dumps([s.DATABASE_URL, s.PROCRASTINATE_WORKER_DEFAULTS]))",
            )
        )
        database_url, worker_defaults = settings
        db = psycopg.connect(database_url, autocommit=True)
        worker = subprocess.Popen(
            [PY, "manage.py", "procrastinate", "worker"],
            cwd=ROOT,
            env=env,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(
            lambda: db.execute("SELECT count(*) FROM procrastinate_workers").fetchone()[0] > 0,
            60,
            "the worker's first heartbeat",
        )
        print(
            f"worker: manage.py procrastinate worker, concurrency {worker_defaults['concurrency']}, "
            f"fallback poll {worker_defaults['fetch_job_polling_interval']} s; load average before: "
            + " ".join(f"{x:.2f}" for x in os.getloadavg())
        )
        batch(env, db, "bench_noop", 20, "warmup")  # imports, connections, first queries

        results = {}
        for workflow in ("bench_noop", "bench_noop6", "refund"):
            results[workflow] = batch(env, db, workflow, args.runs, f"bench-{workflow}")
            r = results[workflow]
            print(
                f"{workflow:12s} {r['runs']} runs, {r['steps']:5d} steps in {r['seconds']:6.2f} s: "
                f"{r['runs'] / r['seconds']:6.1f} runs/s  {r['steps'] / r['seconds']:7.1f} steps/s"
                f"   (database clock, first step start to last finish: {r['db_seconds']:.2f} s)"
            )

        noop, noop6, refund = results["bench_noop"], results["bench_noop6"], results["refund"]
        per_run = {name: r["seconds"] / r["runs"] * 1000 for name, r in results.items()}
        print(
            f"\nper run: noop {per_run['bench_noop']:.2f} ms, noop6 {per_run['bench_noop6']:.2f} ms, "
            f"refund {per_run['refund']:.2f} ms (wall time / runs, {worker_defaults['concurrency']} at a time)"
        )
        print(
            f"engine cost of a step (noop6 - noop) / 5: {(per_run['bench_noop6'] - per_run['bench_noop']) / 5:.2f} ms;"
            f" the demo's own work (refund - noop6): {per_run['refund'] - per_run['bench_noop6']:.2f} ms a run"
        )
        print(
            f"refund runs/s vs baselines: {noop['runs'] / noop['seconds'] / (refund['runs'] / refund['seconds']):.1f}x"
            f" slower than noop, {noop6['runs'] / noop6['seconds'] / (refund['runs'] / refund['seconds']):.1f}x"
            " slower than noop6"
        )

        stats = json.loads(manage(env, "sandbox_stats"))
        dead = db.execute("SELECT count(*) FROM jobs_deadletter").fetchone()[0]
        print(f"sandbox_stats: {json.dumps(stats)}; dead letters: {dead}")
        print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        if stats["channels"]["payments"] != args.runs or stats["duplicates"] != 0 or dead:
            sys.exit(f"MISMATCH: expected payments == {args.runs}, duplicates == 0 and no dead letters")
        print(f"OK: payments == {args.runs}, duplicates == 0")
        db.close()
    finally:
        for proc, sig in ((worker, signal.SIGTERM), (server, signal.SIGINT)):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, sig)
        for proc in (worker, server):
            if proc is not None:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        server_log.close()
        worker_log.close()
        deadline = time.monotonic() + 30
        while (tmp / "pgdata" / "postmaster.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if os.environ.get("BENCH_KEEP_TMP"):
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
