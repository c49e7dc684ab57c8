"""What the inbox's kept counts cost the cards' writes: a burst of cards opened and closed from several connections
at once, all of one kind (one channel, risk and workflow: one count key, the worst case for contention), with the
counting triggers of migration approvals/0016 on and off, in alternate rounds of the same run.

    .venv/bin/python bench/inbox_writes.py [--threads 4] [--cards 500] [--rounds 3]

A new database as bench/inbox.py makes one (`bench_inbox_writes_<pid>` on the machine's PostgreSQL 15 over TCP),
migrated and seeded by demo_setup, with `--threads x --cards x --rounds x 2` waiting runs. Each
thread opens a card (an INSERT of one row, its own transaction) then closes it (an UPDATE of its status, another
transaction), `--cards` times; "off" disables the triggers (ALTER TABLE ... DISABLE TRIGGER), so the difference is
what counting adds. Printed per round: transactions per second over all threads, and p50 and p99 of one
transaction's wall time; and the kept total against the open cards at the end (they must be equal).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.inbox import RUNS, percentile, setup_django  # noqa: E402

OPEN = """
INSERT INTO approvals_approval
    (run_id, workflow, run_created_by_id, step_seq, kind, channel_id, proposed, current, summary, rule_id,
     confidence, citations, risk, status, args_hash, version, due_at, created_at, decided_at,
     asked_anyone, asked_users, asked_groups, stage)
VALUES (md5('bench-run-' || %(i)s)::uuid, 'refund', %(agent)s, 3, 'action', %(channel)s, '{}'::jsonb, NULL,
        'A refund', 'R-12', 0.9, '[]'::jsonb, 'high', 'pending', md5(%(i)s::text), 1,
        now() + interval '1 hour', now(), NULL, true, '{}', '{}', 0)
RETURNING id
"""
CLOSE = "UPDATE approvals_approval SET status = 'approved', decided_at = now(), version = 2 WHERE id = %s"
TRIGGERS = ("insert", "update", "delete")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--cards", type=int, default=500, help="cards each thread opens and closes per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (on, off), alternated")
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    args = parser.parse_args()

    setup_django("pg15", args.pg_url, name="inbox_writes")
    import psycopg
    from django.contrib.auth.models import User
    from django.db import connection

    from bench.fill_defaults import default_missing
    from core.models import Channel

    agent, _ = User.objects.get_or_create(username="agent")
    channel = Channel.objects.get(name="payments")
    total = args.threads * args.cards * args.rounds * 2
    with connection.cursor() as cursor:
        for table in ("runs_run", "approvals_approval"):
            default_missing(cursor, table)
        cursor.execute(RUNS, {"first": 1, "last": total, "agent": agent.pk})
    url = os.environ["DATABASE_URL"]
    next_i = iter(range(1, total + 1))
    lock = threading.Lock()

    def connect():
        return psycopg.connect(url, autocommit=False)

    def burst() -> tuple[float, list[float]]:
        times: list[float] = []

        def work() -> None:
            with connect() as conn:
                for _ in range(args.cards):
                    with lock:
                        i = next(next_i)
                    started = time.perf_counter()
                    (pk,) = conn.execute(OPEN, {"i": i, "agent": agent.pk, "channel": channel.pk}).fetchone()
                    conn.commit()
                    opened = time.perf_counter()
                    conn.execute(CLOSE, [pk])
                    conn.commit()
                    done = time.perf_counter()
                    with lock:
                        times.extend([(opened - started) * 1000, (done - opened) * 1000])

        threads = [threading.Thread(target=work) for _ in range(args.threads)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - started, times

    def triggers(on: bool) -> None:
        with connection.cursor() as cursor:
            for event in TRIGGERS:
                verb = "ENABLE" if on else "DISABLE"
                cursor.execute(f"ALTER TABLE approvals_approval {verb} TRIGGER approvals_inbox_count_{event}")

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{args.threads} threads x {args.cards} cards opened and closed (2 transactions each), one count key")
    print(f"{'round':10s} {'tx/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s}")
    results: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            triggers(mode == "on")
            took, times = burst()
            rate = len(times) / took
            results[mode].append(rate)
            p50, p99 = statistics.median(times), percentile(times, 0.99)
            print(f"{mode + ' ' + str(r + 1):10s} {rate:8.0f} {p50:8.2f} {p99:8.2f}")
    triggers(True)
    for mode, rates in results.items():
        print(f"triggers {mode}: median {statistics.median(rates):.0f} tx/s")
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(sum(n), 0) FROM approvals_inboxcount")
        kept = cursor.fetchone()[0]
        cursor.execute("SELECT count(*) FROM approvals_approval WHERE status IN ('pending', 'escalated')")
        print(f"kept total {kept}, open cards {cursor.fetchone()[0]} (all closed: the burst leaves none open)")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
