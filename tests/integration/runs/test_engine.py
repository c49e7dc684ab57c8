from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from procrastinate.contrib.django.models import ProcrastinateJob

import tests.workflows  # noqa: F401 - registers the test workflows
from approvals.errors import AlreadyDecided, InvalidDecision, StaleVersion
from approvals.models import Approval, Decision
from core.models import Channel
from demo import sandbox
from demo.models import SandboxCall
from jobs.models import DeadLetter
from runs import ownership, submission
from runs.errors import IdempotencyConflict
from runs.models import Receipt, Run, Step
from runs.workflow import Ambiguous, InvalidInput, Retryable, Workflow, register
from tests.conftest import approves_every_channel
from tests.engine_helpers import REFUND, SMALL_REFUND, drive, model_calls, queued_jobs


@pytest.fixture
def bob(bob, demo):
    """The reviewer, with approve_channel on every channel of these tests (Approval.decide checks it)."""
    return approves_every_channel(bob)


def test_a_refund_parks_for_approval_then_pays_once(demo, bob):
    run, created = submission.submit(workflow="refund", input=REFUND)
    assert created and run.status == Run.Status.QUEUED and queued_jobs(run) == 1
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN
    card = Approval.objects.get(run=run)
    assert card.status == "pending" and card.proposed["refund"]["amount_cents"] == 12_500
    assert sandbox.stats()["channels"]["payments"] == 0

    card.decide(bob, "approve")
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}
    assert list(run.steps.values_list("status", flat=True)) == ["done"] * 6
    assert model_calls(run) == 2


def test_a_small_refund_is_approved_by_itself(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert not Approval.objects.exists()


def _with_faults(faults: dict, base=REFUND) -> dict:
    return {**base, "faults": faults}


def test_an_edit_is_what_executes(demo, bob):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    card = Approval.objects.get(run=run)
    edited = {**card.proposed, "refund": {**card.proposed["refund"], "amount_cents": 4_000}}
    card.decide(bob, "edit", payload=edited)
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    (payment,) = SandboxCall.objects.filter(system="payments")
    assert payment.payload["amount_cents"] == 4_000


def test_a_reject_pays_nothing_and_keeps_the_comment(demo, bob):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    Approval.objects.get(run=run).decide(bob, "reject", comment="Customer already refunded", reason="duplicate")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert run.result["outcome"] == "rejected" and run.result["comment"] == "Customer already refunded"
    assert sandbox.stats()["channels"] == {"payments": 0, "email": 0, "crm": 1}
    assert Decision.objects.get().comment == "Customer already refunded"


def test_a_rejection_ends_the_run_in_the_transaction_that_records_it(demo, bob):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    Approval.objects.get(run=run).decide(bob, "reject", comment="Customer already refunded")
    with CaptureQueriesContext(connection) as queries:
        run = drive(run)
    assert (run.status, run.cursor, run.result["outcome"]) == (Run.Status.SUCCEEDED, 4, "rejected")
    # The gate's checkpoint is the run's finish: one statement, no finish of its own after it.
    assert not any(q["sql"].lstrip().startswith("WITH done AS") for q in queries.captured_queries)
    assert sandbox.stats()["channels"]["payments"] == 0


def test_a_run_left_past_a_rejected_gate_ends_there_and_never_does_what_was_refused(demo, bob):
    """What an engine that ended a rejection in a second transaction could leave behind when that second write
    failed: the gate's rejection checkpointed, the cursor on the refused action, the run queued for a retry."""
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    card = Approval.objects.get(run=run)
    card.decide(bob, "reject", comment="not this customer")
    decision = {"decision": "rejected", "payload": None, "comment": "not this customer", "reason": "", "by": "bob"}
    Step.objects.filter(run=run, seq=3).update(output=decision, status="done", ended_at=timezone.now())
    Run.objects.filter(pk=run.pk).update(cursor=4)
    run = drive(run)
    assert (run.status, run.result["outcome"], run.result["comment"]) == ("succeeded", "rejected", "not this customer")
    assert sandbox.stats()["channels"] == {"payments": 0, "email": 0, "crm": 1}


def test_a_rejection_in_a_workflow_that_fails_on_reject_goes_to_the_dead_letter_queue_with_its_gate(demo, bob):
    run = drive(submission.submit(workflow="test_reject_fails", input={})[0])
    Approval.objects.get(run=run).decide(bob, "reject", comment="no")
    run = drive(run)
    assert run.status == Run.Status.FAILED and run.error == "Fatal: rejected at ask: no"
    assert DeadLetter.objects.get(run_id=run.id).step == "ask"
    assert Step.objects.get(run=run, name="ask").status == "done"


@pytest.mark.parametrize("comment", ["", "   "])
def test_a_reject_without_a_comment_changes_nothing(demo, bob, comment):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    card = Approval.objects.get(run=run)
    with pytest.raises(InvalidDecision, match="needs a comment"):
        card.decide(bob, "reject", comment=comment)
    card.refresh_from_db()
    run.refresh_from_db()
    assert card.status == "pending" and card.version == 1
    assert run.status == Run.Status.WAITING_HUMAN
    assert not Decision.objects.exists()


def test_a_second_decision_is_refused(demo, bob, alice):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    card = Approval.objects.get(run=run)
    card.decide(bob, "approve", version=1)
    with pytest.raises(AlreadyDecided, match="already approved by bob"):
        card.decide(alice, "reject", comment="no", version=1)
    assert Decision.objects.count() == 1


def test_a_stale_version_is_refused(demo, bob):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    card = Approval.objects.get(run=run)
    with pytest.raises(StaleVersion):
        card.decide(bob, "approve", version=7)
    card.refresh_from_db()
    assert card.status == "pending"


def test_done_steps_are_replayed_not_recomputed(demo, bob):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    assert model_calls(run) == 2
    Approval.objects.get(run=run).decide(bob, "approve")
    drive(run)
    assert model_calls(run, "classify") == 1 and model_calls(run, "draft_refund") == 1


def test_a_retryable_fault_is_retried_then_succeeds(demo):
    run, _ = submission.submit(workflow="refund", input=_with_faults({"classify": ["429", "5xx"]}, SMALL_REFUND))
    with pytest.raises(Retryable):
        drive(run, attempts=0)
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED and "429" in run.error
    with pytest.raises(Retryable):
        drive(run, attempts=1)
    run = drive(run, attempts=2)
    assert run.status == Run.Status.SUCCEEDED
    assert Step.objects.get(run=run, name="classify").attempt == 3
    assert model_calls(run, "classify") == 3


def test_a_fault_that_keeps_coming_ends_in_the_dead_letter_queue(demo):
    run, _ = submission.submit(workflow="refund", input=_with_faults({"classify": ["429"] * 5}, SMALL_REFUND))
    for attempt in range(2):
        with pytest.raises(Retryable):
            drive(run, attempts=attempt)
    run = drive(run, attempts=2)  # the third and last attempt
    assert run.status == Run.Status.FAILED
    letter = DeadLetter.objects.get(run_id=run.id)
    assert letter.attempts == 3 and letter.step == "classify" and "429" in letter.error


def test_a_fatal_fault_is_not_retried_and_is_dead_lettered(demo):
    run, _ = submission.submit(workflow="refund", input=_with_faults({"classify": ["fatal"]}, SMALL_REFUND))
    run = drive(run)  # no exception: nothing for the job to retry
    assert run.status == Run.Status.FAILED and run.finished_at is not None
    letter = DeadLetter.objects.get(run_id=run.id)
    assert letter.error_class == "Fatal" and "400 Bad Request" in letter.error
    assert "Traceback" in letter.traceback and "refuse_or_delay" in letter.traceback
    assert letter.input == run.input and letter.trace_id == run.trace_id and letter.step == "classify"
    assert model_calls(run, "classify") == 1


def test_an_unclassified_error_is_retried(db):
    run, _ = submission.submit(workflow="test_flaky", input={})
    with pytest.raises(ValueError):
        drive(run, attempts=0)
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED and not DeadLetter.objects.exists()


def test_bad_input_is_refused_before_the_run_exists(demo):
    with pytest.raises(InvalidInput) as refused:
        submission.submit(workflow="refund", input={"customer_id": "c1"})
    assert {e["loc"] for e in refused.value.errors} == {"input.amount_cents", "input.currency", "input.reason"}
    assert not Run.objects.exists() and not ProcrastinateJob.objects.exists()


def test_cancel_ends_a_parked_run_and_closes_its_card(demo):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    run.cancel()
    run.refresh_from_db()
    assert run.status == Run.Status.CANCELLED
    assert Approval.objects.get(run=run).status == "cancelled"
    assert drive(run).status == Run.Status.CANCELLED  # a job that still comes does nothing
    assert sandbox.stats()["channels"]["payments"] == 0


def test_cancel_stops_a_running_run_between_steps(db):
    run = drive(submission.submit(workflow="test_cancel_midway", input={})[0])
    assert run.status == Run.Status.CANCELLED
    assert list(run.steps.values_list("name", "status")) == [("first", "done")]


def test_a_run_pinned_to_an_undeployed_version_is_refused_and_kept(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    Run.objects.filter(pk=run.pk).update(workflow_version=99)
    run = drive(run)
    assert run.status == Run.Status.FAILED
    assert "has no version 99" in run.error and run.input == SMALL_REFUND
    assert DeadLetter.objects.get(run_id=run.id).error_class == "UnknownWorkflow"


def test_a_changed_input_on_resume_is_an_error(demo):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    Step.objects.filter(run=run, name="approve_refund").update(status="running")
    Run.objects.filter(pk=run.pk).update(status="queued", input={**REFUND, "amount_cents": 99_999})
    run = drive(run)
    assert run.status == Run.Status.FAILED
    assert "changed since it was checkpointed" in run.error


def test_a_rejection_can_fail_the_run_when_the_workflow_says_so(demo, bob):
    run = drive(submission.submit(workflow="test_reject_fails", input={})[0])
    Approval.objects.get(run=run).decide(bob, "reject", comment="no")
    assert drive(run).status == Run.Status.FAILED


def test_crossing_the_cost_limit_parks_for_a_budget_decision(demo, bob):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND, cost_limit=Decimal("0.000001"))
    run = drive(run)
    assert run.status == Run.Status.PAUSED and "cost limit" in run.pause_reason
    card = Approval.objects.get(run=run, kind="budget")
    assert list(run.steps.values_list("name", flat=True)) == ["classify"]
    card.decide(bob, "edit", payload={"cost_limit": "10"})
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED and run.cost_limit == Decimal(10)
    assert run.tokens_in > 0 and run.cost > 0


def test_a_rejected_budget_stops_the_run(demo, bob):
    run = drive(submission.submit(workflow="refund", input=SMALL_REFUND, cost_limit=Decimal("0.000001"))[0])
    Approval.objects.get(run=run, kind="budget").decide(bob, "reject", comment="too expensive")
    run = drive(run)
    assert run.status == Run.Status.CANCELLED
    assert sandbox.stats()["channels"]["payments"] == 0


def _jobs_consumed(*runs: Run) -> None:
    """In-process drives do not take their jobs from the queue: drop them, as a worker would have."""
    ProcrastinateJob.objects.filter(lock__in=[f"run:{run.pk}" for run in runs]).delete()


def test_a_tenant_at_its_cap_waits_for_a_slot_without_a_job_and_is_woken_oldest_first(demo, settings):
    settings.TENANT_MAX_RUNNING = 1
    busy, _ = submission.submit(workflow="refund", input=SMALL_REFUND, tenant="acme")
    Run.objects.filter(pk=busy.pk).update(status="running", owner="another-worker")
    first, _ = submission.submit(workflow="refund", input=SMALL_REFUND, tenant="acme")
    second, _ = submission.submit(workflow="refund", input=SMALL_REFUND, tenant="acme")
    other, _ = submission.submit(workflow="refund", input=SMALL_REFUND, tenant="globex")
    _jobs_consumed(busy, first, second)

    # Not rejected, and not re-enqueued every second: it waits, with no job, for a slot.
    for run in (second, first):
        run = drive(run)
        assert run.status == Run.Status.QUEUED and run.waiting_for_slot_since is not None
        assert queued_jobs(run) == 0
    assert drive(other).status == Run.Status.SUCCEEDED  # another tenant is not held up

    # The busy run leaves `running`: the oldest waiting run gets the slot's job, the other keeps waiting.
    busy.refresh_from_db()
    with ownership.hold(busy.pk), transaction.atomic():  # as its owner does: under the run's lock
        busy.finish(Run.Status.SUCCEEDED, {})
    assert (queued_jobs(first), queued_jobs(second)) == (1, 0)
    # A stray job of the newer run does not jump the queue.
    assert drive(second).status == Run.Status.QUEUED
    _jobs_consumed(first)
    assert drive(first).status == Run.Status.SUCCEEDED
    assert queued_jobs(second) == 1  # woken when `first` finished
    _jobs_consumed(second)
    assert drive(second).status == Run.Status.SUCCEEDED


def test_a_killed_channel_parks_the_run_before_the_effect(demo):
    Channel.objects.filter(name="email").update(
        kill_switch_engaged=True, kill_switch_reason="bad template", kill_switch_at=timezone.now()
    )
    run = drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    assert run.status == Run.Status.PAUSED and "bad template" in run.pause_reason
    assert sandbox.stats()["channels"] == {"payments": 1, "email": 0, "crm": 1}


def test_a_done_receipt_makes_the_effect_a_no_op(demo):
    run = drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    # Replay the payment step as if its checkpoint had been lost after the receipt was written.
    Step.objects.filter(run=run, name__in=["issue_refund", "notify_customer"]).delete()
    Run.objects.filter(pk=run.pk).update(status="queued", cursor=4, finished_at=None)
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}


def test_an_ambiguous_payment_is_reconciled_through_the_lookup(demo):
    run, _ = submission.submit(workflow="refund", input=_with_faults({"issue_refund": ["timeout"]}, SMALL_REFUND))
    with pytest.raises(Ambiguous):
        drive(run)
    assert Step.objects.get(run=run, name="issue_refund").status == "unknown"
    run = drive(run, attempts=1)
    assert run.status == Run.Status.SUCCEEDED
    receipt = Receipt.objects.get(run=run, channel="payments")
    assert receipt.reconciled and receipt.status == "done"
    assert sandbox.stats()["channels"]["payments"] == 1


def test_an_ambiguous_email_parks_for_a_person(demo, bob):
    run, _ = submission.submit(workflow="refund", input=_with_faults({"notify_customer": ["timeout"]}, SMALL_REFUND))
    with pytest.raises(Ambiguous):
        drive(run)
    run = drive(run, attempts=1)
    assert run.status == Run.Status.WAITING_HUMAN
    card = Approval.objects.get(run=run, kind="reconcile")
    assert card.channel.name == "email" and card.risk == "high"
    card.decide(bob, "approve", comment="the customer has it")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert sandbox.stats()["channels"]["email"] == 1
    assert Receipt.objects.get(run=run, channel="email").reconciled


def test_every_step_is_logged_with_its_ids(demo, caplog):
    run = drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    lines = [r.msg for r in caplog.records if r.name == "runs.engine" and r.msg.get("event") == "step"]
    assert [line["step"] for line in lines] == [s.name for s in run.steps.order_by("seq")]
    for line in lines:
        assert line["run_id"] == str(run.id) and line["trace_id"] == run.trace_id
        assert {"job_id", "latency_ms", "tokens_in", "tokens_out", "idempotency_key"} <= set(line)
    assert lines[0]["tokens_in"] > 0
    assert lines[4]["idempotency_key"] == f"{run.id}:4:issue_refund"


def test_the_same_idempotency_key_gives_the_same_run(demo):
    first, created = submission.submit(workflow="refund", input=REFUND, idempotency_key="order-1")
    again, created_again = submission.submit(workflow="refund", input=REFUND, idempotency_key="order-1")
    assert created and not created_again and again.pk == first.pk
    with pytest.raises(IdempotencyConflict):
        submission.submit(workflow="refund", input=SMALL_REFUND, idempotency_key="order-1")
    assert Run.objects.count() == 1


def test_idempotency_keys_are_scoped_to_their_creator(demo, bob, carol):
    """Two clients cannot collide on a key: each gets its own run, and neither learns of the other's."""
    mine, _ = submission.submit(workflow="refund", input=REFUND, idempotency_key="order-7", created_by=bob)
    theirs, created = submission.submit(
        workflow="refund", input=SMALL_REFUND, idempotency_key="order-7", created_by=carol
    )
    assert created and theirs.pk != mine.pk and theirs.created_by == carol
    again, created = submission.submit(workflow="refund", input=REFUND, idempotency_key="order-7", created_by=bob)
    assert not created and again.pk == mine.pk
    assert Run.objects.count() == 2


def test_a_write_a_person_says_did_not_happen_is_done_once_more(demo, bob):
    run, _ = submission.submit(workflow="refund", input=_with_faults({"notify_customer": ["timeout"]}, SMALL_REFUND))
    with pytest.raises(Ambiguous):
        drive(run)
    run = drive(run, attempts=1)
    Approval.objects.get(run=run, kind="reconcile").decide(bob, "reject", comment="not in the mail log")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    # The fake mail system did record the first, lost send: the person's "no" was wrong here, and the
    # second send is the one their decision asked for; no third one.
    assert SandboxCall.objects.filter(system="email", applied=True).count() == 2
    assert Receipt.objects.get(run=run, channel="email").status == "done"


def test_the_retry_budget_is_per_step(demo):
    faults = {"classify": ["429", "429"], "lookup_customer": ["5xx", "5xx"]}
    run, _ = submission.submit(workflow="refund", input=_with_faults(faults, SMALL_REFUND))
    for attempt in range(4):  # the job's attempts grow across steps; each step has its own budget
        with pytest.raises(Retryable):
            drive(run, attempts=attempt)
    run = drive(run, attempts=4)
    assert run.status == Run.Status.SUCCEEDED
    assert dict(run.steps.values_list("name", "attempt"))["lookup_customer"] == 3


def test_an_ambiguous_write_on_the_last_attempt_is_reconciled_not_dead_lettered(demo):
    faults = {"issue_refund": ["5xx", "5xx", "timeout"]}
    run, _ = submission.submit(workflow="refund", input=_with_faults(faults, SMALL_REFUND))
    for attempt in range(2):
        with pytest.raises(Retryable):
            drive(run, attempts=attempt)
    with pytest.raises(Ambiguous):
        drive(run, attempts=2)  # the step's third attempt: the payment went through, the answer was lost
    run = drive(run, attempts=3)
    assert run.status == Run.Status.SUCCEEDED and not DeadLetter.objects.exists()
    assert sandbox.stats()["channels"]["payments"] == 1


def test_two_effects_in_one_step_are_two_writes(demo):
    double = register(Workflow("test_double_email"))

    @double.effect("email")
    def two_mails(ctx):
        first = ctx.effect(
            lambda key: ctx.tools.email.send(to="a@example.com", subject="1", body="", idempotency_key=key)
        )
        second = ctx.effect(
            lambda key: ctx.tools.email.send(to="b@example.com", subject="2", body="", idempotency_key=key)
        )
        return {"ids": [first["id"], second["id"]]}

    run = drive(submission.submit(workflow="test_double_email", input={})[0])
    assert run.status == Run.Status.SUCCEEDED
    assert sandbox.stats()["channels"]["email"] == 2
    assert len(set(run.result["ids"])) == 2


def test_a_card_copies_its_runs_workflow_and_creator(demo, carol):
    run = drive(submission.submit(workflow="refund", input=REFUND, created_by=carol)[0])
    card = Approval.objects.get(run=run)
    assert (card.workflow, card.run_created_by) == ("refund", carol)
