"""Enqueue: POST /api/runs on the production server under wrk, against a one-INSERT endpoint of the same server.

    .venv/bin/python bench/enqueue.py [--database pg15|embedded] [--duration 10] [--connections 1,16,64]
                                      [--web-workers N] [--profile]

A fresh database: on the machine's PostgreSQL 15 over TCP (`--pg-url`, default postgres://postgres@127.0.0.1:5432,
a database `bench_enqueue_<pid>` created and dropped here), or a new embedded PostgreSQL in a temporary folder.
`manage.py migrate`, `demo_setup`, `create_api_token agent`, then the production server, `python -m
console.webserver --workers N` (WEB_CONCURRENCY, default the number of cores), DEBUG off, JSON request logs to a
file, and BENCH_ENDPOINTS=1 for the baseline. No job worker runs: the figure is the API's alone.

For each connection count, interleaved: `wrk -d<duration>` with bench/enqueue_wrk.lua against
* the baseline, `POST /bench/insert` (console/bench_views.py): same server, processes, middleware and pool, one
  INSERT in autocommit, no authentication;
* `POST /api/runs`: a refund input with a bearer token and a fresh idempotency key per request.
Latency percentiles and req/s from wrk; the web processes' CPU time per request from /proc; wrk's own CPU time
(it must not compete for the cores). At the end the database must hold one run and one queued job per 202.
`--profile`: py-spy (when installed in the venv) samples the web processes during one more 16-connection run of
POST /api/runs, and the inclusive share of the hottest frames of the request threads is printed.

Prints a table and one line `BENCH_JSON {...}` per database for `bench/run_all.py`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
LUA = ROOT / "bench" / "enqueue_wrk.lua"
WRK = shutil.which("wrk") or "/usr/bin/wrk"
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def manage(env: dict, *args: str) -> str:
    done = subprocess.run([PY, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        sys.exit(f"manage.py {' '.join(args[:2])} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def process_tree(pid: int) -> list[int]:
    pids, queue = [], [pid]
    while queue:
        current = queue.pop()
        pids.append(current)
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            children = []
        queue.extend(int(c) for c in children)
    return pids


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wrk(url: str, token: str, kind: str, connections: int, duration: float, server_pids: list[int]) -> dict:
    threads = min(2, connections)
    cpu_before, wrk_before = cpu_seconds(server_pids), children_cpu()
    done = subprocess.run(
        [WRK, f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "10s"]
        + ["-s", str(LUA), url, "--", token, kind],
        capture_output=True,
        text=True,
        timeout=duration + 60,
    )
    cpu_after, wrk_after = cpu_seconds(server_pids), children_cpu()
    match = re.search(r"^WRK_JSON (.*)$", done.stdout, re.M)
    if not match:
        sys.exit(f"wrk printed no summary:\n{done.stdout}\n{done.stderr}")
    raw = json.loads(match.group(1))
    requests = raw["requests"]
    seconds = raw["duration_us"] / 1e6
    ok = sum(n for status, n in raw["statuses"].items() if status in ("200", "202"))
    return {
        "connections": connections,
        "requests": requests,
        "ok": ok,
        "non_2xx": requests - ok,
        "socket_errors": sum(raw[f"errors_{k}"] for k in ("connect", "read", "write", "timeout")),
        "rps": round(requests / seconds, 1),
        "p50_ms": round(raw["p50_us"] / 1000, 2),
        "p90_ms": round(raw["p90_us"] / 1000, 2),
        "p99_ms": round(raw["p99_us"] / 1000, 2),
        "max_ms": round(raw["max_us"] / 1000, 2),
        "server_cpu_ms_per_request": round((cpu_after - cpu_before) * 1000 / max(requests, 1), 2),
        "wrk_cpu_ms_per_request": round((wrk_after - wrk_before) * 1000 / max(requests, 1), 3),
        "statuses": raw["statuses"],
    }


def profile(url: str, token: str, server_pid: int, duration: float, out: Path) -> list[tuple[float, str]]:
    """py-spy on the web processes (wall clock, idle included) during a 16-connection run; the inclusive share
    of each frame among the samples of request threads (those inside Django's exception-handling wrapper, i.e.
    serving a request)."""
    py_spy = Path(PY).parent / "py-spy"
    if not py_spy.exists():
        return []
    load = subprocess.Popen(
        [WRK, "-t2", "-c16", f"-d{round(duration) + 4}s", "-s", str(LUA), url, "--", token, "runs"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(2)
    subprocess.run(
        [str(py_spy), "record", "-p", str(server_pid), "--subprocesses", "--idle", "--nonblocking", "-r", "100"]
        + ["-d", str(int(duration)), "-f", "raw", "-o", str(out)],
        capture_output=True,
        timeout=duration + 60,
    )
    load.wait(duration + 30)
    if not out.exists():
        return []
    totals: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any("django/core/handlers/exception.py" in f for f in frames):
            continue
        samples += int(count)
        seen = set()
        for frame in frames[2:]:
            name = re.sub(r":\d+\)$", ")", frame)
            if name not in seen:
                seen.add(name)
                totals[name] += int(count)
    keep = re.compile(r"console/|runs/|approvals/|jobs/|psycopg|connect|execute|commit|Atomic|logging|structlog")
    return [
        (round(100 * n / samples, 1), name)
        for name, n in totals.most_common(400)
        if keep.search(name) and n / samples >= 0.02
    ][:30]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=("pg15", "embedded"), default="pg15")
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--duration", type=float, default=float(os.environ.get("BENCH_ENQUEUE_SECONDS", 10)))
    parser.add_argument("--connections", default="1,16,64")
    parser.add_argument("--web-workers", type=int, default=int(os.environ.get("WEB_CONCURRENCY", os.cpu_count())))
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    connection_counts = [int(c) for c in args.connections.split(",")]

    tmp = Path(tempfile.mkdtemp(prefix="bench-enqueue-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_", "EMBEDDED_PGDATA"))}
    env |= {"DEBUG": "0", "BENCH_ENDPOINTS": "1", "DEMO_TRAFFIC": "0", "PYTHONUNBUFFERED": "1"}
    admin = None
    dbname = f"bench_enqueue_{os.getpid()}"
    if args.database == "pg15":
        admin = psycopg.connect(f"{args.pg_url}/postgres", autocommit=True)
        admin.execute(f'DROP DATABASE IF EXISTS "{dbname}"')
        admin.execute(f'CREATE DATABASE "{dbname}"')
        env["DATABASE_URL"] = f"{args.pg_url}/{dbname}"
    else:
        env["EMBEDDED_PGDATA"] = str(tmp / "pgdata")
    port = free_port()
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - closed below
    server = None
    try:
        manage(env, "migrate", "-v0")
        manage(env, "demo_setup", "-v0")
        token = manage(env, "create_api_token", "agent")
        server = subprocess.Popen(
            [PY, "-m", "console.webserver", "--port", str(port), "--workers", str(args.web_workers)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while not healthy(port):
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the web server did not start; see {tmp / 'server.log'}")
            time.sleep(0.1)
        time.sleep(1)
        pids = process_tree(server.pid)
        database_url = env.get("DATABASE_URL") or manage(
            env, "shell", "-c", "from django.conf import settings; print(settings.DATABASE_URL)"
        )
        db = psycopg.connect(database_url, autocommit=True)
        server_version = db.execute("SHOW server_version").fetchone()[0]
        urls = {"baseline": f"http://127.0.0.1:{port}/bench/insert", "runs": f"http://127.0.0.1:{port}/api/runs"}
        kinds = {"baseline": "insert", "runs": "runs"}
        for name in urls:  # warm-up: imports, pool, caches
            wrk(urls[name], token, kinds[name], 4, 2, pids)
        load_before = os.getloadavg()
        results: dict[str, list[dict]] = {"baseline": [], "runs": []}
        for connections in connection_counts:
            for name in ("baseline", "runs"):
                results[name].append(wrk(urls[name], token, kinds[name], connections, args.duration, pids))
        load_after = os.getloadavg()
        hot = profile(urls["runs"], token, server.pid, 10, tmp / "profile.txt") if args.profile else []

        accepted = sum(r["statuses"].get("202", 0) for r in results["runs"])
        runs, jobs = db.execute(
            "SELECT (SELECT count(*) FROM runs_run), (SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo')"
        ).fetchone()
        db.close()

        print(
            f"\nenqueue on {args.database} (PostgreSQL {server_version}), {args.web_workers} web processes, "
            f"{args.duration:g} s per cell; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
        )
        print(f"{'case':28s} {'conns':>5s} {'req/s':>8s} {'p50':>8s} {'p99':>8s} {'max':>8s} {'cpu/req':>8s} non-2xx")
        for connections_index, connections in enumerate(connection_counts):
            base = results["baseline"][connections_index]
            for name, label in (("baseline", "baseline: POST /bench/insert"), ("runs", "POST /api/runs")):
                r = results[name][connections_index]
                print(
                    f"{label:28s} {connections:5d} {r['rps']:8.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f}"
                    f" {r['max_ms']:8.2f} {r['server_cpu_ms_per_request']:8.2f} {r['non_2xx']}"
                )
            r = results["runs"][connections_index]
            print(f"{'  ratio runs / baseline':28s} {'':5s} {r['rps'] / max(base['rps'], 0.1):8.2f}")
        print(f"runs in the database: {runs}, queued jobs: {jobs}, 202 answers (+ warm-up): {accepted}")
        if hot:
            print("\nprofile (py-spy, 16 connections, request threads, inclusive share of wall-clock samples):")
            for share, name in hot:
                print(f"  {share:5.1f}%  {name}")
        at16 = {name: next((r for r in results[name] if r["connections"] == 16), None) for name in results}
        summary = {
            "bench": "enqueue",
            "database": args.database,
            "server_version": server_version,
            "web_workers": args.web_workers,
            "duration_s": args.duration,
            "load_before": round(load_before[0], 2),
            "load_after": round(load_after[0], 2),
            "baseline": results["baseline"],
            "runs": results["runs"],
            "runs_in_db": runs,
            "queued_jobs": jobs,
            "profile": hot,
        }
        if at16["runs"] and at16["baseline"]:
            summary["goal_p99_16_ms"] = at16["runs"]["p99_ms"]
            summary["goal_ratio_16"] = round(at16["runs"]["rps"] / max(at16["baseline"]["rps"], 0.1), 3)
        print("BENCH_JSON " + json.dumps(summary))
        if runs < accepted or jobs < accepted:
            sys.exit(f"MISMATCH: {accepted} runs accepted (after warm-up) but {runs} runs and {jobs} queued jobs")
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()
        if admin is not None:
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
            admin.close()
        deadline = time.monotonic() + 30
        while (tmp / "pgdata" / "postmaster.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if os.environ.get("BENCH_KEEP_TMP"):
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
