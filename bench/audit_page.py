"""Server time of the audit log page (/audit/) with 1,000,000 entries, against the same page on an empty log.

    .venv/bin/python bench/audit_page.py [--entries 1000000] [--requests 200]

Runs on a new embedded PostgreSQL in a temporary folder (EMBEDDED_PGDATA; DATABASE_URL is ignored), migrated
from scratch, so the indexes are the migrations' own. Requests go through Django's test Client in this process as
a logged-in superuser: the whole middleware stack (session and user lookups included), the view, its queries and
the template, but no HTTP server. Django opens a new database connection per request here as in production
(CONN_MAX_AGE 0), so every figure includes that.

1. Baseline, measured first: GET /healthz (no database) and GET /audit/ on the empty log.
2. Fill: `--entries` rows in one INSERT ... SELECT generate_series, a year of history (`at` rising with the id),
   60% by 40 people (9 actions), 20% by the agent (run.cancel), 20% by 3 system components (3 actions of their
   own), 3 channels and none, runs of 3 entries, 40% (people's) with a comment of four words drawn from a
   120-word vocabulary, plus the word "chargeback" in one entry in 10,000. The hashes are unique but NOT a
   valid chain (audit_verify would reject it): the page never checks the chain, only shows it, and the
   append-only trigger refuses UPDATE and DELETE, not INSERT. Then VACUUM ANALYZE, as autovacuum would do
   after such a load.
3. The cases below, interleaved round by round so that all see the same conditions, `--requests` times each
   after a warm-up; p50 and p99 of the wall time per request, then from one extra request each: the number of
   queries, the time of the slowest one (`--explain` prints its plan) and the rows shown. The load average is
   printed at the start and the end, as the machine may be shared.
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
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fill_defaults import default_missing  # noqa: E402

# Who does what: people decide, operate and administer; the agent cancels its own runs; system components
# expire, escalate and dead-letter. So some combinations of filters never occur, as in a real log.
HUMAN_ACTIONS = [
    "approval.approve",
    "approval.edit",
    "approval.reject",
    "run.cancel",
    "run.requeue",
    "kill_switch.engage",
    "kill_switch.release",
    "channel.change",
    "permission.grant",
]
SYSTEM_ACTIONS = ["approval.expire", "approval.escalate", "run.dead_letter"]
VOCABULARY = (
    "customer refund payment invoice duplicate charge card email address wrong amount currency order delivery "
    "late damaged missing account closed fraud suspected verified identity policy limit exceeded approved "
    "manager escalation urgent review again later contract renewal discount coupon expired subscription "
    "cancel plan upgrade downgrade billing cycle tax vat receipt shipping return label warehouse stock "
    "supplier partner region europe america asia holiday weekend night shift queue backlog sla breach "
    "apology goodwill gesture credit note balance transfer bank iban swift wire pending settled reversed "
    "dispute evidence photo screenshot complaint satisfied unhappy loyal premium basic trial student "
    "nonprofit enterprise startup agency reseller marketplace seller buyer listing price mismatch typo "
    "name phone verified twice once never"
)
WORDS = VOCABULARY.split()

HTMX = {"HX-Request": "true"}  # for the cases named "htmx ...": the results partial only
# Pseudo-random but reproducible choices: hashint8extended(i, seed) is a 64-bit hash of the row number.
FILL = """
INSERT INTO console_auditentry
    (at, actor_type, actor, action, target, run_id, approval_id, channel, data, trace_id, prev_hash, hash)
SELECT
    %(start)s::timestamptz + i * %(step)s::interval,
    CASE WHEN kind < 6 THEN 'human' WHEN kind < 8 THEN 'agent' ELSE 'system' END,
    CASE WHEN kind < 6 THEN 'user' || abs(hashint8extended(i, 1)) %% 40
         WHEN kind < 8 THEN 'agent'
         ELSE (ARRAY['engine', 'sla', 'sweeper'])[1 + abs(hashint8extended(i, 1)) %% 3] END,
    CASE WHEN kind < 6 THEN (%(human_actions)s::text[])[1 + abs(hashint8extended(i, 2)) %% %(n_human)s]
         WHEN kind < 8 THEN 'run.cancel'
         ELSE (%(system_actions)s::text[])[1 + abs(hashint8extended(i, 2)) %% %(n_system)s] END,
    'run:' || md5((i / 3)::text)::uuid,
    md5((i / 3)::text)::uuid,
    CASE WHEN i %% 3 = 0 THEN i / 3 END,
    (ARRAY['payments', 'email', 'crm', ''])[1 + abs(hashint8extended(i, 3)) %% 4],
    CASE WHEN kind < 4 THEN jsonb_build_object(
            'comment',
            w[1 + abs(hashint8extended(i, 4)) %% %(n_words)s] || ' '
            || w[1 + abs(hashint8extended(i, 5)) %% %(n_words)s] || ' '
            || w[1 + abs(hashint8extended(i, 6)) %% %(n_words)s] || ' '
            || w[1 + abs(hashint8extended(i, 7)) %% %(n_words)s]
            || CASE WHEN i %% 10000 = 0 THEN ' chargeback' ELSE '' END,
            'reason', 'policy')
         ELSE jsonb_build_object('status', 'queued', 'step', 'issue_refund') END,
    substr(md5(i::text), 1, 32),
    CASE WHEN i = 1 THEN repeat('0', 64) ELSE encode(sha256(int8send(i - 1)), 'hex') END,
    encode(sha256(int8send(i)), 'hex')
FROM generate_series(1::bigint, %(n)s) AS i
    CROSS JOIN LATERAL (SELECT i %% 10 AS kind) AS k
    CROSS JOIN (SELECT %(words)s::text[] AS w) AS vocabulary
"""


def setup_django() -> Path:
    pgdata = Path(tempfile.mkdtemp(prefix="bench-audit-"))
    atexit.register(shutil.rmtree, pgdata, True)  # runs after the embedded server's own stop handler
    os.environ["EMBEDDED_PGDATA"] = str(pgdata / "pgdata")
    os.environ.pop("DATABASE_URL", None)
    os.environ.setdefault("LOG_LEVEL", "WARNING")  # no JSON line per request
    os.environ["DJANGO_SETTINGS_MODULE"] = "console.settings"
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return pgdata


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--explain", action="store_true", help="print the plan of each case's slowest query")
    args = parser.parse_args()

    setup_django()
    from django.contrib.auth.models import User
    from django.db import connection
    from django.test import Client
    from django.utils import timezone

    plans: list[str] = []
    admin = User.objects.create_user("bench-admin", is_superuser=True, is_staff=True)
    client = Client(HTTP_HOST="localhost")
    client.force_login(admin)

    def measure(cases: dict[str, str], rounds: int) -> dict[str, list[float]]:
        for name, url in cases.items():  # warm-up: templates, URL resolvers, the page cache of PostgreSQL
            for _ in range(3):
                assert client.get(url, headers=HTMX if name.startswith("htmx") else {}).status_code == 200, url
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, url in cases.items():
                started = time.perf_counter()
                response = client.get(url, headers=HTMX if name.startswith("htmx") else {})
                if response.streaming:
                    b"".join(response.streaming_content)
                times[name].append((time.perf_counter() - started) * 1000)
                assert response.status_code == 200, url
        return times

    def queries(name: str, url: str) -> tuple[int, float, int]:
        """Queries of one request, the slowest one's time, and the rows (or CSV lines) it answered."""
        durations: list[float] = []

        statements: list[tuple[str, object]] = []

        def timed(execute, sql, params, many, context):
            started = time.perf_counter()
            try:
                return execute(sql, params, many, context)
            finally:
                durations.append((time.perf_counter() - started) * 1000)
                statements.append((sql, params))

        with connection.execute_wrapper(timed):
            response = client.get(url, headers=HTMX if name.startswith("htmx") else {})
            body = b"".join(response.streaming_content) if response.streaming else response.content
        rows = body.count(b"\n") - 1 if response.streaming else body.count(b"data-entry=")
        if args.explain and durations:
            sql, params = statements[durations.index(max(durations))]
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN (ANALYZE, COSTS OFF, SUMMARY OFF) " + sql, params)
                plans.append(f"-- {name}\n" + "\n".join(line for (line,) in cursor.fetchall()))
        return len(durations), max(durations, default=0), rows

    def report(title: str, cases: dict[str, str], times: dict[str, list[float]]) -> None:
        print(f"\n{title}")
        print(f"{'case':34s} {'p50 ms':>8s} {'p99 ms':>8s} {'queries':>8s} {'slowest q ms':>13s} {'rows':>6s}  url")
        for name, url in cases.items():
            count, slowest, rows = queries(name, url)
            values = times[name]
            print(
                f"{name:34s} {statistics.median(values):8.2f} {percentile(values, 0.99):8.2f} "
                f"{count:8d} {slowest:13.2f} {rows:6d}  {url}"
            )

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    baseline_cases = {"baseline: /healthz": "/healthz", "baseline: /audit/, empty log": "/audit/"}
    report("Baseline (empty log)", baseline_cases, measure(baseline_cases, args.requests))

    now = timezone.now()
    start = now - timedelta(days=365)
    step = timedelta(days=365) / args.entries
    started = time.perf_counter()
    with connection.cursor() as cursor:
        default_missing(cursor, "console_auditentry")
        cursor.execute(
            FILL,
            {
                "start": start,
                "step": step,
                "n": args.entries,
                "human_actions": HUMAN_ACTIONS,
                "n_human": len(HUMAN_ACTIONS),
                "system_actions": SYSTEM_ACTIONS,
                "n_system": len(SYSTEM_ACTIONS),
                "words": WORDS,
                "n_words": len(WORDS),
            },
        )
        filled = time.perf_counter() - started
        cursor.execute("VACUUM ANALYZE console_auditentry")
        cursor.execute("SELECT pg_size_pretty(pg_total_relation_size('console_auditentry'))")
        (size,) = cursor.fetchone()
        # The cursor of page 500: the last entry of page 499.
        cursor.execute("SELECT id FROM console_auditentry ORDER BY id DESC OFFSET %s LIMIT 1", [499 * 50 - 1])
        (page_500,) = cursor.fetchone()
    print(
        f"\nFilled {args.entries:,} entries in {filled:.1f} s, VACUUM ANALYZE in "
        f"{time.perf_counter() - started - filled:.1f} s; table with indexes: {size}"
    )

    day = (now - timedelta(days=200)).date()
    long_ago = (now - timedelta(days=364)).date()
    cases = {
        "first page": "/audit/",
        "actor (1 of 40 people)": "/audit/?actor=user7",
        "actor + action + channel": "/audit/?actor={}&action={}&channel={}".format(*_combination()),
        "filters that match nothing": "/audit/?actor_type=system&action=approval.reject",
        "run id": "/audit/?run=" + _run_id(),
        "full-text, common word": "/audit/?q=customer",
        "full-text, rare word (100 hits)": "/audit/?q=chargeback",
        "full-text, absent word": "/audit/?q=zeppelin",
        "date range: one day, 200 days ago": f"/audit/?date_from={day}&date_to={day}",
        "date range: 6 months, ended 6 ago": f"/audit/?date_from={long_ago}&date_to={long_ago + timedelta(days=182)}",
        "date range + full-text": f"/audit/?date_from={day}&date_to={day + timedelta(days=30)}&q=refund",
        "page 500 by keyset": f"/audit/?before={page_500}",
        # As the filter form sends it (every field, empty or not), answered with the results partial only.
        "htmx partial, actor": "/audit/?actor=user7&actor_type=&action=&channel=&run=&date_from=&date_to=&q=",
        "CSV export, one day (~2,700 rows)": f"/audit/export.csv?date_from={day}&date_to={day}",
    }
    report(f"{args.entries:,} entries", cases, measure(cases, args.requests))
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for plan in plans:
        print("\n" + plan)


def _combination() -> tuple[str, str, str]:
    """An actor, action and channel that occur together (the fill's pattern leaves many combinations empty)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT actor, action, channel FROM console_auditentry WHERE actor = 'user7' LIMIT 1")
        return cursor.fetchone()


def _run_id() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT md5('12345')::uuid")
        return str(cursor.fetchone()[0])


if __name__ == "__main__":
    main()
