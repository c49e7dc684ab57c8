"""Where `POST /api/runs` spends its CPU: cProfile over N requests through the production WSGI app, in process.

    .venv/bin/python bench/profile_api.py [--requests 2000] [--path /api/runs|/bench/insert] [--top 25]

A fresh database on the machine's PostgreSQL 15 (`--pg-url`, a database `bench_profile_<pid>` created, migrated
and dropped here), DEBUG off, the pool on, JSON request logs to /dev/null as in production. The requests go
through `console.wsgi.application` (the body limit, every middleware, ninja, the view), one after another in one
thread: no server, no network, so what is left is the Python cost of a request and its round trips to PostgreSQL.
Prints the CPU time per request (process time) and the top functions by inclusive and by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--path", default="/api/runs")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    dbname = f"bench_profile_{os.getpid()}"
    admin = psycopg.connect(f"{args.pg_url}/postgres", autocommit=True)
    admin.execute(f'CREATE DATABASE "{dbname}"')
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DATABASE_")}
        env |= {"DATABASE_URL": f"{args.pg_url}/{dbname}", "DEBUG": "0", "BENCH_ENDPOINTS": "1"}
        for command in (["migrate", "-v0"], ["demo_setup", "-v0"]):
            subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=env, check=True)
        os.environ.update(env | {"DATABASE_POOL": "1"})
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
        sys.path.insert(0, str(ROOT))
        run(args)
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        admin.close()


def run(args) -> None:
    import django

    django.setup()
    import logging

    from console.wsgi import application
    from core.models import ApiToken

    devnull = open(os.devnull, "w")  # noqa: SIM115 - for the whole run
    for handler in logging.getLogger().handlers:  # the JSON lines are still rendered and written, to /dev/null
        handler.setStream(devnull)
    token = ApiToken.issue(_agent(), by="bench/profile_api.py")[1] if args.path.startswith("/api/") else ""
    counter = [0]

    def one() -> int:
        counter[0] += 1
        body = (
            b'{"workflow": "refund", "idempotency_key": "profile-%d", "input": {"customer_id": "cus_%d",'
            b' "amount_cents": 12500, "currency": "EUR", "reason": "Item arrived damaged"}}' % (counter[0], counter[0])
        )
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": args.path,
            "SCRIPT_NAME": "",
            "QUERY_STRING": "",
            "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "8000",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "REMOTE_ADDR": "127.0.0.1",
            "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(body)),
            "HTTP_HOST": "127.0.0.1:8000",
            "HTTP_AUTHORIZATION": f"Bearer {token}",
            "wsgi.input": io.BytesIO(body),
            "wsgi.url_scheme": "http",
            "wsgi.errors": sys.stderr,
        }
        status = []
        result = application(environ, lambda s, h, e=None: status.append(s))
        b"".join(result)
        if hasattr(result, "close"):
            result.close()
        return int(status[0].split()[0])

    for _ in range(50):  # warm-up
        assert one() in (200, 202), "the warm-up request failed"
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.requests):
        one()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(
        f"{args.requests} x POST {args.path}: {wall * 1000 / args.requests:.2f} ms wall, "
        f"{cpu * 1000 / args.requests:.2f} ms CPU per request (no profiler)"
    )
    profiler = cProfile.Profile(time.process_time)  # CPU time: what the request costs the machine, not its waits
    profiler.enable()
    for _ in range(args.requests):
        one()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    print(_short(out.getvalue()))


def _short(text: str) -> str:
    return text.replace(str(ROOT) + "/", "").replace(str(Path(sys.prefix)) + "/lib/", "")


def _agent():
    from django.contrib.auth import get_user_model

    return get_user_model().objects.get(username="agent")


if __name__ == "__main__":
    main()
