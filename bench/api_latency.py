"""Latency of POST /api/runs on the production server, against GET /healthz on the same server.

    .venv/bin/python bench/api_latency.py [--requests 500] [--clients 4]

Starts `manage.py serve --port <free>` with RUN_WORKER=0 and DEMO_TRAFFIC=0 on a new embedded PostgreSQL in a
temporary folder (EMBEDDED_PGDATA), so the server is the production one (uvicorn, `python -m console.webserver`,
WEB_CONCURRENCY processes, JSON request logs included) on a database it migrated itself, with no job worker. It
waits for /healthz, creates an API token for `agent` with `manage.py create_api_token`, then:

* sequential: one client, one keep-alive connection (http.client), `--requests` rounds of
  GET /healthz, GET /api/me and POST /api/runs (a refund input, a distinct idempotency key each), interleaved
  so that all three see the same conditions (database growth, CPU frequency, log files);
* concurrent: `--clients` threads, each on its own keep-alive connection, first all POSTs, then all healthz.

The baseline, measured in the same run, is GET /healthz: the same server, HTTP parsing, middleware (request id,
JSON log line) and Django's sync-view hand-off, but no authentication and no database. GET /api/me adds the
bearer-token lookup; POST /api/runs adds the run INSERT and the Procrastinate defer, committed together. No worker
runs, so the deferred jobs stay queued: the figure is the API's alone. A reference row times what this process
pays to open a new PostgreSQL connection and run SELECT 1, since Django opens one per request (CONN_MAX_AGE 0).
Everything stays on the loopback; the load average is printed before and after, as the machine may be shared.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import processes  # noqa: E402
from bench.processes import free_port  # noqa: E402

PY = sys.executable
manage = functools.partial(processes.manage, timeout=120)
REFUND = {"customer_id": "cus_1042", "amount_cents": 12_500, "currency": "EUR", "reason": "Item arrived damaged"}


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    return sorted_values[max(0, math.ceil(p / 100 * len(sorted_values)) - 1)]


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": percentile(ordered, 50),
        "p95": percentile(ordered, 95),
        "p99": percentile(ordered, 99),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }


class Client:
    """One keep-alive HTTP/1.1 connection; every call returns (status, milliseconds)."""

    def __init__(self, port: int, token: str):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.auth = {"Authorization": f"Bearer {token}"}

    def _timed(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        started = time.perf_counter()
        self.conn.request(method, path, body=body, headers=headers or {})
        response = self.conn.getresponse()
        data = response.read()
        elapsed = (time.perf_counter() - started) * 1000
        return response.status, elapsed, data

    def healthz(self):
        return self._timed("GET", "/healthz")

    def me(self):
        return self._timed("GET", "/api/me", headers=self.auth)

    def create_run(self):
        body = json.dumps({"workflow": "refund", "input": REFUND, "idempotency_key": f"bench-{uuid.uuid4().hex}"})
        return self._timed(
            "POST", "/api/runs", body=body.encode(), headers={**self.auth, "Content-Type": "application/json"}
        )

    def close(self) -> None:
        self.conn.close()


def check(status: int, expected: int, data: bytes, what: str) -> None:
    if status != expected:
        sys.exit(f"{what} answered {status}, not {expected}: {data[:300]!r}")


EXPECTED = {"healthz": 200, "me": 200, "create_run": 202}


def sequential(port: int, token: str, rounds: int) -> dict[str, list[float]]:
    client = Client(port, token)
    times: dict[str, list[float]] = {name: [] for name in EXPECTED}
    for _ in range(rounds):
        for name, expected in EXPECTED.items():
            status, ms, data = getattr(client, name)()
            check(status, expected, data, name)
            times[name].append(ms)
    client.close()
    return times


def concurrent(port: int, token: str, name: str, clients: int, per_client: int) -> tuple[list[float], float]:
    """`clients` threads each send `per_client` requests; returns every latency and the wall time."""
    times: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def worker() -> None:
        client = Client(port, token)
        client.healthz()  # open the connection before the clock starts
        mine = []
        start.wait()
        for _ in range(per_client):
            status, ms, data = getattr(client, name)()
            if status != EXPECTED[name]:
                errors.append(f"{name} answered {status}: {data[:200]!r}")
                break
            mine.append(ms)
        client.close()
        with lock:
            times.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    if errors:
        sys.exit(errors[0])
    return times, wall


def wait_for_health(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit("manage.py serve exited before answering /healthz")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    sys.exit("the server did not answer /healthz in time")


def connect_times(database_url: str, rounds: int) -> list[float]:
    """A new PostgreSQL connection + SELECT 1 + close, from this process: what a request pays when Django opens
    a connection per request (CONN_MAX_AGE 0, no pool)."""
    import psycopg

    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        with psycopg.connect(database_url) as conn:
            conn.execute("SELECT 1").fetchone()
        times.append((time.perf_counter() - started) * 1000)
    return times


def row(label: str, stats: dict[str, float], base: dict[str, float] | None = None) -> str:
    cells = "  ".join(f"{stats[k]:7.2f}" for k in ("p50", "p95", "p99", "max", "mean"))
    ratio = f"   x{stats['p50'] / base['p50']:5.1f} / x{stats['p99'] / base['p99']:5.1f}" if base else ""
    return f"{label:34s}{cells}{ratio}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="sequential rounds (each: healthz, me, POST)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--per-client", type=int, default=125, help="requests per concurrent client")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument(
        "--web-workers",
        type=int,
        default=int(os.environ.get("WEB_CONCURRENCY") or os.cpu_count() or 1),
        help="uvicorn processes (WEB_CONCURRENCY; default: as `make run`, the number of cores)",
    )
    args = parser.parse_args()
    if not (1 <= args.requests <= 5000 and 1 <= args.clients <= 32 and 1 <= args.per_client <= 1000):
        sys.exit("keep the counts bounded: --requests <= 5000, --clients <= 32, --per-client <= 1000")

    tmp = Path(tempfile.mkdtemp(prefix="bench-api-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env |= {"EMBEDDED_PGDATA": str(tmp / "pgdata"), "RUN_WORKER": "0", "DEMO_TRAFFIC": "0"}
    env["WEB_CONCURRENCY"] = str(args.web_workers)
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [PY, "manage.py", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_health(port, server)
        token = manage(env, "create_api_token", "agent")
        print(
            f"server: manage.py serve (uvicorn, {args.web_workers} web processes, no job worker) on 127.0.0.1:{port};"
            f" {os.cpu_count()} cores; load average before: " + " ".join(f"{x:.2f}" for x in os.getloadavg())
        )

        database_url = manage(env, "shell", "-c", "from django.conf import settings; print(settings.DATABASE_URL)")
        conn_max_age = manage(
            env, "shell", "-c", "from django.conf import settings; print(settings.DATABASES['default']['CONN_MAX_AGE'])"
        )
        sequential(port, token, args.warmup)  # connections, caches, the first INSERTs
        seq = sequential(port, token, args.requests)
        stats = {name: summary(values) for name, values in seq.items()}

        print(f"\nsequential, one keep-alive connection, {args.requests} requests each (ms)")
        print(f"{'':34s}{'p50':>7s}  {'p95':>7s}  {'p99':>7s}  {'max':>7s}  {'mean':>7s}   vs baseline p50 / p99")
        print(row("GET /healthz (baseline)", stats["healthz"]))
        print(row("GET /api/me (token auth)", stats["me"], stats["healthz"]))
        print(row("POST /api/runs", stats["create_run"], stats["healthz"]))
        connect = summary(connect_times(database_url, args.requests))
        print(row("reference: PG connect + SELECT 1", connect, stats["healthz"]) + f"   (CONN_MAX_AGE={conn_max_age})")

        total = args.clients * args.per_client
        posts, posts_wall = concurrent(port, token, "create_run", args.clients, args.per_client)
        health, health_wall = concurrent(port, token, "healthz", args.clients, args.per_client)
        post_stats, health_stats = summary(posts), summary(health)
        print(f"\nconcurrent: {args.clients} clients x {args.per_client} requests, each on its own connection (ms)")
        print(row("GET /healthz (baseline)", health_stats) + f"   {total / health_wall:6.0f} req/s")
        print(row("POST /api/runs", post_stats, health_stats) + f"   {total / posts_wall:6.0f} req/s")

        expected_runs = args.warmup + args.requests + total
        runs = manage(env, "shell", "-c", "from runs.models import Run; print(Run.objects.count())")
        jobs = manage(
            env,
            "shell",
            "-c",
            "from procrastinate.contrib.django.models import ProcrastinateJob as J;"
            "print(J.objects.filter(task_name='advance_run', status='todo').count())",
        )
        print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        print(f"\nruns in the database: {runs} (expected {expected_runs}); advance_run jobs queued: {jobs}")
        if int(runs) != expected_runs or int(jobs) != expected_runs:
            sys.exit("MISMATCH: every 202 must have made one run and one queued job")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
        server.wait(60)
        log.close()
        # The embedded PostgreSQL stops when its last user is gone; then the folder can go.
        deadline = time.monotonic() + 30
        while (tmp / "pgdata" / "postmaster.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
