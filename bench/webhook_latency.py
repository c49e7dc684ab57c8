"""Latency of POST /api/webhooks/demo under concurrent senders, on the production server, measured with wrk.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/<db> .venv/bin/python bench/webhook_latency.py \\
        [--connections 16] [--duration 10] [--threads 2] [--web-workers 2]

On the PostgreSQL of DATABASE_URL (required: the figure is for a real server, not the embedded one) it runs
`manage.py migrate` and `demo_setup` (runs are created by `agent`), then starts the production web server
(`python -m console.webserver`, uvicorn, `--web-workers` processes, the JSON request log going to a temporary
file) on a free loopback port with WEBHOOK_SECRET_DEMO set, and no job worker: the deferred jobs stay queued,
the figure is the endpoint's alone. After a 2 s warm-up it runs

    wrk -t<threads> -c<connections> -d<duration>s --latency -s bench/webhook_wrk.lua <url> -- <secret>

whose Lua script signs every request afresh (Standard Webhooks: its own webhook-id, the current
webhook-timestamp, base64 HMAC-SHA256 of "<id>.<timestamp>.<body>"), then the same with one delivery id for all
requests (`-- <secret> duplicate <id>`: the deduplicated path, 200 after the first), then GET /healthz
(`-- healthz`) as the same server's floor under the same load. It checks that the database gained one accepted
delivery and one run per 202, and prints the load average before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.processes import free_port  # noqa: E402

PY = sys.executable
SECRET = "bench-webhook-secret"


def counts(url: str) -> tuple[int, int]:
    with psycopg.connect(url) as conn:
        deliveries = conn.execute("SELECT count(*) FROM runs_webhookdelivery WHERE status = 'accepted'").fetchone()
        runs = conn.execute("SELECT count(*) FROM runs_run").fetchone()
    return deliveries[0], runs[0]


def quiet(url: str) -> tuple[int, int]:
    """The counts once requests still in flight when wrk stopped have been answered."""
    last = counts(url)
    while True:
        time.sleep(1)
        now = counts(url)
        if now == last:
            return now
        last = now


def log_size(path: str) -> int:
    return os.path.getsize(path)


def server_latencies(path: str, offset: int) -> dict:
    """p50/p99 of the webhook requests' latency_ms in the server's request log, from `offset` on: the time
    inside Django (middleware and view), without the HTTP server's queueing."""
    values = []
    with open(path, encoding="utf-8") as log:
        log.seek(offset)
        for line in log:
            if '"path": "/api/webhooks/demo"' in line:
                values.append(json.loads(line)["latency_ms"])
    values.sort()

    def pick(p: int) -> float:  # nearest rank
        return values[max(0, math.ceil(p / 100 * len(values)) - 1)] if values else float("nan")

    return {"n": len(values), "p50": pick(50), "p99": pick(99)}


def wrk(url: str, args, *script_args: str) -> dict:
    command = [
        "wrk",
        f"-t{min(args.threads, args.connections)}",  # wrk wants a connection per thread at least
        f"-c{args.connections}",
        f"-d{args.duration}s",
        "--latency",
        "--timeout",
        "30s",  # a slow answer is a latency, not a socket timeout
        "-s",
        str(ROOT / "bench" / "webhook_wrk.lua"),
        url,
        "--",
        *script_args,
    ]
    print("$", " ".join(command))
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    print(output)
    latency = re.search(r"latency_us p50=(\d+) p90=(\d+) p99=(\d+) max=(\d+)", output)
    statuses = {int(code): int(n) for code, n in re.findall(r"status (\d+): (\d+)", output)}
    rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
    p50, p90, p99, peak = (int(v) / 1000 for v in latency.groups())
    return {"p50": p50, "p90": p90, "p99": p99, "max": peak, "statuses": statuses, "rate": float(rate.group(1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--web-workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    database_url = os.environ.get("DATABASE_URL")
    if not database_url:
        sys.exit("set DATABASE_URL to a PostgreSQL database of your own (it is migrated and written to)")

    env = {**os.environ, "WEBHOOK_SECRET_DEMO": SECRET, "CONSOLE_ENV": "development", "DEMO_TRAFFIC": "0"}
    subprocess.run([PY, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True, capture_output=True)
    subprocess.run([PY, "manage.py", "demo_setup", "-v0"], cwd=ROOT, env=env, check=True, capture_output=True)

    port = free_port()
    url = f"http://127.0.0.1:{port}/api/webhooks/demo"
    with tempfile.NamedTemporaryFile("w", prefix="webhook-bench-", suffix=".log", delete=False) as log:
        server = subprocess.Popen(
            [PY, "-m", "console.webserver", "--port", str(port), "--workers", str(args.web_workers)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the server did not start; see {log.name}")
                time.sleep(0.2)
        warm = argparse.Namespace(threads=1, connections=2, duration=2)
        wrk(url, warm, SECRET)

        quiet(database_url)
        load_before = os.getloadavg()
        before, mark = counts(database_url), log_size(log.name)
        fresh = wrk(url, args, SECRET)
        after = quiet(database_url)
        fresh["server"] = server_latencies(log.name, mark)
        mark = log_size(log.name)
        duplicate = wrk(url, args, SECRET, "duplicate", f"bench-duplicate-{uuid.uuid4().hex}")
        load_after = os.getloadavg()
        after_duplicates = quiet(database_url)
        duplicate["server"] = server_latencies(log.name, mark)
        baseline = wrk(url, args, "healthz")
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # our own server's process group (uvicorn and its workers)
        server.wait(30)

    gained = (after[0] - before[0], after[1] - before[1])
    dup_gained = (after_duplicates[0] - after[0], after_duplicates[1] - after[1])
    print(f"web workers {args.web_workers}, {args.connections} connections, {args.duration} s; server log {log.name}")
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}, on {os.cpu_count()} cores")
    print(
        f"baseline GET /healthz: p50 {baseline['p50']:.1f} ms, p90 {baseline['p90']:.1f} ms,"
        f" p99 {baseline['p99']:.1f} ms, max {baseline['max']:.1f} ms, {baseline['rate']:.0f} req/s"
    )
    for name, result in (("fresh delivery ids", fresh), ("one delivery id (duplicates)", duplicate)):
        print(
            f"{name}: p50 {result['p50']:.1f} ms, p90 {result['p90']:.1f} ms, p99 {result['p99']:.1f} ms,"
            f" max {result['max']:.1f} ms, {result['rate']:.0f} req/s, statuses {result['statuses']};"
            f" in the server (request log, {result['server']['n']} requests): p50 {result['server']['p50']:.1f} ms,"
            f" p99 {result['server']['p99']:.1f} ms"
        )
    print(
        f"fresh ids: {fresh['statuses'].get(202, 0)} answers 202 (wrk counts answers within its run), the database"
        f" gained {gained[0]} accepted deliveries and {gained[1]} runs (requests still in flight at the end included)"
    )
    print(f"one id: the database gained {dup_gained[0]} delivery and {dup_gained[1]} run")
    if gained[0] != gained[1] or set(fresh["statuses"]) != {202} or dup_gained != (1, 1):
        sys.exit("MISMATCH: not one run per accepted delivery, or an answer other than 202")


if __name__ == "__main__":
    main()
