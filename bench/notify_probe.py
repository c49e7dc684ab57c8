"""What a NOTIFY costs a committing INSERT: 16 clients in autocommit, one INSERT each per statement, without and
with a `pg_notify` in the same transaction (Procrastinate's insert trigger on procrastinate_jobs notifies two
channels for every job deferred, so every `POST /api/runs` commit notifies).

    .venv/bin/python bench/notify_probe.py [--pg-url postgres://postgres@127.0.0.1:5432] [--seconds 5] [--clients 16]

PostgreSQL serialises the commits of transactions that notified (a lock held from before the commit record until
the commit is durable, its WAL flush included), so their rate is bounded by one WAL flush at a time, whatever the
number of clients. A database `bench_notify_<pid>` is created and dropped here.

The third case is a group commit's shape (runs/group_commit.py, issue 30): `--batch` rows inserted by one statement
that notifies once (PostgreSQL folds a transaction's identical notifications into one: jobs/migrations/0003), so
each pass through the queue of notifying commits carries that many rows. Rows/s is what each case inserts.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import psycopg


def statements(batch: int) -> dict[str, tuple[str, int]]:
    """label -> (statement, rows it inserts)."""
    return {
        "INSERT": ("INSERT INTO probe (body) VALUES ('x')", 1),
        "INSERT + pg_notify": (
            "WITH i AS (INSERT INTO probe (body) VALUES ('x') RETURNING id) SELECT pg_notify('probe', id::text) FROM i",
            1,
        ),
        f"{batch} INSERTs + 1 notify": (
            f"WITH i AS (INSERT INTO probe (body) SELECT 'x' FROM generate_series(1, {batch}) RETURNING id)"
            " SELECT pg_notify('probe', 'batch') FROM i",  # identical payloads: one notification
            batch,
        ),
    }


def rate(url: str, sql: str, clients: int, seconds: float) -> float:
    done = [0] * clients
    stop = time.monotonic() + seconds

    def work(index: int) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            while time.monotonic() < stop:
                conn.execute(sql)
                done[index] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8, help="rows per notifying commit in the group-commit case")
    args = parser.parse_args()
    name = f"bench_notify_{os.getpid()}"
    with psycopg.connect(f"{args.pg_url}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            url = f"{args.pg_url}/{name}"
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("CREATE TABLE probe (id bigserial PRIMARY KEY, body text NOT NULL)")
                settings = {s: conn.execute(f"SHOW {s}").fetchone()[0] for s in ("synchronous_commit", "fsync")}
            print(f"{args.clients} clients, {args.seconds:g} s each, {settings}; load average {os.getloadavg()[0]:.1f}")
            for _ in range(2):  # in turns, twice
                for label, (sql, rows) in statements(args.batch).items():
                    commits = rate(url, sql, args.clients, args.seconds)
                    print(f"  {label:22s} {commits:8.0f} commits/s {commits * rows:8.0f} rows/s")
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
