"""Time of an offline evaluation (evals, `manage.py evaluate`) over 10,000 recorded cards (the promise: under 10 s).

    .venv/bin/python bench/evaluate.py [--cards 10000] [--rounds 5] [--database pg15|embedded]

Runs on a new database (DATABASE_URL is ignored): with --database pg15 (default), `bench_evaluate_<pid>` on the
machine's PostgreSQL 15 over TCP, dropped at the end; with --database embedded, a new embedded PostgreSQL in a
temporary folder (EMBEDDED_PGDATA). Migrated from scratch and seeded by demo_setup.

1. Fill: `--cards` closed cards in INSERT ... SELECT generate_series (runs_run, approvals_approval, then their
   decisions): on payments, email and crm, amounts from 1 to 100,000 cents (5% without one), EUR or USD, closed
   over the last 30 days as approved (60%, a tenth of them by two people), edited (12%), rejected (18%, a 17th
   of them by the SLA's safe default), expired or cancelled (10%), decided by the demo `reviewer` and `admin`.
2. Each round evaluates "auto-approve payments under 50 EUR, refuse high-risk kyc, quorum of 2 on payments"
   over the 30 days, and saves it (Evaluation.of_rule: the queries, the Python, the save with its audit entry).
   Prints the median and worst wall time, and one line `BENCH_JSON {...}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fill_defaults import default_missing  # noqa: E402
from bench.inbox import setup_django  # noqa: E402

RUNS = """
INSERT INTO runs_run (id, workflow, workflow_version, input, status, created_by_id, created_at, updated_at,
                      finished_at)
SELECT md5('eval-run-' || i)::uuid, (ARRAY['refund', 'refund', 'dunning', 'kyc'])[1 + i %% 4], 1, '{}'::jsonb,
       'succeeded', %(agent)s, now() - interval '31 days', now(), now()
FROM generate_series(1, %(cards)s) AS i
"""

# The ending of card i: e = hash % 100; 0-59 approved, 60-71 edited, 72-89 rejected (by a person, except every
# 17th card's: the SLA's safe default, DECISIONS below), 90-96 expired, 97-99 cancelled.
CARDS = """
INSERT INTO approvals_approval
    (run_id, workflow, step_seq, kind, channel_id, proposed, summary, amount_minor, currency, rule_id, risk, status,
     args_hash, version, due_at, created_at, decided_at, asked_anyone, asked_users, asked_groups, stage)
SELECT md5('eval-run-' || i)::uuid, (ARRAY['refund', 'refund', 'dunning', 'kyc'])[1 + i %% 4], 3, 'action',
       (%(channels)s::bigint[])[1 + abs(hashint8extended(i, 2)) %% 3],
       jsonb_build_object('amount_cents', i), 'card ' || i,
       CASE WHEN i %% 20 = 0 THEN NULL ELSE 1 + abs(hashint8extended(i, 3)) %% 100000 END,
       CASE WHEN i %% 20 = 0 THEN '' WHEN i %% 3 = 0 THEN 'USD' ELSE 'EUR' END,
       (ARRAY['tool:refund_order', 'R-12', ''])[1 + i %% 3],
       (ARRAY['low', 'medium', 'high'])[1 + abs(hashint8extended(i, 4)) %% 3],
       CASE WHEN e < 60 THEN 'approved' WHEN e < 72 THEN 'edited' WHEN e < 90 THEN 'rejected'
            WHEN e < 97 THEN 'expired' ELSE 'cancelled' END,
       md5(i::text), 2, now(), t, t + (30 + abs(hashint8extended(i, 5)) %% 14400) * interval '1 second',
       true, '{}', '{}', 0
FROM (SELECT i, abs(hashint8extended(i, 1)) %% 100 AS e,
             now() - interval '30 days' + i * (interval '29 days' / %(cards)s) AS t
      FROM generate_series(1, %(cards)s) AS i) AS g
"""

DECISIONS = """
INSERT INTO approvals_decision (approval_id, actor_id, decision, comment, reason, agreement, done_by_hand, undo,
                                stage_name, created_at)
SELECT a.id, %(reviewer)s,
       CASE WHEN a.status = 'approved' THEN 'approve' WHEN a.status = 'edited' THEN 'edit' ELSE 'reject' END,
       CASE WHEN a.status = 'rejected' THEN 'not this customer' ELSE '' END, '', '', '', false, '', a.decided_at
FROM approvals_approval a
WHERE a.status IN ('approved', 'edited', 'rejected');
-- a tenth of the approved cards: a second person approved too
INSERT INTO approvals_decision (approval_id, actor_id, decision, comment, reason, agreement, done_by_hand, undo,
                                stage_name, created_at)
SELECT a.id, %(admin)s, 'approve', '', '', '', '', false, '', a.decided_at
FROM approvals_approval a WHERE a.status = 'approved' AND a.id %% 10 = 0;
-- the system's rejections (the SLA's safe default): no actor
UPDATE approvals_decision SET actor_id = NULL, reason = 'sla'
WHERE decision = 'reject' AND approval_id %% 17 = 0;
"""

CANDIDATE = {
    "name": "auto-approve payments under 50 EUR, refuse high-risk kyc, quorum 2 on payments",
    "rules": [
        {"if": {"channel": "payments", "currency": "EUR", "amount_below": 5000}, "then": "auto_approve"},
        {"if": {"workflow": "kyc", "risk": "high"}, "then": "refuse"},
    ],
    "otherwise": "ask",
    "quorum": {"channel": "payments", "approvers": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cards", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--database", choices=("pg15", "embedded"), default="pg15")
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    args = parser.parse_args()
    setup_django(args.database, args.pg_url, name="evaluate")

    from django.contrib.auth.models import User
    from django.db import connection
    from django.utils import timezone

    from core.models import Channel
    from evals.models import Evaluation

    users = {u.username: u.pk for u in User.objects.filter(username__in=["agent", "reviewer", "admin"])}
    channels = list(Channel.objects.filter(name__in=["payments", "email", "crm"]).values_list("pk", flat=True))
    params = {"cards": args.cards, "channels": channels, **users}
    started = time.perf_counter()
    with connection.cursor() as cursor:
        for table in ("runs_run", "approvals_approval", "approvals_decision"):
            default_missing(cursor, table)
        cursor.execute(RUNS, params)
        cursor.execute(CARDS, params)
        cursor.execute(DECISIONS, params)
        cursor.execute("VACUUM ANALYZE approvals_approval")
        cursor.execute("VACUUM ANALYZE approvals_decision")
        cursor.execute("SHOW server_version")
        version = cursor.fetchone()[0]
    took = time.perf_counter() - started
    print(f"{args.database}: PostgreSQL {version}; filled {args.cards:,} cards in {took:.1f} s")

    from evals import records

    reads = []  # the baseline: the same cards and decisions read, nothing evaluated or saved
    for _ in range(args.rounds):
        now = timezone.now()
        started = time.perf_counter()
        records.recorded_cards(now - timedelta(days=30), now)
        reads.append(time.perf_counter() - started)
    times = []
    for _ in range(args.rounds):
        now = timezone.now()
        started = time.perf_counter()
        evaluation = Evaluation.of_rule(CANDIDATE, now - timedelta(days=30), now)
        times.append(time.perf_counter() - started)
    f = evaluation.figures
    print(
        f"closed in the period: {f['total']:,}; decided by a person: {f['decided_by_person']:,}; "
        f"left out: {f['not_decided_by_person']}"
    )
    print(
        f"agreement {f['agreement']:.1%} over {f['candidate_decided']:,} cards; dangerous {f['dangerous']['count']:,}; "
        f"refused but approved {f['refused_approved']['count']:,}; quorum short {f['quorum_short']['count']:,}"
    )
    print(f"evaluate + save, {args.rounds} rounds: median {statistics.median(times):.3f} s, worst {max(times):.3f} s")
    print(f"baseline, the cards and decisions read alone: median {statistics.median(reads):.3f} s")
    assert f["total"] == args.cards, "every card of the fill is in the period"
    print(
        "BENCH_JSON "
        + json.dumps(
            {
                "bench": "evaluate",
                "database": args.database,
                "cards": args.cards,
                "median_s": round(statistics.median(times), 4),
                "worst_s": round(max(times), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
