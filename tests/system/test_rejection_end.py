"""A person's rejection ends the run in the transaction that records it, with real worker processes.

Before, the engine checkpointed the rejected gate (the cursor moved on to the refused action) and ended the run
in a second transaction: if that second write failed (a database error, a crash between the two), the retried
job replayed the step after the gate, the very action the person refused. Here a real fault is injected into
the write that ends the run (a trigger that raises once), and the refusal must still pay nothing.
"""

from __future__ import annotations

import pytest
from django.db import connection

from demo.models import SandboxCall
from runs.models import Run
from tests.engine_helpers import REFUND
from tests.system.conftest import describe_runs
from tests.worker import settles_as, wait_with_logs

FAULT = "injected fault: the write that ends the run fails once"


@pytest.fixture
def end_of_run_fails_once():
    """A trigger that makes the first UPDATE taking a run from running to finished fail; returns the run-id
    setter. Dropped at the end (the test database outlives the test)."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE SEQUENCE test_fault_once")
        cursor.execute(
            "CREATE FUNCTION test_fault_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            f" IF nextval('test_fault_once') = 1 THEN RAISE EXCEPTION '{FAULT}'; END IF; RETURN NEW; END $$"
        )

    def arm(run_id: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE TRIGGER test_fault_once BEFORE UPDATE ON runs_run FOR EACH ROW"
                f" WHEN (NEW.id = '{run_id}'::uuid AND OLD.status = 'running'"
                " AND NEW.status IN ('succeeded', 'failed', 'cancelled'))"
                " EXECUTE FUNCTION test_fault_once()"
            )

    yield arm
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER IF EXISTS test_fault_once ON runs_run")
        cursor.execute("DROP FUNCTION IF EXISTS test_fault_once()")
        cursor.execute("DROP SEQUENCE IF EXISTS test_fault_once")


def test_a_rejection_whose_end_fails_once_pays_nothing(system, end_of_run_fails_once):
    run_id = system.submit(REFUND)
    end_of_run_fails_once(run_id)

    def card():
        response = system.reviewer.get("/api/approvals?status=pending")
        return [c for c in response.body if c["run_id"] == run_id]

    (pending,) = wait_with_logs(card, "the refund's card", system.workers.all, timeout=60)
    response = system.reviewer.post(
        f"/api/approvals/{pending['id']}/decision",
        {"decision": "reject", "comment": "already refunded by phone", "version": pending["version"]},
    )
    assert response.status == 200, response

    run = Run.objects.get(pk=run_id)
    settles_as(run, Run.Status.SUCCEEDED, system.workers.all, timeout=60)
    assert FAULT in system.workers.grep(FAULT), system.workers.logs()  # the fault did happen, once
    assert run.result["outcome"] == "rejected" and run.result["comment"] == "already refunded by phone"
    assert not SandboxCall.objects.filter(run_id=run_id, system__in=["payments", "email"]).exists(), describe_runs(
        [run_id]
    )
