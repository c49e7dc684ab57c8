"""A fork (runs.forks) with the production web server and real worker processes: a refund paid to its end, forked
from its gate through the API, the fork's new card approved: the fork finishes, and the payment system received one
payment (the original's receipt, shared by key), no duplicate. The engine-level cases: tests/integration/runs/
test_forks.py."""

from __future__ import annotations

from demo.models import SandboxCall
from runs.models import Run
from tests.engine_helpers import REFUND
from tests.system.conftest import sandbox_stats
from tests.worker import wait_with_logs

GATE = 3  # refund's approve_refund


def _settled(system, run_id: str, statuses, timeout: float = 30) -> Run:
    wait_with_logs(
        lambda: Run.objects.filter(pk=run_id, status__in=list(statuses)).exists(),
        f"run {run_id} to be {'/'.join(statuses)}",
        system.workers.all,
        timeout,
    )
    return Run.objects.get(pk=run_id)


def _approve_the_card_of(system, run_id: str) -> None:
    run = _settled(system, run_id, [Run.Status.WAITING_HUMAN])
    card_id = run.approvals.get(status="pending").pk
    card = system.reviewer.get(f"/api/approvals/{card_id}").body
    response = system.reviewer.post(
        f"/api/approvals/{card_id}/decision", {"decision": "approve", "version": card["version"]}
    )
    assert response.status == 200, response


def test_a_fork_from_the_gate_after_the_payment_pays_nothing_again(system):
    response = system.agent.post("/api/runs", {"workflow": "refund", "input": REFUND})
    assert response.status == 202, f"{response}\n{system.server.errors()}"
    original = response.body["id"]
    _approve_the_card_of(system, original)
    assert _settled(system, original, [Run.Status.SUCCEEDED, Run.Status.FAILED]).status == Run.Status.SUCCEEDED

    response = system.ops.post(f"/api/runs/{original}/fork", {"from_step": GATE, "reason": "policy changed"})

    assert response.status == 201, f"{response}\n{system.server.errors()}"
    fork = response.body["id"]
    assert response.body["fork_of"] == original and response.body["fork_from_step"] == GATE
    _approve_the_card_of(system, fork)  # a new card: the fork's own
    run = _settled(system, fork, [Run.Status.SUCCEEDED, Run.Status.FAILED])
    assert run.status == Run.Status.SUCCEEDED, run.error
    stats = sandbox_stats()
    assert stats["duplicates"] == 0, stats
    assert SandboxCall.objects.filter(system="payments", applied=True).count() == 1
    assert stats["channels"]["email"] == 1
