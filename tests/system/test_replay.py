"""Replay (runs.replay) of a run the product ran as it is deployed: the production web server, real workers, a
worker SIGKILLed in the middle of a read (its step retried by another), cards decided over the API. `manage.py
replay`, a process of its own, then replays the run on the same code: identically, with no call to the model or the
demo's systems, and not one row of the database changed (every table hashed before and after)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from django.conf import settings
from django.db import connection

from demo.models import SandboxCall
from runs.models import Run, Step
from tests.system.conftest import Approver
from tests.worker import wait_with_logs

LIST_ORDERS = "support_agent.turn2.1.list_orders"
SUPPORT = {
    "customer_id": "cus_1042",
    "message": "Refund ord_10421 please, 20 EUR",
    "order_id": "ord_10421",
    # The CRM answers the orders read, then the call blocks as if the worker died: it is killed there.
    "faults": {LIST_ORDERS: ["hang"]},
}


def database_digest() -> dict[str, str]:
    """Every table of the database, hashed row by row in a fixed order."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename")
        tables = [name for (name,) in cursor.fetchall()]
        digest = {}
        for table in tables:
            cursor.execute(f"SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) FROM \"{table}\" t")
            digest[table] = cursor.fetchone()[0]
    return digest


def test_a_run_with_a_killed_worker_replays_identically_calling_and_changing_nothing(system):
    response = system.agent.post("/api/runs", {"workflow": "support_agent", "input": SUPPORT})
    assert response.status == 202, response
    run_id = response.body["id"]
    wait_with_logs(
        lambda: SandboxCall.objects.filter(run_id=run_id, operation=LIST_ORDERS).exists(),
        "the orders read to hang",
        system.workers.all,
        60,
    )
    for worker in system.workers.alive:
        worker.kill(signal.SIGKILL)
        worker.wait(10)
    system.workers.start()
    approver = Approver(system.reviewer)
    approver.start()
    try:
        statuses = system.wait_for_runs([run_id], timeout=90)
    finally:
        approver.stopping.set()
        approver.join(10)
    run = Run.objects.get(pk=run_id)
    assert run.status == Run.Status.SUCCEEDED, (statuses, run.error, approver.errors)
    assert Step.objects.get(run_id=run_id, name=LIST_ORDERS).attempt == 2  # the killed attempt, then this one
    system.workers.stop_all()  # nothing else writes while the replay runs

    before, calls = database_digest(), SandboxCall.objects.count()
    replayed = subprocess.run(
        [sys.executable, "manage.py", "replay", run_id, "--json"],
        cwd=settings.BASE_DIR,
        env=system.workers.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    report = json.loads(replayed.stdout)
    assert report["identical"], report["summary"]
    assert len(report["steps"]) == Step.objects.filter(run_id=run_id).count() == 12
    assert report["calls"] == 0 and SandboxCall.objects.count() == calls
    assert database_digest() == before
