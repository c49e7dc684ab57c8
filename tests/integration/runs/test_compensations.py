"""Undo (runs.compensations), driven in the test process as the worker's job drives it (engine.advance): what
starts an undo, the order and once-ness of compensations, the cards of gated and failed ones, the registry, and the
bad inputs refused with nothing done. With real workers and crashes: tests/system/test_compensations.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

import tests.workflows  # noqa: F401 - registers test_undo_chain, test_undo_at_the_end
from approvals.models import Approval
from core.models import AuditEntry, Channel
from demo.models import SandboxCall
from jobs.models import DeadLetter
from runs import compensations, submission
from runs.errors import TransitionRefused, UndoRefused
from runs.models import Receipt, Run
from runs.tools import tool
from runs.workflow import Compensation, Workflow
from tests.engine_helpers import REFUND, SMALL_REFUND, drive, support_parked_at_the_email

CHAIN = {"customer_id": "cus_7", "amount_cents": 700}


def _submit(workflow: str, run_input: dict) -> Run:
    return submission.submit(workflow=workflow, input=run_input)[0]


def _pending(run: Run, kind: str) -> Approval:
    return Approval.objects.get(run=run, kind=kind, status=Approval.Status.PENDING)


def _reversals(run: Run) -> list[SandboxCall]:
    return list(SandboxCall.objects.filter(run_id=run.id, system="payments", payload__has_key="reverses", applied=True))


def _compensation_entries(run: Run) -> list[dict]:
    return list(
        AuditEntry.objects.filter(run_id=run.id, action="run.compensation")
        .order_by("id")
        .values_list("data", flat=True)
    )


# --- declaring one ---------------------------------------------------------------------------------------------------


def test_a_compensation_is_declared_on_effects_only():
    wf = Workflow("test_declarations")
    undo = Compensation(call=lambda ctx, key, answer: {})
    for declare in (wf.read, wf.compute):
        with pytest.raises(ValueError, match="has no side effect to undo"):
            declare(compensate=undo)(lambda ctx: None)
    with pytest.raises(ValueError, match="has no side effect to undo"):
        wf.gate("payments", compensate=undo)
    with pytest.raises(ValueError, match="compensate= is for effects"):
        tool(kind="read", compensate=undo)(lambda ctx, x: x)
    with pytest.raises(ValueError, match="takes a Compensation or a function"):
        wf.effect("payments", compensate="reverse it")
    with pytest.raises(ValueError, match="undo must be"):
        Workflow("test_bad_policy", undo="sometimes")
    assert not wf.steps  # nothing was declared
    wf.effect("payments", compensate=lambda ctx, key, answer: {})(lambda ctx: None)
    assert wf.steps[0].compensation.call is not None and wf.steps[0].compensation.approval is False


# --- a failure for good ----------------------------------------------------------------------------------------------


def test_a_run_that_fails_for_good_after_two_effects_is_undone_in_reverse_order_once(demo):
    run = drive(_submit("test_undo_chain", {**CHAIN, "faults": {"confirm": ["fatal"]}}))
    assert run.status == Run.Status.COMPENSATED, run.error
    assert run.result["reason"] == "failed" and "Fatal" in run.result["cause"]["error"]
    assert [e["undo"] for e in run.result["effects"]] == ["done", "done"]
    undone = [e["step"] for e in _compensation_entries(run)]
    assert undone == ["note", "pay"]  # the latest completed first
    # Each compensation once, through its own receipt.
    assert Receipt.objects.filter(run=run, key__startswith="undo:", status="done").count() == 2
    assert len(_reversals(run)) == 1
    assert SandboxCall.objects.filter(run_id=run.id, system="crm", payload__has_key="removes").count() == 1
    # Dead-lettered too, with both histories.
    letter = DeadLetter.objects.get(run_id=run.id)
    assert (
        letter.error_class == "Fatal" and "Undone:" in letter.traceback and "pay on payments: done" in letter.traceback
    )
    assert AuditEntry.objects.filter(run_id=run.id, action="run.compensated").count() == 1
    # Driving it again does nothing more.
    drive(run)
    assert len(_reversals(run)) == 1


def test_the_policy_ask_opens_a_card_and_no_means_the_dead_letter_queue(demo):
    run = drive(_submit("refund", {**SMALL_REFUND, "faults": {"notify_customer": ["fatal"]}}))
    assert (run.status, run.undo_reason) == (Run.Status.WAITING_HUMAN, "failed")
    card = _pending(run, "undo")
    assert "failed for good at notify_customer" in card.summary
    card.decide(demo["reviewer"], "reject", comment="the customer keeps it")
    run = drive(run)
    assert run.status == Run.Status.FAILED and not _reversals(run)
    assert DeadLetter.objects.filter(run_id=run.id, error_class="Fatal").count() == 1


def test_the_policy_ask_then_a_gated_reversal_then_compensated(demo):
    run = drive(_submit("refund", {**SMALL_REFUND, "faults": {"notify_customer": ["fatal"]}}))
    _pending(run, "undo").decide(demo["reviewer"], "approve")
    run = drive(run)
    # The reversal is gated: a person confirms it on its own card, at the refund's step.
    reversal = _pending(run, "undo")
    assert run.status == Run.Status.WAITING_HUMAN and reversal.step_seq == 4 and "refund" in reversal.summary
    assert not _reversals(run)
    reversal.decide(demo["reviewer"], "approve")
    run = drive(run)
    assert run.status == Run.Status.COMPENSATED
    (reversed_call,) = _reversals(run)
    assert reversed_call.payload["amount_cents"] == -SMALL_REFUND["amount_cents"]
    (entry,) = [e for e in compensations.registry(run) if e.step == "issue_refund"]
    assert (entry.outcome, entry.undone_by) == ("done", "reviewer")
    assert DeadLetter.objects.filter(run_id=run.id).count() == 1


# --- reject and undo, cancel and undo --------------------------------------------------------------------------------


def _support_parked_at_the_email(demo) -> Run:
    return support_parked_at_the_email(demo)


def test_reject_and_undo_on_a_later_card_reverses_the_refund_once_after_a_persons_yes(demo):
    run = _support_parked_at_the_email(demo)
    assert Receipt.objects.filter(run=run, channel="payments", status="done").count() == 1
    email_card = Approval.objects.get(run=run, status=Approval.Status.PENDING)
    email_card.decide(demo["reviewer"], "reject", comment="wrong customer: undo it", undo=True)
    run = drive(run)
    assert (run.status, run.undo_reason) == (Run.Status.WAITING_HUMAN, "rejected")
    assert not _reversals(run)
    _pending(run, "undo").decide(demo["reviewer"], "approve")
    run = drive(run)
    assert run.status == Run.Status.COMPENSATED and len(_reversals(run)) == 1
    assert not SandboxCall.objects.filter(run_id=run.id, system="email").exists()  # the email never went
    drive(run)
    assert len(_reversals(run)) == 1


def test_cancel_and_undo_of_a_parked_run(demo):
    run = _support_parked_at_the_email(demo)
    compensations.cancel_and_undo(run, demo["ops"])
    run.refresh_from_db()
    assert (run.status, run.undo_reason) == (Run.Status.QUEUED, "cancelled")
    assert not Approval.objects.filter(run=run, kind="action", status=Approval.Status.PENDING).exists()
    run = drive(run)
    _pending(run, "undo").decide(demo["reviewer"], "approve")
    run = drive(run)
    assert run.status == Run.Status.COMPENSATED and len(_reversals(run)) == 1
    cancel = AuditEntry.objects.get(run_id=run.id, action="run.cancel")
    assert cancel.actor == "ops" and cancel.data["undo"] is True
    with pytest.raises(UndoRefused, match="finished"):
        compensations.cancel_and_undo(run, demo["ops"])


def test_a_cancel_and_undo_while_the_last_step_runs_is_an_undo_not_a_cancel(demo):
    run = drive(_submit("test_undo_at_the_end", CHAIN))
    assert (run.status, run.undo_reason) == (Run.Status.COMPENSATED, "cancelled"), run.result
    assert len(_reversals(run)) == 1


def test_a_plain_cancel_does_not_stop_an_undo_under_way(demo):
    run = _support_parked_at_the_email(demo)
    compensations.cancel_and_undo(run, demo["ops"])
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN and run.undo_reason == "cancelled"
    Run.objects.filter(pk=run.pk).update(status=Run.Status.COMPENSATING, owner="someone")
    with pytest.raises(TransitionRefused, match="being undone"):
        Run.objects.get(pk=run.pk).cancel(by=demo["ops"])


# --- bad input: nothing done -----------------------------------------------------------------------------------------


def test_undo_of_a_run_with_nothing_to_undo_is_refused_with_nothing_done(demo):
    run = drive(_submit("refund", REFUND))  # parked at its gate: nothing done yet
    card = _pending(run, "action")
    with pytest.raises(UndoRefused, match="nothing to undo"):
        compensations.cancel_and_undo(run, demo["ops"])
    with pytest.raises(UndoRefused, match="nothing to undo"):
        card.decide(demo["reviewer"], "reject", comment="no", undo=True)
    run.refresh_from_db()
    card.refresh_from_db()
    assert (run.status, run.undo_reason, card.status) == (Run.Status.WAITING_HUMAN, "", Approval.Status.PENDING)
    assert not AuditEntry.objects.filter(run_id=run.id, action__in=["run.cancel", "approval.reject"]).exists()


def test_undo_past_a_compensations_deadline_is_refused_with_nothing_done(demo):
    run = _support_parked_at_the_email(demo)
    Receipt.objects.filter(run=run, channel="payments").update(completed_at=timezone.now() - timedelta(days=31))
    with pytest.raises(UndoRefused, match="past its deadline"):
        compensations.cancel_and_undo(run, demo["ops"])
    run.refresh_from_db()
    assert (run.status, run.undo_reason) == (Run.Status.WAITING_HUMAN, "")
    (entry,) = [e.as_dict() for e in compensations.registry(run) if e.channel == "payments"]
    assert entry["can_undo"] is False and "deadline" in entry["why_not"]


def test_only_a_rejection_can_undo(demo):
    from approvals.errors import InvalidDecision  # noqa: PLC0415

    run = _support_parked_at_the_email(demo)
    with pytest.raises(InvalidDecision, match="only a rejection"):
        Approval.objects.get(run=run, status=Approval.Status.PENDING).decide(demo["reviewer"], "approve", undo=True)


# --- a compensation that fails for good ------------------------------------------------------------------------------


def test_a_compensation_that_fails_for_good_parks_with_a_card_then_a_person_does_it_by_hand(demo):
    faults = {"confirm": ["fatal"], "undo:pay": ["fatal"]}
    run = drive(_submit("test_undo_chain", {**CHAIN, "faults": faults}))
    assert run.status == Run.Status.COMPENSATION_FAILED and "404" not in run.error and "Fatal" in run.error
    card = _pending(run, "undo_failed")
    assert "failed for good" in card.summary and card.step_seq == 0
    # The note was undone first; the payment's reversal failed: nothing lost, nothing silent.
    assert [e["outcome"] for e in _compensation_entries(run)] == ["done", "failed"]
    card.decide(demo["reviewer"], "reject", comment="reversed by phone with the bank")
    run = drive(run)
    assert run.status == Run.Status.COMPENSATED
    assert [e["undo"] for e in run.result["effects"]] == ["by_hand", "done"]
    assert not _reversals(run)


def test_a_failed_compensation_is_tried_again_when_a_person_says_so(demo):
    faults = {"confirm": ["fatal"], "undo:pay": ["fatal"]}
    run = drive(_submit("test_undo_chain", {**CHAIN, "faults": faults}))
    _pending(run, "undo_failed").decide(demo["reviewer"], "approve")
    run = drive(run)
    assert run.status == Run.Status.COMPENSATED and len(_reversals(run)) == 1


# --- kill switches and the registry ----------------------------------------------------------------------------------


def test_a_kill_switch_pauses_an_undo_and_its_release_resumes_it(demo):
    run = drive(_submit("refund", {**SMALL_REFUND, "faults": {"notify_customer": ["fatal"]}}))
    _pending(run, "undo").decide(demo["reviewer"], "approve")
    run = drive(run)
    _pending(run, "undo").decide(demo["reviewer"], "approve")
    payments = Channel.objects.get(name="payments")
    payments.engage_kill_switch(demo["ops"], "incident on payments")
    run = drive(run)
    assert (run.status, run.paused_switch, run.undo_reason) == (Run.Status.PAUSED, "payments", "failed")
    assert not _reversals(run)
    payments.release_kill_switch(demo["ops"], "fixed")
    run = drive(Run.objects.get(pk=run.pk))
    assert run.status == Run.Status.COMPENSATED and len(_reversals(run)) == 1


def test_the_registry_says_what_can_be_undone_until_when_and_what_cannot(demo):
    run = _support_parked_at_the_email(demo)
    entries = [e.as_dict() for e in compensations.registry(run)]
    (refund,) = [e for e in entries if e["channel"] == "payments"]
    assert refund["can_undo"] is True and refund["needs_approval"] is True and refund["compensation"] is None
    assert refund["undo_until"] > timezone.now() + timedelta(days=29)


def test_stop_and_undo_on_a_budget_card(demo):
    run = _support_parked_at_the_email(demo)
    Run.objects.filter(pk=run.pk).update(cost_limit=run.cost)  # spent: the next step asks for more
    Approval.objects.get(run=run, status=Approval.Status.PENDING).decide(demo["reviewer"], "approve")
    run = drive(run)
    budget = _pending(run, "budget")
    assert run.status == Run.Status.PAUSED
    budget.decide(demo["reviewer"], "reject", comment="too expensive: undo it", undo=True)
    run = drive(run)
    assert run.undo_reason == "budget"
    _pending(run, "undo").decide(demo["reviewer"], "approve")
    run = drive(run)
    assert run.status == Run.Status.COMPENSATED and len(_reversals(run)) == 1
    assert run.result["cause"]["outcome"] == "stopped at cost limit"


# --- defects found in review, each seen failing on the code before its fix ------------------------------------------


def _drive_until_parked_or_ended(run: Run, tries: int = 12) -> Run:
    """Drive as the job and its retries would (a retried attempt raises, as it does in the worker)."""
    for _ in range(tries):
        try:
            run = drive(run)
        except Exception:  # noqa: BLE001 - a retry: the job's strategy would run it again
            run.refresh_from_db()
        if run.status not in (Run.Status.QUEUED, Run.Status.RUNNING, Run.Status.COMPENSATING):
            return run
    return run


def test_an_ambiguous_compensation_without_a_lookup_is_reconciled_on_a_card_at_its_effects_step(demo):
    faults = {"confirm": ["fatal"], "undo:pay": ["timeout"]}  # reversed, then the answer is lost
    run = _drive_until_parked_or_ended(_submit("test_undo_without_lookup", {**CHAIN, "faults": faults}))
    card = _pending(run, "reconcile")
    assert (
        run.status == Run.Status.WAITING_HUMAN and card.step_seq == 0 and card.proposed["receipt"].startswith("undo:")
    )
    card.decide(demo["reviewer"], "approve")  # it happened
    run = drive(run)
    assert run.status == Run.Status.COMPENSATED and len(_reversals(run)) == 1


def test_a_failed_step_that_used_up_its_attempts_leaves_the_compensations_their_own(demo):
    # `confirm` fails three times (5xx) and so for good; the first compensation's first 5xx is retried, not fatal.
    faults = {"confirm": ["5xx"] * 10, "undo:note": ["5xx"]}
    run = _drive_until_parked_or_ended(_submit("test_undo_chain", {**CHAIN, "faults": faults}))
    assert run.status == Run.Status.COMPENSATED, run.error
    assert [e["undo"] for e in run.result["effects"]] == ["done", "done"]


def test_a_parked_undo_is_not_cancelled(demo):
    run = _support_parked_at_the_email(demo)
    compensations.cancel_and_undo(run, demo["ops"])
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN and run.undo_reason == "cancelled"  # the reversal's card
    with pytest.raises(TransitionRefused, match="being undone"):
        run.cancel(by=demo["ops"])
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_HUMAN and _pending(run, "undo")
