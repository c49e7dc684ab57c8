"""Personal data by reference (docs/personal-data.md), as the product runs it: the production web server, real
workers, cards decided over the API. A `refund` that needs a person and a `support_agent` run go to their cards and
finish; then every table of the database, row by row as text, holds none of the customers' names or emails (as the
demo's CRM makes them, demo.sandbox.customer_record), and neither do the workers' or the web server's logs. The
vault holds them as ciphertext (bytes: never a match). One table is left out: the demo's sandbox (SandboxCall),
which stands for the external systems (the email provider that must receive the address in clear; erasure does not
reach what they received).

Then a subject with a run parked at its card is erased (`manage.py erase_subject`, a process of its own): that run
ends cancelled with the reason, its card closes, and the audit chain still verifies (`manage.py audit_verify`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.conf import settings
from django.db import connection

from approvals.models import Approval
from core import pii
from core.models import AuditEntry, PiiValue
from demo.models import SandboxCall
from demo.sandbox import customer_record
from runs.models import Run
from tests.system.conftest import Approver

pytestmark = pytest.mark.slow

# The external systems' own record (the fake email provider, CRM, payment system): they receive clear values.
EXTERNAL_SYSTEMS = {SandboxCall._meta.db_table}

REFUND = {"customer_id": "cus_pd7731", "amount_cents": 12_500, "currency": "EUR", "reason": "Item arrived damaged"}
SUPPORT = {"customer_id": "cus_pd5310", "message": "My order arrived broken, please refund it.", "order_id": None}
PARKED = {**REFUND, "customer_id": "cus_pd2468"}


def personal_values(*customers: str) -> list[str]:
    return [customer_record(c)[field] for c in customers for field in ("name", "email")]


def clear_values_in_tables(needles: list[str]) -> dict[str, list[str]]:
    """Each table (but the external systems') whose rows, as JSON text, contain one of `needles`: which ones."""
    found: dict[str, list[str]] = {}
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename")
        tables = [name for (name,) in cursor.fetchall()]
        assert "core_piivalue" in tables and "runs_run" in tables
        for table in tables:
            if table in EXTERNAL_SYSTEMS:
                continue
            cursor.execute(f"SELECT coalesce(string_agg(row_to_json(t)::text, E'\\n'), '') FROM \"{table}\" t")  # noqa: S608
            (text,) = cursor.fetchone()
            if hits := [needle for needle in needles if needle in text]:
                found[table] = hits
    return found


def manage(system, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=settings.BASE_DIR,
        env=system.workers.env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_no_clear_personal_value_anywhere_and_erasure_cancels_the_parked_run(system):
    approver = Approver(system.reviewer)
    approver.start()
    try:
        ids = []
        for workflow, run_input in (("refund", REFUND), ("support_agent", SUPPORT)):
            response = system.agent.post("/api/runs", {"workflow": workflow, "input": run_input})
            assert response.status == 202, response
            ids.append(response.body["id"])
        statuses = system.wait_for_runs(ids, timeout=120)
    finally:
        approver.stop()
    runs = {run.workflow: run for run in Run.objects.filter(pk__in=ids)}
    assert all(run.status == Run.Status.SUCCEEDED for run in runs.values()), (statuses, system.workers.logs())
    assert not approver.errors, approver.errors
    assert approver.decided[("action", "approve")] >= 2  # the refund's card, the support agent's email (at least)
    # The email provider got the customer's address in clear: the effects opened the references (ctx.pii).
    sent = [call.payload["to"] for call in _sandbox("email")]
    assert sorted(sent) == sorted(
        [customer_record(REFUND["customer_id"])["email"], customer_record(SUPPORT["customer_id"])["email"]]
    )

    response = system.agent.post("/api/runs", {"workflow": "refund", "input": PARKED})
    assert response.status == 202, response
    parked_id = response.body["id"]
    system.wait_for_runs([parked_id], timeout=60, until={Run.Status.WAITING_HUMAN})
    card = Approval.objects.get(run_id=parked_id, status=Approval.Status.PENDING)
    assert pii.is_ref(card.proposed["email"]["to"]) and pii.refs_in(card.proposed["email"]["body"])
    assert PiiValue.objects.filter(run_id=parked_id).count() == 2

    needles = personal_values(REFUND["customer_id"], SUPPORT["customer_id"], PARKED["customer_id"])
    assert clear_values_in_tables(needles) == {}
    for log in [*(worker.log() for worker in system.workers.all), system.server.log_path.read_text()]:
        assert not [needle for needle in needles if needle in log]

    erased = manage(system, "erase_subject", PARKED["customer_id"], "--reason", "erasure request 42")
    assert erased.returncode == 0, erased.stderr[-3000:]
    assert f"1 run(s) in flight cancelled: {parked_id}" in erased.stdout
    run = Run.objects.get(pk=parked_id)
    card.refresh_from_db()
    assert run.status == Run.Status.CANCELLED and "erasure request 42" in run.result["reason"]
    assert card.status == Approval.Status.CANCELLED
    assert pii.present(card.proposed["email"]["to"]) == pii.ERASED
    with pytest.raises(pii.Erased):
        pii.reveal(card.proposed["email"]["to"])
    assert AuditEntry.objects.filter(action="pii.erase", data__subject=PARKED["customer_id"]).count() == 1
    verified = manage(system, "audit_verify")
    assert verified.returncode == 0 and "audit log intact" in verified.stdout, verified.stderr[-3000:]
    # The other customers' values still open.
    done = Run.objects.get(pk=runs["refund"].pk)
    assert (
        pii.reveal(done.steps.get(name="lookup_customer").output["email"])
        == customer_record(REFUND["customer_id"])["email"]
    )
    assert clear_values_in_tables(needles) == {}


def _sandbox(system: str) -> list:
    return list(SandboxCall.objects.filter(system=system, applied=True).exclude(idempotency_key=""))
