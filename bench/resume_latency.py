"""Resume latency: from a reviewer's decision to the run executing again, with a real worker.

    .venv/bin/python bench/resume_latency.py [--runs 150] [--interval-ms 15]

Parks --runs refund runs at their gate, then approves them one every --interval-ms (with --closed-loop: each as
soon as the worker has taken the previous one again, back to back, plus --interval-ms) while a worker (one
process, the default concurrency) resumes and finishes them. Latency = the gate step's restart
(Step.started_at, written by the worker) minus the decision's creation (Decision.created_at, written just
before the decision commits), both on this machine's clock.

Measured twice in the same run, on the same database: with the notification latch of jobs/worker.py (what
ships), and as a baseline without it (WORKER_KEEP_NOTIFICATIONS=0: procrastinate 3.10's stock worker, which
can drop a notification that arrives during an empty fetch and then waits for its poll, here 5 s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def measure(runs: int, interval: float, keep_notifications: bool, closed_loop: bool = False) -> list[float]:
    from django.conf import settings
    from django.contrib.auth.models import User

    from approvals.models import Approval, Decision
    from runs import submission  # after django.setup(): it imports the models
    from runs.models import Run, Step

    env = {
        **os.environ,
        "DATABASE_URL": settings.DATABASE_URL,
        "WORKER_POLL_INTERVAL": "5",
        "WORKER_KEEP_NOTIFICATIONS": "1" if keep_notifications else "0",
        "LOG_LEVEL": "WARNING",
    }
    worker = subprocess.Popen(
        [sys.executable, "manage.py", "procrastinate", "worker"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        agent, reviewer = User.objects.get(username="agent"), User.objects.get(username="reviewer")
        ids = [
            submission.submit(
                workflow="refund",
                created_by=agent,
                input={"customer_id": f"cus_{i}", "amount_cents": 50_000 + i, "currency": "EUR", "reason": "damaged"},
            )[0].id
            for i in range(runs)
        ]
        while Run.objects.filter(id__in=ids, status="waiting_human").count() < runs:
            time.sleep(0.1)
        for card in Approval.objects.filter(run_id__in=ids, status="pending"):
            card.decide(reviewer, "approve")
            if closed_loop:  # back to back: the next decision as soon as the worker has taken this run again
                deadline = time.monotonic() + 30
                while Run.objects.filter(pk=card.run_id, status="queued").exists():
                    assert time.monotonic() < deadline, "a decided run was not resumed within 30 s"
                    time.sleep(0.001)
            time.sleep(interval)
        deadline = time.monotonic() + 60
        while Run.objects.filter(id__in=ids, status="succeeded").count() < runs:
            assert time.monotonic() < deadline, "runs did not finish within 60 s"
            time.sleep(0.1)
        decided = dict(Decision.objects.filter(approval__run_id__in=ids).values_list("approval__run_id", "created_at"))
        resumed = dict(Step.objects.filter(run_id__in=ids, name="approve_refund").values_list("run_id", "started_at"))
        return [(resumed[i] - decided[i]).total_seconds() * 1000 for i in ids]
    finally:
        worker.terminate()
        worker.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=150)
    parser.add_argument("--interval-ms", type=float, default=15)
    parser.add_argument(
        "--closed-loop",
        action="store_true",
        help="decide the next card once the worker has taken the previous run again (then --interval-ms more)",
    )
    args = parser.parse_args()
    os.environ.pop("DATABASE_URL", None)
    os.environ["EMBEDDED_PGDATA"] = str(Path(tempfile.mkdtemp(prefix="bench-resume-")) / "pgdata")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    os.environ["LOG_LEVEL"] = "WARNING"
    import django
    from django.core.management import call_command
    from django.db import connection, transaction

    django.setup()
    call_command("migrate", verbosity=0)
    call_command("demo_setup", verbosity=0)
    results = {}
    for name, keep in (("baseline: stock worker", False), ("with the latch (shipped)", True)):
        # Each mode starts from empty tables. A throwaway database: the audit log's TRUNCATE trigger is waived
        # (as the table's owner, in this transaction; see docs/DESIGN-NOTES.md, "Data").
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL console.allow_audit_truncate = on")
            call_command("flush", interactive=False, verbosity=0)
        call_command("demo_setup", verbosity=0)
        latencies = measure(args.runs, args.interval_ms / 1000, keep, args.closed_loop)
        results[name] = latencies
        print(
            f"{name:26s} n={len(latencies)}  p50 {percentile(latencies, 50):7.1f} ms  "
            f"p99 {percentile(latencies, 99):7.1f} ms  max {max(latencies):7.1f} ms  "
            f"mean {statistics.mean(latencies):7.1f} ms  over 1 s: {sum(v > 1000 for v in latencies)}"
        )
    stock, shipped = results.values()
    print(f"p99 ratio stock / shipped: {percentile(stock, 99) / percentile(shipped, 99):.1f}x")


if __name__ == "__main__":
    main()
