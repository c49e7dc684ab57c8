"""Enqueue: POST /api/runs on the production server under wrk, against the HTTP floor and a one-INSERT endpoint.

    .venv/bin/python bench/enqueue.py [--database pg15|embedded] [--duration 10] [--connections 1,16,64]
                                      [--web-workers N] [--profile] [--compare uvicorn-asgi,gunicorn-gthread,...]

A fresh database: on the machine's PostgreSQL 15 over TCP (`--pg-url`, default postgres://postgres@127.0.0.1:5432,
a database `bench_enqueue_<pid>` created and dropped here), or a new embedded PostgreSQL in a temporary folder.
`manage.py migrate`, `demo_setup`, `create_api_token agent`, then the production server, `python -m
console.webserver --workers N` (WEB_CONCURRENCY, default the number of cores), DEBUG off, JSON request logs to a
file, and BENCH_ENDPOINTS=1 for the baseline. No job worker runs: the figure is the API's alone.

For each connection count, in turns: `wrk -d<duration>` with bench/enqueue_wrk.lua against
* the floor, `POST /insert` of bench/floor_app.py: a bare ASGI app (no framework) under uvicorn with TCP_NODELAY,
  the same number of processes, a psycopg pool each, one INSERT per request;
* `POST /bench/insert` (console/bench_views.py): the production server, its processes, middleware and pool, one
  INSERT in autocommit, no authentication;
* `POST /api/runs`: a refund input with a bearer token and a fresh idempotency key per request;
* with --compare, the last two again under each named server (the same app: Django's ASGI handler under uvicorn,
  gunicorn gthread 2 x 8 threads or granian WSGI 2 x 8 blocking threads, console/wsgi.py), all in the same run;
  `production-single` is the production server with GROUP_COMMIT=0, each run in its own commit (runs.group_commit).
Latency percentiles and req/s from wrk; the web processes' CPU time per request from /proc; wrk's own CPU time
(it must not compete for the cores). At the end the database must hold one run and one queued job per 202.
`--profile`: py-spy (when installed in the venv) samples the web processes during one more 16-connection run of
POST /api/runs, and the inclusive share of the hottest frames of the request threads is printed. In process, with
cProfile: bench/profile_api.py.

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
LUA = ROOT / "bench" / "enqueue_wrk.lua"
WRK = shutil.which("wrk") or "/usr/bin/wrk"
TICK = os.sysconf("SC_CLK_TCK")


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


SERVERS = {
    # The production server, as `make run` starts it.
    "production": lambda port, workers: [PY, "-m", "console.webserver", "--port", str(port), "--workers", str(workers)],
    # Alternatives measured side by side with --compare (the choice of issue 21, docs/BENCHMARKS.md).
    "uvicorn-asgi": lambda port, workers: (
        [PY, "bench/floor_app.py", "--app", "console.asgi:application"]
        + ["--port", str(port), "--workers", str(workers)]
    ),
    "gunicorn-gthread": lambda port, workers: (
        [PY, "-m", "gunicorn", "console.wsgi:application", "-k", "gthread"]
        + ["-w", str(workers), "--threads", "8", "-b", f"127.0.0.1:{port}"]
    ),
    # The production server with each run written by itself (GROUP_COMMIT=0, SERVER_ENV): what group commit gives.
    "production-single": lambda port, workers: [
        *[PY, "-m", "console.webserver", "--port", str(port), "--workers", str(workers)]
    ],
    "granian-wsgi": lambda port, workers: (
        [PY, "-m", "granian", "--interface", "wsgi", "--workers", str(workers)]
        + ["--blocking-threads", "8", "--host", "127.0.0.1", "--port", str(port), "console.wsgi:application"]
    ),
}


SERVER_ENV = {"production-single": {"GROUP_COMMIT": "0"}}


def start(argv: list[str], env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(server: subprocess.Popen, port: int, log_path: Path) -> list[int]:
    deadline = time.monotonic() + 120
    while not healthy(port):
        if server.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"a server did not start ({' '.join(map(str, server.args))}); see {log_path}")
        time.sleep(0.1)
    time.sleep(1)
    return process_tree(server.pid)


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=("pg15", "embedded"), default="pg15")
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--duration", type=float, default=float(os.environ.get("BENCH_ENQUEUE_SECONDS", 10)))
    parser.add_argument("--connections", default="1,16,64")
    parser.add_argument("--web-workers", type=int, default=int(os.environ.get("WEB_CONCURRENCY", os.cpu_count())))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--compare",
        default="",
        help=f"other servers of the same app, measured alike in the same run: {','.join(list(SERVERS)[1:])}",
    )
    args = parser.parse_args()
    connection_counts = [int(c) for c in args.connections.split(",")]
    compared = [c for c in args.compare.split(",") if c]
    for name in compared:
        if name not in SERVERS or name == "production":
            sys.exit(f"--compare: unknown server {name!r} (one of {', '.join(list(SERVERS)[1:])})")

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
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - closed below
    servers: dict[str, subprocess.Popen] = {}
    try:
        manage(env, "migrate", "-v0")
        manage(env, "demo_setup", "-v0")
        token = manage(env, "create_api_token", "agent")
        # Every server up at once (an idle one costs nothing but its pool's connections), measured in turns. The
        # production server first: it holds the embedded PostgreSQL, whose address the others are then given.
        ports = {name: free_port() for name in ["floor", "production", *compared]}
        servers["production"] = start(SERVERS["production"](ports["production"], args.web_workers), env, log)
        pids = {"production": wait_healthy(servers["production"], ports["production"], tmp / "server.log")}
        database_url = env.get("DATABASE_URL") or manage(
            env, "shell", "-c", "from django.conf import settings; print(settings.DATABASE_URL)"
        )
        servers["floor"] = start(
            [PY, "bench/floor_app.py", "--dsn", database_url, "--port", str(ports["floor"])]
            + ["--workers", str(args.web_workers)],
            env,
            log,
        )
        server_env = {**env, "DATABASE_URL": database_url, "DATABASE_POOL": "1"}  # the production server's pool
        for name in compared:
            servers[name] = start(
                SERVERS[name](ports[name], args.web_workers), server_env | SERVER_ENV.get(name, {}), log
            )
        for name, server in servers.items():
            if name != "production":
                pids[name] = wait_healthy(server, ports[name], tmp / "server.log")
        db = psycopg.connect(database_url, autocommit=True)
        server_version = db.execute("SHOW server_version").fetchone()[0]
        # (server, case): url and the wrk script's kind
        cells = [("floor", "floor", f"http://127.0.0.1:{ports['floor']}/insert", "insert")]
        for name in ["production", *compared]:
            cells.append((name, "baseline", f"http://127.0.0.1:{ports[name]}/bench/insert", "insert"))
            cells.append((name, "runs", f"http://127.0.0.1:{ports[name]}/api/runs", "runs"))
        for server, _case, url, kind in cells:  # warm-up: imports, pool, caches
            wrk(url, token, kind, 4, 2, pids[server])
        load_before = os.getloadavg()
        results: dict[tuple[str, str], list[dict]] = {(server, case): [] for server, case, _, _ in cells}
        for connections in connection_counts:
            for server, case, url, kind in cells:
                results[server, case].append(wrk(url, token, kind, connections, args.duration, pids[server]))
        load_after = os.getloadavg()
        for name in compared:  # the production server alone for the profile
            stop(servers.pop(name))
        runs_url = f"http://127.0.0.1:{ports['production']}/api/runs"
        hot = profile(runs_url, token, servers["production"].pid, 10, tmp / "profile.txt") if args.profile else []

        accepted = sum(r["statuses"].get("202", 0) for (_, case), rs in results.items() if case == "runs" for r in rs)
        runs, jobs = db.execute(
            "SELECT (SELECT count(*) FROM runs_run), (SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo')"
        ).fetchone()
        db.close()

        print(
            f"\nenqueue on {args.database} (PostgreSQL {server_version}), {args.web_workers} web processes, "
            f"{args.duration:g} s per cell; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
        )
        labels = {"floor": "floor: bare ASGI, POST /insert", "baseline": "POST /bench/insert", "runs": "POST /api/runs"}
        print(
            f"{'server':17s} {'case':31s} {'conns':>5s} {'req/s':>8s} {'p50':>8s} {'p99':>8s} {'max':>8s}"
            f" {'cpu/req':>8s} {'/floor':>6s} {'/insert':>7s} non-2xx"
        )
        for index, connections in enumerate(connection_counts):
            floor = results["floor", "floor"][index]
            for server, case, _, _ in cells:
                r = results[server, case][index]
                base = results.get((server, "baseline"), [None] * (index + 1))[index]
                vs_floor = f"{r['rps'] / max(floor['rps'], 0.1):6.2f}" if case != "floor" else ""
                vs_insert = f"{r['rps'] / max(base['rps'], 0.1):7.2f}" if case == "runs" else ""
                print(
                    f"{'uvicorn' if server == 'floor' else server:17s} {labels[case]:31s} {connections:5d}"
                    f" {r['rps']:8.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['max_ms']:8.2f}"
                    f" {r['server_cpu_ms_per_request']:8.2f} {vs_floor:>6s} {vs_insert:>7s} {r['non_2xx']}"
                )
        print(f"runs in the database: {runs}, queued jobs: {jobs}, 202 answers (+ warm-up): {accepted}")
        if hot:
            print("\nprofile (py-spy, 16 connections, request threads, inclusive share of wall-clock samples):")
            for share, name in hot:
                print(f"  {share:5.1f}%  {name}")
        summary = {
            "bench": "enqueue",
            "database": args.database,
            "server_version": server_version,
            "server": "uvicorn: sync views as WSGI in threads, async views as ASGI (console/asgi.py)",
            "web_workers": args.web_workers,
            "duration_s": args.duration,
            "load_before": round(load_before[0], 2),
            "load_after": round(load_after[0], 2),
            "floor": results["floor", "floor"],
            "baseline": results["production", "baseline"],
            "runs": results["production", "runs"],
            "compared": {
                name: {"baseline": results[name, "baseline"], "runs": results[name, "runs"]} for name in compared
            },
            "runs_in_db": runs,
            "queued_jobs": jobs,
            "profile": hot,
        }
        if 16 in connection_counts:
            at16 = connection_counts.index(16)
            runs16 = results["production", "runs"][at16]
            summary["goal_p99_16_ms"] = runs16["p99_ms"]
            summary["goal_ratio_16"] = round(
                runs16["rps"] / max(results["production", "baseline"][at16]["rps"], 0.1), 3
            )
            summary["floor_p99_16_ms"] = results["floor", "floor"][at16]["p99_ms"]
            summary["goal_floor_ratio_16"] = round(runs16["rps"] / max(results["floor", "floor"][at16]["rps"], 0.1), 3)
        print("BENCH_JSON " + json.dumps(summary))
        if runs < accepted or jobs < accepted:
            sys.exit(f"MISMATCH: {accepted} runs accepted (after warm-up) but {runs} runs and {jobs} queued jobs")
    finally:
        for server in servers.values():
            stop(server)
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
