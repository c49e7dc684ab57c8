"""Undo of an external agent's run (issue 27, item 4) against the production web server and real workers: (e) a
cancel and undo of an external run asks its agent for the compensation its refund declared; a person approves it
on its card; the agent's client (`run_compensations`) runs it once, however often it looks again, and the run ends
compensated. The cancel and undo is taken in-process (runs.compensations.cancel_and_undo, on the server's
database), as the run page's and the API's will take it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from django.contrib.auth.models import User
from hitl_client import AlreadyConsumed, Client, require_approval, run_compensations

from core.models import AuditEntry
from external.models import ActionRequest
from runs import compensations
from runs.models import Run
from tests.system.refunds import decide
from tests.system.test_client_live import pending_card

pytestmark = pytest.mark.slow

CALL_TIMEOUT = 30


def test_cancel_and_undo_the_agents_client_runs_the_compensation_once(system):
    refunds: list[str] = []
    voided: list[str] = []
    with Client(system.url, system.agent.token, timeout=10) as client, ThreadPoolExecutor(max_workers=1) as pool:

        @require_approval(
            client,
            channel="payments",
            rationale="The parcel never arrived.",
            compensate=lambda result, **_: {"action": "void_refund", "arguments": {"refund_id": result["refund_id"]}},
        )
        def refund(order_id: str, amount_cents: int) -> dict:
            refunds.append(order_id)
            return {"refund_id": f"re_{order_id}", "amount_cents": amount_cents}

        def void_refund(refund_id: str) -> dict:
            voided.append(refund_id)
            return {"voided": refund_id}

        call = pool.submit(refund, "ord_9", 4_200)
        decide(system, pending_card(system, call), "approve", comment="ok")
        assert call.result(CALL_TIMEOUT) == {"refund_id": "re_ord_9", "amount_cents": 4_200}
        (executed,) = ActionRequest.objects.all()
        assert executed.compensation == {"action": "void_refund", "arguments": {"refund_id": "re_ord_9"}}

        run = compensations.cancel_and_undo(executed.run, User.objects.get(username="ops"))
        assert run.status == "compensating"
        # The compensation is a card in the inbox like any other: nothing runs before a person approves it.
        assert run_compensations(client, {"void_refund": void_refund}) == {}
        card = pending_card(system)
        assert card["proposed"] == {"refund_id": "re_ord_9"} and card["run_id"] == str(run.id)
        decide(system, card, "approve", comment="void it")

        (pending,) = client.pending_compensations(str(run.id))
        assert pending.compensates == str(executed.id) and pending.undo_order == 0
        outcomes = run_compensations(client, {"void_refund": void_refund})
        assert [o.value for o in outcomes.values()] == [{"voided": "re_ord_9"}]
        # Looking again runs nothing, and the go is given once.
        assert run_compensations(client, {"void_refund": void_refund}) == {}
        with pytest.raises(AlreadyConsumed):
            client.consume(pending.id, pending.arguments_digest or "")

    assert voided == ["re_ord_9"] and refunds == ["ord_9"]
    run = Run.objects.get(pk=run.pk)
    assert run.status == "compensated" and run.result["effects"][0]["undo"] == "done"
    response = system.ops.get(f"/api/runs/{run.id}")
    assert response.status == 200 and response.body["status"] == "compensated", response
    outcomes = AuditEntry.objects.filter(run_id=run.id, action="run.compensation").values_list("data", flat=True)
    assert [(d["outcome"], d["by"]) for d in outcomes] == [("done", "reviewer")]
    assert AuditEntry.objects.filter(run_id=run.id, action="run.compensated").count() == 1
