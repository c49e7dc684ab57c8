"""Crash safety with real worker processes: a worker SIGKILLed in the middle of a step.

The injected `hang` fault (demo.sandbox) applies the call, then blocks: the test kills the worker there, at
the worst moment (work done, checkpoint or receipt not yet written). A new worker must pick the run up
through the stalled-job sweep and finish it from its last checkpoint: done steps are not executed again,
and no side effect reaches a fake system twice."""

from __future__ import annotations

import signal
import time

import pytest
from django.core.management import call_command

from approvals.models import Approval
from demo import sandbox
from demo.models import SandboxCall
from jobs.models import DeadLetter
from runs import submission
from runs.models import Receipt, Run, Step
from tests.conftest import approves_every_channel
from tests.engine_helpers import REFUND, SMALL_REFUND, model_calls
from tests.worker import settles_as, wait_with_logs, worker_logs

STEPS = ["classify", "lookup_customer", "draft_refund", "approve_refund", "issue_refund", "notify_customer"]


@pytest.fixture
def demo(transactional_db):
    call_command("demo_setup", verbosity=0)


@pytest.fixture
def bob(bob, demo):
    """The reviewer, with approve_channel on every channel of these tests (Approval.decide checks it)."""
    return approves_every_channel(bob)


def _status(run: Run) -> str:
    return Run.objects.values_list("status", flat=True).get(pk=run.pk)


def _calls(run: Run, system: str, operation: str | None = None) -> int:
    calls = SandboxCall.objects.filter(run_id=run.id, system=system)
    return calls.filter(operation=operation).count() if operation else calls.count()


def _kill_while_blocked(start_worker, run_input: dict, system: str, operation: str):
    """Start a worker, wait until `operation` has reached `system` (the call is applied and now blocks),
    SIGKILL the worker there. Returns the run and the dead worker."""
    worker = start_worker()
    run, _ = submission.submit(workflow="refund", input=run_input)
    wait_with_logs(lambda: _calls(run, system, operation) == 1, f"{system}.{operation} to be called", [worker])
    time.sleep(0.2)  # well inside the 120 s hang: the worker is blocked in the call
    assert worker.proc.poll() is None, worker_logs([worker])
    worker.kill(signal.SIGKILL)
    assert worker.wait(10) == -signal.SIGKILL
    # What the crash left behind: a run still marked running, at the step it never finished (nothing is written
    # when a step starts: its one write is its checkpoint).
    run.refresh_from_db()
    assert run.status == Run.Status.RUNNING and run.cursor == STEPS.index(operation)
    assert not Step.objects.filter(run=run, name=operation).exists()
    return run, worker


def _assert_steps(run: Run, **attempts: int) -> None:
    """Every step is done, and was attempted once, except those named (the one the worker died in is started
    again; a step that parked resumes once decided, which is not another attempt)."""
    steps = list(Step.objects.filter(run=run).order_by("seq").values_list("name", "status", "attempt"))
    assert steps == [(name, "done", attempts.get(name, 1)) for name in STEPS]


def test_a_worker_killed_mid_step_resumes_from_its_checkpoint(demo, start_worker):
    run_input = {**SMALL_REFUND, "faults": {"draft_refund": ["hang"]}}
    run, dead = _kill_while_blocked(start_worker, run_input, "model", "draft_refund")
    assert run.cursor == 2  # classify and lookup_customer are checkpointed
    assert sandbox.stats() == {"channels": {"payments": 0, "email": 0, "crm": 1}, "duplicates": 0}

    second = start_worker()
    settles_as(run, Run.Status.SUCCEEDED, [dead, second])

    run.refresh_from_db()
    assert run.result["status"] == "sent" and not run.error
    # Done steps were replayed from their checkpoints, not executed again: one model call for classify,
    # one CRM read; the step the worker died in was computed again (the crash lost its answer).
    assert model_calls(run, "classify") == 1
    assert model_calls(run, "draft_refund") == 2
    _assert_steps(run, draft_refund=2)
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}
    assert not DeadLetter.objects.exists()


def test_a_worker_killed_mid_step_before_a_gate_resumes_and_parks_once(demo, start_worker, bob):
    run_input = {**REFUND, "faults": {"draft_refund": ["hang"]}}
    run, dead = _kill_while_blocked(start_worker, run_input, "model", "draft_refund")

    second = start_worker()
    settles_as(run, Run.Status.WAITING_HUMAN, [dead, second])
    card = Approval.objects.get(run=run)
    assert card.kind == "action" and card.status == "pending" and card.proposed["refund"]["amount_cents"] == 12_500
    card.decide(bob, "approve")
    settles_as(run, Run.Status.SUCCEEDED, [dead, second])

    assert model_calls(run, "classify") == 1 and model_calls(run, "draft_refund") == 2
    assert Approval.objects.filter(run=run).count() == 1
    _assert_steps(run, draft_refund=2)  # resuming the gate after its decision is not another attempt
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}


def test_a_payment_cut_off_before_its_receipt_is_reconciled_not_repeated(demo, start_worker):
    run_input = {**SMALL_REFUND, "faults": {"issue_refund": ["hang"]}}
    run, dead = _kill_while_blocked(start_worker, run_input, "payments", "issue_refund")
    # The ambiguous write: the payment system has the refund, the receipt does not know it.
    receipt = Receipt.objects.get(run=run, channel="payments")
    assert receipt.status == Receipt.Status.PENDING and not receipt.external_id

    second = start_worker()
    settles_as(run, Run.Status.SUCCEEDED, [dead, second])

    (payment,) = SandboxCall.objects.filter(run_id=run.id, system="payments")
    receipt.refresh_from_db()
    assert receipt.status == Receipt.Status.DONE and receipt.reconciled
    assert receipt.key == payment.idempotency_key == f"{run.id}:4:issue_refund"
    assert receipt.external_id == payment.external_id
    assert Step.objects.get(run=run, name="issue_refund").output["id"] == payment.external_id
    _assert_steps(run, issue_refund=2)
    assert model_calls(run) == 2
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}
    assert not Approval.objects.filter(run=run).exists()


def test_an_email_cut_off_before_its_receipt_parks_for_a_person(demo, start_worker, bob):
    run_input = {**SMALL_REFUND, "faults": {"notify_customer": ["hang"]}}
    run, dead = _kill_while_blocked(start_worker, run_input, "email", "notify_customer")

    second = start_worker()
    settles_as(run, Run.Status.WAITING_HUMAN, [dead, second])
    card = Approval.objects.get(run=run)
    assert card.kind == "reconcile" and card.status == "pending" and card.channel.name == "email"
    assert card.step_seq == 5 and card.proposed["receipt"] == f"{run.id}:5:notify_customer"
    # The email system cannot be asked, so nothing is sent again while a person decides.
    time.sleep(1)
    assert _status(run) == Run.Status.WAITING_HUMAN
    assert _calls(run, "email") == 1
    assert Receipt.objects.get(run=run, channel="email").status == Receipt.Status.PENDING
    assert sandbox.stats()["duplicates"] == 0

    card.decide(bob, "approve", comment="the customer has it")
    settles_as(run, Run.Status.SUCCEEDED, [dead, second])

    receipt = Receipt.objects.get(run=run, channel="email")
    assert receipt.status == Receipt.Status.DONE and receipt.reconciled
    assert receipt.response["reconciled_by"] == "bob"
    assert Approval.objects.filter(run=run).count() == 1
    _assert_steps(run, notify_customer=2)  # killed, then parked and reconciled (a park is not an attempt)
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}
