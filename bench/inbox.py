"""Server time of the reviewer inbox (/) with 100,000 open cards, against the same page with 10 cards.

    .venv/bin/python bench/inbox.py [--cards 100000] [--requests 50]

Runs on a new database (DATABASE_URL is ignored): with --database pg15 (default), `bench_inbox_<pid>` on the
machine's PostgreSQL 15 over TCP, dropped at the end; with --database embedded, a new embedded PostgreSQL in a
temporary folder (EMBEDDED_PGDATA). Migrated from scratch (so the indexes are the migrations' own) and seeded by
demo_setup. Requests go through Django's test Client in this process, logged in as the demo `reviewer`
(approve_channel on payments, email and crm through guardian): the whole middleware stack, the view, its queries
and the template, but no HTTP server. Django opens a new database connection per request as in production
(CONN_MAX_AGE 0), so every figure includes that.

1. Baseline: 10 open cards (3 channels, 3 risks, 3 workflows), cases below.
2. Fill: `--cards` more open cards in two INSERT ... SELECT generate_series (runs_run, then approvals_approval):
   waiting_human refund/dunning/kyc runs started by the agent (10 s apart), cards on the three channels, risk by
   hash, 5% escalated, due between 30 min ago and 4 h ahead (so every SLA state occurs), a refund proposal with an
   amount. Then VACUUM ANALYZE, as autovacuum would do after such a load. The inbox's count triggers (migration
   approvals/0016) run in the same INSERT: one kept-count row per kind of card, whatever the number of cards.
3. Each case `--requests` times after a warm-up, interleaved round by round; p50 and p99 of the wall time per
   request, and the number of queries of one extra request. The counts read the kept counts and at most 1,000
   cards per channel and SLA state: with 100,000 cards every state is past that on every channel, so the SLA
   counts say "at least" ("1000+").
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fill_defaults import default_missing  # noqa: E402

RUNS = """
INSERT INTO runs_run
    (id, workflow, workflow_version, tenant, input, status, attempt, max_attempts, cursor, result, error,
     pause_reason, paused_switch, cancel_requested, idempotency_key, trace_id, priority, not_before,
     tokens_in, tokens_out, cost, cost_limit, created_by_id, created_at, updated_at, finished_at, owner)
SELECT
    md5('bench-run-' || i)::uuid,
    (ARRAY['refund', 'refund', 'refund', 'dunning', 'kyc'])[1 + abs(hashint8extended(i, 1)) %% 5],
    1, 'default',
    jsonb_build_object('customer_id', 'cus_' || i, 'amount_cents', 1000 + i %% 90000, 'currency', 'EUR'),
    'waiting_human', 0, 3, 3, NULL, '', '', '', false, NULL, substr(md5(i::text), 1, 32), 0, NULL,
    0, 0, 0, NULL, %(agent)s, now() - interval '1 hour' - i * interval '10 seconds', now(), NULL, ''
FROM generate_series(%(first)s::bigint, %(last)s) AS i
"""

CARDS = """
INSERT INTO approvals_approval
    (run_id, workflow, run_created_by_id, step_seq, kind, channel_id, proposed, current, summary, rule_id,
     confidence, citations, risk, status, args_hash, version, due_at, created_at, decided_at,
     asked_anyone, asked_users, asked_groups, stage)
SELECT
    md5('bench-run-' || i)::uuid,
    (ARRAY['refund', 'refund', 'refund', 'dunning', 'kyc'])[1 + abs(hashint8extended(i, 1)) %% 5], %(agent)s,
    3, 'action',
    (%(channels)s::bigint[])[1 + abs(hashint8extended(i, 2)) %% 3],
    jsonb_build_object(
        'refund', jsonb_build_object('customer_id', 'cus_' || i, 'amount_cents', 1000 + i %% 90000,
                                     'currency', 'EUR', 'reason', 'Item arrived damaged'),
        'email', jsonb_build_object('to', 'c' || i || '@example.com', 'subject', 'Your refund',
                                    'body', 'Hello, we have refunded your order.')),
    NULL,
    'Refund of order ' || i || ': the parcel arrived damaged, policy R-12 allows a full refund.',
    'R-12', 0.9, '[]'::jsonb,
    (ARRAY['low', 'medium', 'high'])[1 + abs(hashint8extended(i, 3)) %% 3],
    CASE WHEN i %% 20 = 0 THEN 'escalated' ELSE 'pending' END,
    md5(i::text), 1,
    now() + (abs(hashint8extended(i, 4)) %% 16200 - 1800) * interval '1 second',
    now() - interval '1 hour', NULL,
    true, '{}', '{}', 0  -- no approval policy: the channel's approvers are asked (approvals.rules)
FROM generate_series(%(first)s::bigint, %(last)s) AS i
"""


def setup_django(database: str, pg_url: str, name: str = "inbox") -> None:
    """A new database for one benchmark (`bench_<name>_<pid>` on PostgreSQL 15, or an embedded one), migrated and
    seeded by demo_setup, dropped at exit; Django set up on it."""
    for name in list(os.environ):
        if name.startswith(("DATABASE_", "EMBEDDED_PGDATA")):
            del os.environ[name]
    if database == "pg15":
        import psycopg

        dbname = f"bench_{name}_{os.getpid()}"
        with psycopg.connect(f"{pg_url}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}"')
            admin.execute(f'CREATE DATABASE "{dbname}"')
        os.environ["DATABASE_URL"] = f"{pg_url}/{dbname}"

        def drop() -> None:
            from django.db import connections

            connections.close_all()
            with psycopg.connect(f"{pg_url}/postgres", autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')

        atexit.register(drop)
    else:
        pgdata = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        atexit.register(shutil.rmtree, pgdata, True)  # runs after the embedded server's own stop handler
        os.environ["EMBEDDED_PGDATA"] = str(pgdata / "pgdata")
    os.environ.setdefault("LOG_LEVEL", "WARNING")  # no JSON line per request
    os.environ["DJANGO_SETTINGS_MODULE"] = "console.settings"
    os.environ.setdefault("DEMO_TRAFFIC", "0")
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    # No collectstatic here: name static files as they are, as the tests do (a page's time does not depend on it).
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }

    call_command("migrate", verbosity=0)
    call_command("demo_setup", verbosity=0)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cards", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--explain", action="store_true", help="print the plan of each case's slowest query")
    parser.add_argument("--database", choices=("pg15", "embedded"), default="pg15")
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    args = parser.parse_args()

    setup_django(args.database, args.pg_url)
    from django.contrib.auth.models import User
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from core.models import Channel

    agent, _ = User.objects.get_or_create(username="agent")
    reviewer = User.objects.get(username="reviewer")
    channels = list(Channel.objects.filter(name__in=["payments", "email", "crm"]).values_list("pk", flat=True))
    assert len(channels) == 3, "demo_setup makes the payments, email and crm channels"
    client = Client(HTTP_HOST="localhost")
    client.force_login(reviewer)

    def fill(first: int, last: int) -> float:
        started = time.perf_counter()
        params = {"first": first, "last": last, "agent": agent.pk, "channels": channels}
        with connection.cursor() as cursor:
            for table in ("runs_run", "approvals_approval"):
                default_missing(cursor, table)
            cursor.execute(RUNS, params)
            cursor.execute(CARDS, params)
            cursor.execute("VACUUM ANALYZE runs_run")
            cursor.execute("VACUUM ANALYZE approvals_approval")
        return time.perf_counter() - started

    def later_page_url() -> str:
        """The cursor of page 200 (cards 9,951 to 10,000 in due order), as the page's "next" link carries it; with
        few cards, the cursor of the second-to-last card."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT due_at, id FROM approvals_approval WHERE status IN ('pending', 'escalated')"
                " ORDER BY due_at, id OFFSET %s LIMIT 1",
                [min(199 * 50 - 1, open_cards() - 2)],
            )
            due_at, pk = cursor.fetchone()
        from urllib.parse import quote

        return "/?after=" + quote(f"{due_at.isoformat()}~{pk}")

    def open_cards() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM approvals_approval WHERE status IN ('pending', 'escalated')")
            return cursor.fetchone()[0]

    def cases() -> dict[str, tuple[str, dict]]:
        return {
            "first page": ("/", {}),
            "filtered: email + high risk + due soon": ("/?channel=email&risk=high&sla=due_soon", {}),
            "filtered: workflow kyc": ("/?workflow=kyc", {}),
            "later page (keyset, ~page 200)": (later_page_url(), {}),
            "htmx poll: rows partial": ("/", {"HX-Request": "true", "HX-Target": "inbox-rows"}),
            "htmx poll: counts partial": ("/", {"HX-Request": "true", "HX-Target": "inbox-counts"}),
            "a card (the most urgent)": (f"/approvals/{urgent_card()}/", {}),
            "runs list": ("/runs/", {}),
        }

    def urgent_card() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT id FROM approvals_approval WHERE status IN ('pending', 'escalated') ORDER BY due_at, id LIMIT 1"
            )
            return cursor.fetchone()[0]

    def explain(name: str, queries: list[dict]) -> None:
        slowest = max(queries, key=lambda q: float(q["time"]))
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, COSTS OFF, SUMMARY OFF) " + slowest["sql"])
            print(f"-- {name}\n" + "\n".join(line for (line,) in cursor.fetchall()))

    def run(title: str) -> None:
        measured = cases()
        for url, headers in measured.values():  # warm-up
            for _ in range(3):
                assert client.get(url, headers=headers).status_code == 200, url
        times: dict[str, list[float]] = {name: [] for name in measured}
        for _ in range(args.requests):
            for name, (url, headers) in measured.items():
                started = time.perf_counter()
                response = client.get(url, headers=headers)
                times[name].append((time.perf_counter() - started) * 1000)
                assert response.status_code == 200, url
        print(f"\n{title}")
        print(f"{'case':42s} {'p50 ms':>8s} {'p99 ms':>8s} {'queries':>8s} {'rows':>5s}")
        for name, (url, headers) in measured.items():
            with CaptureQueriesContext(connection) as ctx:
                response = client.get(url, headers=headers)
            rows = response.content.count(b'class="card-row')
            if args.explain and "100" in title:
                explain(name, ctx.captured_queries)
            values = times[name]
            print(
                f"{name:42s} {statistics.median(values):8.2f} {percentile(values, 0.99):8.2f} "
                f"{len(ctx.captured_queries):8d} {rows:5d}"
            )

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        print(f"{args.database}: PostgreSQL {cursor.fetchone()[0]}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    fill(1, 10)
    run(f"Baseline: {open_cards():,} open cards")
    took = fill(11, 10 + args.cards)
    print(f"\nFilled {args.cards:,} cards (and their runs) in {took:.1f} s, VACUUM ANALYZE included")
    run(f"{open_cards():,} open cards")
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
