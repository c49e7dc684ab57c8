"""A reviewer's `GET /api/approvals` while 1,000 agents long-poll their approval requests, on the production server,
against the same call with nobody waiting, measured in the same run with wrk (issue 24).

    .venv/bin/python bench/longpoll.py [--agents 1000] [--duration 10] [--connections 16] [--web-workers 2]

On a new database of the machine's PostgreSQL 15 over TCP (`<BENCH_DB_PREFIX, default bench>_longpoll_<pid>` on
--pg-url, dropped at the end) it runs `manage.py migrate` and `demo_setup`, adds a reviewer `inbox` who may decide
cards of `payments` only, and starts the production web server (`python -m console.webserver`, uvicorn,
`--web-workers` processes, JSON request log in a temporary file) with no job worker. The demo `agent` asks for 10
approvals on `payments` (the inbox's cards) and `--agents` on `crm`, which the inbox does not show: the inbox call
costs the same in both cases, and only the waiting agents differ. Then:

1. baseline: wrk -c<connections> -d<duration>s GET /api/approvals as `inbox`, nobody waiting;
2. every `crm` request long-polled at once (`?wait=60`, asyncio + httpx, one connection each), and once the
   server's request log shows each one's first look, the same wrk run while they all wait;
3. the demo `reviewer` approves every `crm` request (16 at a time); each agent must get 200 `approved` (an agent
   whose wait ended first asks again, as the Python client's wait() does).

Prints the inbox call's p50/p99 in both cases, the long-polls' errors (any answer but 200 `approved`, or none),
the time from each decision's answer to its long-poll's answer, and the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.processes import free_port, manage  # noqa: E402

PY = sys.executable
WAIT = 60  # the API's longest wait: every agent is still waiting when the decisions come
GOAL_P99_MS = 100
INBOX_CARDS = 10
INBOX_SETUP = """
from django.contrib.auth.models import Group, User
from guardian.shortcuts import assign_perm
from core.models import Channel, Role
user, _ = User.objects.get_or_create(username="inbox")
user.groups.add(Group.objects.get(name=Role.REVIEWER))
assign_perm("core.approve_channel", user, Channel.objects.get(name="payments"))
"""


def milliseconds(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


async def wrk(url: str, token: str, connections: int, duration: int) -> dict:
    command = [
        "wrk",
        f"-t{min(2, connections)}",
        f"-c{connections}",
        f"-d{duration}s",
        "--latency",
        "--timeout",
        "30s",  # a slow answer is a latency, not a socket timeout
        "-H",
        f"Authorization: Bearer {token}",
        url,
    ]
    print("$", " ".join(command).replace(token, "<inbox token>"), flush=True)
    proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    output = (await proc.communicate())[0].decode()
    if proc.returncode != 0:
        sys.exit(f"wrk failed:\n{output}")
    print(output, flush=True)
    distribution = dict(re.findall(r"^\s+(50|90|99)%\s+(\S+)", output, re.M))
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    return {
        "p50_ms": round(milliseconds(distribution["50"]), 1),
        "p90_ms": round(milliseconds(distribution["90"]), 1),
        "p99_ms": round(milliseconds(distribution["99"]), 1),
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1)),
        "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
        "socket_errors": sum(map(int, errors.groups())) if errors else 0,
    }


async def ask_all(client: httpx.AsyncClient, channel: str, count: int, prefix: str) -> list[dict]:
    """`count` approval requests on `channel`, 16 at a time."""
    gate = asyncio.Semaphore(16)

    async def ask(i: int) -> dict:
        async with gate:
            response = await client.post(
                "/api/approval-requests",
                json={
                    "channel": channel,
                    "action": "refund",
                    "arguments": {"order_id": f"ord_{i}", "amount_cents": 1000 + i},
                    "idempotency_key": f"{prefix}-{i}",
                },
            )
        if response.status_code != 202:
            sys.exit(f"POST /api/approval-requests answered {response.status_code}: {response.text[:300]}")
        return response.json()

    return await asyncio.gather(*(ask(i) for i in range(count)))


def first_looks(log_path: str) -> int:
    """Long-poll passes through Django so far (looks at a request), by the server's request log."""
    count = 0
    with open(log_path, encoding="utf-8", errors="replace") as log:
        for line in log:
            if '"path": "/api/approval-requests/' in line and '"method": "GET"' in line:
                count += 1
    return count


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))] if ordered else float("nan")


async def scenario(args, port: int, tokens: dict[str, str], log_path: str) -> dict:
    base = f"http://127.0.0.1:{port}"
    url = f"{base}/api/approvals"
    limits = httpx.Limits(max_connections=args.agents + 64, max_keepalive_connections=args.agents + 64)
    timeout = httpx.Timeout(WAIT + 60, connect=30)
    agent = httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {tokens['agent']}"}, limits=limits, timeout=timeout
    )
    reviewer = httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {tokens['reviewer']}"}, timeout=timeout
    )
    async with agent, reviewer:
        await ask_all(agent, "payments", INBOX_CARDS, "inbox")
        waiting = await ask_all(agent, "crm", args.agents, "waiting")
        await wrk(url, tokens["inbox"], 2, 2)  # warm-up: the server's threads, pool and caches

        print(f"\n-- baseline: nobody waiting ({INBOX_CARDS} cards in the inbox)", flush=True)
        baseline = await wrk(url, tokens["inbox"], args.connections, args.duration)

        answers: dict[str, tuple[int, dict | str, float]] = {}
        repolls: dict[str, int] = {}  # long-polls that ended "pending" (their wait was over) and began again
        retried: list[str] = []

        async def get(request_id: str) -> httpx.Response:
            path = f"/api/approval-requests/{request_id}"
            try:
                return await agent.get(path, params={"wait": WAIT})
            except httpx.RemoteProtocolError:
                # A kept-alive connection that the server closed as idle (uvicorn's keep-alive timeout, 5 s) just as
                # it was reused: the request never reached the server; a GET is asked again, as HTTP clients do.
                retried.append(request_id)
                return await agent.get(path, params={"wait": WAIT})

        async def long_poll(request: dict) -> None:
            # As the Python client's wait(): long-poll again while the answer is "pending" (a wait that ended).
            while True:
                try:
                    response = await get(request["id"])
                    is_json = response.headers.get("content-type", "").startswith("application/json")
                    body = response.json() if is_json else response.text
                except httpx.HTTPError as exc:
                    response, body = None, f"{type(exc).__name__}: {exc}"
                if response is None or response.status_code != 200 or not isinstance(body, dict):
                    answers[request["id"]] = (response.status_code if response else 0, body, time.monotonic())
                    return
                if body["status"] != "pending":
                    answers[request["id"]] = (200, body, time.monotonic())
                    return
                repolls[request["id"]] = repolls.get(request["id"], 0) + 1

        looks_before = first_looks(log_path)
        started = time.monotonic()
        polls = [asyncio.create_task(long_poll(r)) for r in waiting]
        while first_looks(log_path) - looks_before < args.agents:
            if time.monotonic() - started > 60:
                sys.exit(f"only {first_looks(log_path) - looks_before} of {args.agents} long-polls reached the server")
            await asyncio.sleep(0.2)
        settled_in = time.monotonic() - started
        await asyncio.sleep(1)
        print(f"\n-- {args.agents} agents waiting (all first looks done in {settled_in:.1f} s)", flush=True)
        passes_before = first_looks(log_path)
        loaded = await wrk(url, tokens["inbox"], args.connections, args.duration)
        passes_during = first_looks(log_path) - passes_before  # what the waiting agents cost the server meanwhile
        early = len(answers)  # nothing is decided yet: every long-poll must still be waiting

        decided: dict[str, float] = {}
        gate = asyncio.Semaphore(16)
        refused: list[str] = []

        async def approve(request: dict) -> None:
            async with gate:
                response = await reviewer.post(
                    f"/api/approvals/{request['card_id']}/decision",
                    json={"decision": "approve", "version": 1, "comment": "bench"},
                )
            decided[request["id"]] = time.monotonic()
            if response.status_code != 200:
                refused.append(f"{response.status_code}: {response.text[:200]}")

        decisions_started = time.monotonic()
        await asyncio.gather(*(approve(r) for r in waiting))
        decisions_took = time.monotonic() - decisions_started
        done, pending = await asyncio.wait(polls, timeout=WAIT + 30)
        for task in pending:
            task.cancel()

    errors = [
        f"{rid}: {status} {str(body)[:200]}"
        for rid, (status, body, _) in answers.items()
        if status != 200 or not isinstance(body, dict) or body.get("status") != "approved"
    ]
    unanswered = args.agents - len(answers)
    wake = [(answers[rid][2] - decided[rid]) * 1000 for rid in decided if rid in answers and answers[rid][0] == 200]
    return {
        "baseline": baseline,
        "waiting": loaded,
        "answered_before_decision": early,
        "long_poll_errors": len(errors) + unanswered,
        "unanswered": unanswered,
        "error_samples": errors[:5],
        "decisions_refused": len(refused),
        "decisions_s": round(decisions_took, 1),
        "wake_p50_ms": round(statistics.median(wake), 1) if wake else None,
        "wake_p99_ms": round(percentile(wake, 99), 1) if wake else None,
        "wake_max_ms": round(max(wake), 1) if wake else None,
        "settled_s": round(settled_in, 1),
        "long_poll_passes_during_measurement": passes_during,
        "repolls": sum(repolls.values()),
        "idle_connection_retries": len(retried),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--web-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    args = parser.parse_args()
    if not (1 <= args.agents <= 5000 and 1 <= args.duration <= 60 and 1 <= args.connections <= 64):
        sys.exit("keep it bounded: --agents <= 5000, --duration <= 60, --connections <= 64")
    # One socket per waiting agent here, and one per agent in the server (which inherits this limit).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * args.agents + 512
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(needed, soft)), hard))

    dbname = f"{os.environ.get('BENCH_DB_PREFIX', 'bench')}_longpoll_{os.getpid()}"
    with psycopg.connect(f"{args.pg_url}/postgres", autocommit=True) as admin:
        version = admin.execute("SHOW server_version").fetchone()[0]
        admin.execute(f'DROP DATABASE IF EXISTS "{dbname}"')
        admin.execute(f'CREATE DATABASE "{dbname}"')
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_", "WORKER_DATABASE_", "EMBEDDED_"))},
        "DATABASE_URL": f"{args.pg_url}/{dbname}",
        "CONSOLE_ENV": "development",
        "DEMO_TRAFFIC": "0",
    }
    server = None
    log = tempfile.NamedTemporaryFile("w", prefix="longpoll-bench-", suffix=".log", delete=False)  # noqa: SIM115
    try:
        manage(env, "migrate", "-v0")
        manage(env, "demo_setup", "-v0")
        manage(env, "shell", "-c", INBOX_SETUP)
        tokens = {user: manage(env, "create_api_token", user) for user in ("agent", "reviewer", "inbox")}
        port = free_port()
        server = subprocess.Popen(
            [PY, "-m", "console.webserver", "--port", str(port), "--workers", str(args.web_workers)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the server did not start; see {log.name}")
                time.sleep(0.2)
        load_before = os.getloadavg()[0]
        result = asyncio.run(scenario(args, port, tokens, log.name))
        load_after = os.getloadavg()[0]
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # our own server's process group (uvicorn and its workers)
            server.wait(60)
        log.close()
        with psycopg.connect(f"{args.pg_url}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')

    base, loaded = result["baseline"], result["waiting"]
    met = loaded["p99_ms"] < GOAL_P99_MS and result["long_poll_errors"] == 0
    print(
        f"\nPostgreSQL {version} (TCP), {args.web_workers} web processes, no job worker; wrk {args.connections}"
        f" connections x {args.duration} s; server log {log.name}"
    )
    print(f"load average (1 min) before {load_before:.2f}, after {load_after:.2f}, on {os.cpu_count()} cores")
    header = "GET /api/approvals as the inbox reviewer"
    print(f"{header:44s} {'p50 ms':>7s} {'p90 ms':>7s} {'p99 ms':>7s} {'req/s':>7s}")
    for label, x in (("nobody waiting (baseline)", base), (f"{args.agents} agents waiting", loaded)):
        print(f"{label:44s} {x['p50_ms']:7.1f} {x['p90_ms']:7.1f} {x['p99_ms']:7.1f} {x['rps']:7.0f}")
    print(
        f"long-polls: {args.agents} waiting (first looks done in {result['settled_s']} s), "
        f"{result['answered_before_decision']} answered before any decision, {result['long_poll_errors']} errors"
        f" ({result['long_poll_passes_during_measurement']} of their looks went through Django while wrk measured)"
        f" ({result['unanswered']} unanswered); decisions: {args.agents} in {result['decisions_s']} s,"
        f" {result['decisions_refused']} refused; decision to long-poll answer p50 {result['wake_p50_ms']} ms,"
        f" p99 {result['wake_p99_ms']} ms, max {result['wake_max_ms']} ms; {result['repolls']} long-polls ended"
        f" pending (their wait over) and were asked again; {result['idle_connection_retries']} GETs asked again"
        " on a new connection (the kept-alive one closed as idle just as it was reused)"
    )
    for sample in result["error_samples"]:
        print("  error:", sample)
    verdict = "met" if met else "NOT met"
    print(f"goal: p99 < {GOAL_P99_MS} ms with {args.agents} waiting and no long-poll error: {verdict}")
    print(
        "BENCH_JSON "
        + json.dumps(
            {
                "bench": "longpoll",
                "agents": args.agents,
                "connections": args.connections,
                "web_workers": args.web_workers,
                "load": [round(load_before, 2), round(load_after, 2)],
                **{k: v for k, v in result.items() if k != "error_samples"},
            }
        )
    )
    bad = (
        result["long_poll_errors"]
        or result["decisions_refused"]
        or result["answered_before_decision"]
        or base["non_2xx"]
        or loaded["non_2xx"]
    )
    if bad:
        sys.exit("MISMATCH: a long-poll failed or answered early, a decision was refused, or the inbox had a non-2xx")


if __name__ == "__main__":
    main()
