"""The run's state machine and the defects the ownership review found, each driven in the test process (a
worker's job is `engine.advance`), on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime
import threading
import uuid
from datetime import timedelta
from decimal import Decimal

import psycopg
import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from procrastinate import psycopg_connector
from procrastinate.contrib.django import app
from procrastinate.contrib.django.models import ProcrastinateJob

import tests.workflows  # noqa: F401 - registers the test workflows
from approvals import sla
from approvals.errors import SecondApproverNeeded
from approvals.models import Approval
from core.models import AuditEntry, Channel
from demo import sandbox
from demo.models import SandboxCall
from jobs.models import DeadLetter
from runs import ownership, recovery, submission
from runs.errors import OwnershipLost, TransitionRefused
from runs.models import Receipt, Run, Step
from runs.sql import queries
from runs.tasks import requeue_stalled_jobs
from runs.workflow import Ambiguous, Retryable, Usage
from tests.conftest import approves_every_channel
from tests.engine_helpers import REFUND, SMALL_REFUND, drive, queued_jobs
from tests.worker import database_url, wait_until


@pytest.fixture
def bob(bob, demo):
    """The reviewer, with approve_channel on every channel of these tests (Approval.decide checks it)."""
    return approves_every_channel(bob)


@pytest.fixture(autouse=True)
def _release_run_locks(db):
    yield
    with connection.cursor() as cursor:  # the test's session keeps its connection: leave no lock behind
        cursor.execute("SELECT pg_advisory_unlock_all()")


def _claim(run_id, owner: str):
    """Run.claim as a job makes it: from the session that holds the run's lock (runs.ownership)."""
    with connection.cursor() as cursor:
        _lock(cursor, run_id)
    return Run.claim(run_id, owner)


def _lock(cursor, run_id) -> None:
    """The run's lock, taken as a job takes it (runs.ownership: both counts), on a Django cursor or a connection."""
    assert cursor.execute(queries["try_lock_run"], ownership.lock_params(run_id)).fetchone()[0]


def _faults(faults: dict, base=SMALL_REFUND) -> dict:
    return {**base, "faults": faults}


def _reconcile_card(faults_base=SMALL_REFUND) -> tuple[Run, Approval]:
    """A run whose email send timed out (maybe sent): it parks with a reconcile card."""
    run, _ = submission.submit(workflow="refund", input=_faults({"notify_customer": ["timeout"]}, faults_base))
    with pytest.raises(Ambiguous):
        drive(run)
    run = drive(run, attempts=1)
    assert run.status == Run.Status.WAITING_HUMAN
    return run, Approval.objects.get(run=run, kind="reconcile")


# --- transitions ------------------------------------------------------------------------------------------------


def test_it_refuses_a_transition_from_a_state_the_run_is_not_in(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    with pytest.raises(TransitionRefused):
        run.resume()  # queued, not parked
    run.owner = "nobody"
    with transaction.atomic(), pytest.raises(OwnershipLost):
        run.finish(Run.Status.SUCCEEDED, {})
    assert Run.objects.get(pk=run.pk).status == Run.Status.QUEUED


def test_it_refuses_every_step_write_of_a_job_that_lost_the_run(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    claimed, took_over = _claim(run.pk, "job-a")
    assert claimed.owner == "job-a" and not took_over
    # Job b takes over (job a's session ended, or b would not hold the lock).
    taken, took_over = _claim(run.pk, "job-b")
    assert took_over and taken.owner == "job-b"

    with transaction.atomic(), pytest.raises(OwnershipLost):
        claimed.checkpoint(0, Usage(), **_step_fields())
    with transaction.atomic(), pytest.raises(OwnershipLost):
        claimed.park(paused=True)
    with transaction.atomic(), pytest.raises(OwnershipLost):
        claimed.fail("boom")
    with transaction.atomic(), pytest.raises(OwnershipLost):
        claimed.retry_later("boom", 1)
    with transaction.atomic(), pytest.raises(OwnershipLost):
        claimed.release()
    assert Run.objects.values_list("status", "owner", "cursor").get(pk=run.pk) == (Run.Status.RUNNING, "job-b", 0)
    assert not Step.objects.filter(run=run).exists()  # the checkpoint's step row went with its refused UPDATE


@pytest.mark.django_db(transaction=True)
def test_a_job_whose_session_ended_writes_nothing_though_its_token_is_still_on_the_run():
    """A token is not a lock: the job's session ends (a PostgreSQL restart, a partition, pg_terminate_backend),
    taking the run's lock with it, and Django opens a new session for the job's next statement. Every write the
    job still tries is refused there, although the run still names it as its owner."""
    call_command("demo_setup", verbosity=0)
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    claimed, _ = _claim(run.pk, "job-a")
    connection.close()  # the session ends: PostgreSQL releases the run's lock
    writes = {
        "checkpoint": lambda: claimed.checkpoint(0, Usage(), **_step_fields()),
        "last checkpoint": lambda: claimed.checkpoint(0, Usage(), **_step_fields(), finish=True, result={}),
        "owned (receipts, step rows)": claimed.owned,
        "park": lambda: claimed.park(paused=True),
        "finish": lambda: claimed.finish(Run.Status.SUCCEEDED, {}),
        "fail": lambda: claimed.fail("boom"),
        "retry": lambda: claimed.retry_later("boom", 1),
        "release": claimed.release,
    }
    for name, write in writes.items():
        with transaction.atomic(), pytest.raises(OwnershipLost):
            write()
            pytest.fail(f"{name} was written from a session without the run's lock")
    assert Run.objects.values_list("status", "owner", "cursor").get(pk=run.pk) == (Run.Status.RUNNING, "job-a", 0)
    assert not Step.objects.filter(run=run).exists()
    # Nor can it claim the run again from a session that does not hold the lock.
    with pytest.raises(OwnershipLost):
        Run.claim(run.pk, "job-a2")
    assert Run.objects.get(pk=run.pk).owner == "job-a"


def _step_fields(**overrides) -> dict:
    fields = {
        "name": "classify",
        "kind": Step.Kind.COMPUTE,
        "input": {"input": {}, "outputs": {}},
        "input_hash": "h0",
        "output": {"ok": True},
        "started_at": timezone.now(),
        "latency_ms": 1.5,
    }
    return {**fields, **overrides}


def test_a_checkpoint_is_one_statement_that_checks_the_owner_and_the_cursor(demo, django_assert_num_queries):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    claimed, _ = _claim(run.pk, "job-a")
    usage = Usage(counted_for=(claimed, "classify"))
    usage.add(10, 5, Decimal("0.0000015"))  # counted on the run as the model answered (ModelUsage)
    with django_assert_num_queries(1):
        stored = claimed.checkpoint(0, usage, **_step_fields())
    assert stored == {"ok": True}
    row = Run.objects.get(pk=run.pk)
    assert (row.cursor, row.attempt, row.tokens_in, row.tokens_out, row.cost) == (1, 0, 10, 5, claimed.cost)
    assert (claimed.cursor, claimed.tokens_in, claimed.cost) == (1, 10, row.cost) == (1, 10, Decimal("0.000002"))
    step = Step.objects.get(run=run, seq=0)
    assert (step.status, step.attempt, step.output, step.tokens_in, step.ended_at is not None) == (
        "done",
        1,
        {"ok": True},
        10,
        True,
    )
    # A stale copy of the run (its cursor is behind the row's) writes nothing: the step's row keeps its output.
    stale = Run.objects.get(pk=run.pk)
    stale.cursor = 0
    with pytest.raises(OwnershipLost):
        stale.checkpoint(0, Usage(), **_step_fields(output={"ok": False}))
    assert Step.objects.get(run=run, seq=0).output == {"ok": True}
    assert Run.objects.values_list("cursor", "tokens_in").get(pk=run.pk) == (1, 10)
    # A checkpoint for a step the cursor has not reached writes nothing either.
    with pytest.raises(OwnershipLost):
        claimed.checkpoint(5, Usage(), **_step_fields(name="later"))
    assert not Step.objects.filter(run=run, seq=5).exists()


def test_a_checkpoint_completes_the_row_an_earlier_attempt_left_and_returns_the_output_as_stored(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    claimed, _ = _claim(run.pk, "job-a")
    Step.objects.create(
        run=run,
        seq=0,
        name="classify",
        kind="compute",
        input={"first": 1},
        input_hash="h0",
        status="failed",
        error="Retryable: 5xx",
        attempt=1,
        started_at=timezone.now(),
    )
    Run.objects.filter(pk=run.pk).update(attempt=1)
    claimed.attempt = 1
    # Someone presses cancel while the step runs (committed before its checkpoint).
    Run.objects.get(pk=run.pk).cancel()
    assert not claimed.cancel_requested
    output = {"when": datetime.date(2024, 1, 2), "n": 1e2, "b": {"z": 1, "a": 2}}
    stored = claimed.checkpoint(0, Usage(), **_step_fields(input={"second": 2}, input_hash="h0", output=output))
    assert stored == {"when": "2024-01-02", "n": 100.0, "b": {"a": 2, "z": 1}}
    assert stored == Step.objects.get(run=run, seq=0).output
    assert claimed.cancel_requested  # seen by the checkpoint itself
    step = Step.objects.get(run=run, seq=0)
    # The row is the earlier attempt's, completed: its input stays as first recorded (its hash is the same).
    assert (step.status, step.error, step.attempt, step.input) == ("done", "", 2, {"first": 1})


def test_the_last_checkpoint_ends_the_run_in_its_own_statement_and_wakes_a_run_waiting_for_a_slot(demo, settings):
    settings.TENANT_MAX_RUNNING = 1
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND, tenant="acme")
    claimed, _ = _claim(run.pk, "job-a")
    waiting, _ = submission.submit(workflow="refund", input=SMALL_REFUND, tenant="acme")
    assert _claim(waiting.pk, "job-b") == (None, False)  # no slot: it waits
    ProcrastinateJob.objects.filter(lock=f"run:{waiting.pk}").delete()
    # A job that lost the run finishes nothing and writes no step.
    stale = Run.objects.get(pk=run.pk)
    stale.owner = "job-old"
    with transaction.atomic(), pytest.raises(OwnershipLost):
        stale.checkpoint(0, Usage(), **_step_fields(), finish=True, result={"late": True})
    assert Run.objects.values_list("status", "owner").get(pk=run.pk) == (Run.Status.RUNNING, "job-a")
    assert not Step.objects.filter(run=run).exists()
    # The checkpoint with the finish and the tenant's lock, then the wake-up's count, two prepared statements sent
    # together (runs.sql.pipelined; in this test's transaction after a savepoint where a worker has BEGIN), then the
    # woken run's job: nothing else writes the run.
    with CaptureQueriesContext(connection) as captured, transaction.atomic():
        stored = claimed.checkpoint(0, Usage(), **_step_fields(), finish=True, result={"done": 1})
    statements = [q["sql"].strip() for q in captured.captured_queries if "SAVEPOINT" not in q["sql"]]
    assert "WITH moved AS" in statements[0] and "pg_advisory_xact_lock" in statements[0]
    assert "SELECT id, priority FROM runs_run" in statements[1]
    assert not any("UPDATE" in sql and "runs_run" in sql for sql in statements[2:])
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'WITH moved AS%%'"
            " OR statement LIKE 'SELECT id, priority FROM runs_run%%'"
        )
        assert cursor.fetchone()[0] == 2
    assert stored == {"ok": True}
    row = Run.objects.get(pk=run.pk)
    assert (row.status, row.owner, row.result, row.cursor, row.finished_at) == (
        "succeeded",
        "",
        {"done": 1},
        1,
        claimed.finished_at,
    )
    assert (claimed.status, claimed.owner, claimed.result, claimed.updated_at) == (
        "succeeded",
        "",
        {"done": 1},
        row.updated_at,
    )
    assert Step.objects.get(run=run, seq=0).status == "done"
    assert queued_jobs(waiting) == 1  # its slot is free


def test_a_cancel_committed_while_the_last_step_ran_ends_the_run_cancelled_in_its_checkpoint(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    claimed, _ = _claim(run.pk, "job-a")
    Run.objects.get(pk=run.pk).cancel()
    with transaction.atomic():
        claimed.checkpoint(0, Usage(), **_step_fields(), finish=True, result={"done": 1})
    row = Run.objects.get(pk=run.pk)
    assert (row.status, row.result, claimed.status, claimed.result) == (
        "cancelled",
        {"outcome": "cancelled"},
        "cancelled",
        {"outcome": "cancelled"},
    )
    assert Step.objects.get(run=run, seq=0).status == "done"  # the step's work is recorded


def test_a_run_ends_with_its_last_steps_checkpoint_not_a_finish_of_its_own(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    with CaptureQueriesContext(connection) as queries:
        assert drive(run).status == Run.Status.SUCCEEDED
    assert not any(q["sql"].lstrip().startswith("WITH done AS") for q in queries.captured_queries)
    assert run.result == Step.objects.filter(run=run).order_by("-seq").first().output  # the workflow's result


def test_the_claim_and_the_finish_are_few_statements_and_read_the_run_as_the_orm_does(demo, django_assert_num_queries):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND, tenant="acme", cost_limit=Decimal("1.5"))
    # The row lock with the tenant's lock and the step rows, then the conditional start, in one query string (and,
    # in this test's transaction, a savepoint and its release where a worker has BEGIN and COMMIT).
    with connection.cursor() as cursor:
        _lock(cursor, run.pk)
    with django_assert_num_queries(1 + 2):
        claimed, took_over = Run.claim(run.pk, "job-a")
    assert not took_over
    row = Run.objects.get(pk=run.pk)
    for field in Run._meta.concrete_fields:
        assert getattr(claimed, field.attname) == getattr(row, field.attname), field.name
    assert claimed.input == SMALL_REFUND and claimed.cost_limit == Decimal("1.5")
    # A job that lost the run finishes nothing.
    stale = Run.objects.get(pk=run.pk)
    stale.owner = "job-old"
    with transaction.atomic(), pytest.raises(OwnershipLost):
        stale.finish(Run.Status.SUCCEEDED, {"late": True})
    assert Run.objects.values_list("status", "owner").get(pk=run.pk) == (Run.Status.RUNNING, "job-a")
    # The CAS with the tenant's lock, the wake-up (and the savepoint and its release).
    with django_assert_num_queries(2 + 2), transaction.atomic():
        claimed.finish(Run.Status.SUCCEEDED, None)
    row = Run.objects.get(pk=run.pk)
    assert (row.status, row.owner, row.result, row.finished_at) == ("succeeded", "", None, claimed.finished_at)
    assert Run.objects.filter(pk=run.pk, result__isnull=True).exists()  # SQL NULL, as the ORM stores None


def test_the_claim_sends_its_start_on_its_own_with_server_side_binding(demo, monkeypatch, django_assert_num_queries):
    # With server-side binding (DATABASES OPTIONS), one query string cannot hold two statements.
    monkeypatch.setattr("runs.models.psycopg.ClientCursor", type("NotThisCursor", (), {}))
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    with connection.cursor() as cursor:
        _lock(cursor, run.pk)
    with django_assert_num_queries(3 + 2):  # the row, the start, the step rows: three statements
        claimed, took_over = Run.claim(run.pk, "job-a")
    assert (claimed.status, claimed.owner, took_over) == ("running", "job-a", False)
    assert Run.objects.values_list("status", "owner").get(pk=run.pk) == ("running", "job-a")

    with transaction.atomic():  # the last checkpoint's wake-up count, on its own too
        claimed.checkpoint(0, Usage(), **_step_fields(), finish=True, result=None)
    assert Run.objects.values_list("status", "cursor").get(pk=run.pk) == ("succeeded", 1)
    cancelled, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    Run.objects.filter(pk=cancelled.pk).update(cancel_requested=True)
    assert _claim(cancelled.pk, "job-b") == (None, False)
    assert Run.objects.get(pk=cancelled.pk).status == "cancelled"


def test_a_running_run_must_have_an_owner(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)

    with transaction.atomic(), pytest.raises(IntegrityError):
        Run.objects.filter(pk=run.pk).update(status=Run.Status.RUNNING)


# --- defects found by review --------------------------------------------------------------------------------------


def test_a_decided_gate_is_replayed_from_its_card_even_if_the_gate_would_now_decide_otherwise(demo, bob, settings):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    Approval.objects.get(run=run).decide(bob, "reject", comment="not this customer")
    # A deploy raises the auto-approve amount above this refund before the run resumes.
    settings.AUTO_APPROVE_CENTS = 10**9
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED and run.result["outcome"] == "rejected"
    assert Step.objects.get(run=run, name="approve_refund").output["decision"] == "rejected"
    assert sandbox.stats()["channels"]["payments"] == 0


def test_the_sla_safe_default_escalates_a_reconcile_card_instead_of_rejecting_it(demo):
    Channel.objects.filter(name="email").update(escalation_policy=Channel.EscalationPolicy.SAFE_DEFAULT)
    run, card = _reconcile_card()
    Approval.objects.filter(pk=card.pk).update(due_at=timezone.now() - timedelta(minutes=1))
    assert sla.apply_sla(card.pk) == "escalate"
    card.refresh_from_db()
    assert card.status == Approval.Status.ESCALATED and not card.decisions.exists()
    assert Run.objects.get(pk=run.pk).status == Run.Status.WAITING_HUMAN
    assert SandboxCall.objects.filter(system="email").count() == 1  # nothing sent again


def test_on_a_two_person_channel_it_did_not_happen_needs_two_people(demo, bob, alice):
    Channel.objects.filter(name="email").update(required_approvals=2)
    run, card = _reconcile_card()
    card.decide(bob, "reject", comment="not in the mail log")
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING and Run.objects.get(pk=run.pk).status == Run.Status.WAITING_HUMAN
    with pytest.raises(SecondApproverNeeded):
        card.decide(bob, "reject", comment="really not")
    card.decide(alice, "reject", comment="confirmed: not sent")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert SandboxCall.objects.filter(system="email", applied=True).count() == 2  # the one they asked for


def test_a_retryable_failure_of_an_effect_with_a_lookup_keeps_its_receipt_and_asks_first(demo):
    run, _ = submission.submit(workflow="refund", input=_faults({"issue_refund": ["5xx"]}))
    with pytest.raises(Retryable):
        drive(run)
    receipt = Receipt.objects.get(run=run, channel="payments")
    assert receipt.status == Receipt.Status.PENDING  # the 503 may have been applied: not forgotten
    run = drive(run, attempts=1)
    assert run.status == Run.Status.SUCCEEDED
    assert SandboxCall.objects.filter(system="payments", applied=True).count() == 1
    assert sandbox.stats()["duplicates"] == 0


def test_a_retryable_failure_of_an_effect_without_a_lookup_forgets_its_receipt(demo):
    run, _ = submission.submit(workflow="refund", input=_faults({"notify_customer": ["5xx"]}))
    with pytest.raises(Retryable):
        drive(run)
    assert not Receipt.objects.filter(run=run, channel="email").exists()
    assert drive(run, attempts=1).status == Run.Status.SUCCEEDED
    assert SandboxCall.objects.filter(system="email", applied=True).count() == 1


def test_a_park_is_not_an_attempt(demo, carol):
    payments = Channel.objects.get(name="payments")
    run, _ = submission.submit(workflow="refund", input=_faults({"issue_refund": ["429", "429"]}))
    for _ in range(2):  # parked twice by the switch...
        payments.engage_kill_switch(carol, "incident")
        assert drive(run).status == Run.Status.PAUSED
        payments.release_kill_switch(carol, "all clear")
    # ...then two 429s: with RUN_MAX_ATTEMPTS = 3 the third execution succeeds.
    for attempts in range(2):
        with pytest.raises(Retryable):
            drive(run, attempts=attempts)
    run = drive(run, attempts=2)
    assert run.status == Run.Status.SUCCEEDED and not DeadLetter.objects.exists()
    assert Step.objects.get(run=run, name="issue_refund").attempt == 3


def test_the_jobs_last_attempt_sends_the_run_to_the_dead_letter_queue_not_back_to_the_queue(demo):
    run, _ = submission.submit(workflow="refund", input=_faults({"notify_customer": ["timeout"]}))
    run = drive(run, attempts=9)  # the retry strategy's backstop: no 10th attempt would come
    # Not back to the queue: the refund it paid can be undone, so a person is asked first (runs.compensations,
    # the workflow's policy `ask`); they say no, and it goes to the dead-letter queue as it failed.
    assert run.status == Run.Status.WAITING_HUMAN and run.undo_reason == "failed"
    card = Approval.objects.get(run=run, kind="undo", status=Approval.Status.PENDING)
    card.decide(demo["reviewer"], "reject", comment="the customer keeps the refund")
    run = drive(run)
    assert run.status == Run.Status.FAILED and run.undo_reason == ""
    assert DeadLetter.objects.get(run_id=run.id).error_class == "Ambiguous"


def test_a_cancel_requested_while_a_step_ran_wins_over_its_park(demo):
    run = drive(submission.submit(workflow="test_cancel_then_gate", input={})[0])
    assert run.status == Run.Status.CANCELLED
    assert not Approval.objects.filter(run=run, status__in=Approval.OPEN).exists()


def test_a_cancel_committed_while_a_step_ran_stops_its_effect_before_it_starts(demo):
    tests.workflows.cancel_then_effect_calls.clear()
    run = drive(submission.submit(workflow="test_cancel_then_effect", input={})[0])
    assert (run.status, run.result) == (Run.Status.CANCELLED, {"outcome": "cancelled"})
    assert tests.workflows.cancel_then_effect_calls == [] and not Receipt.objects.filter(run=run).exists()


def test_an_effect_inside_the_steps_own_transaction_is_refused(demo):
    tests.workflows.effect_in_atomic_calls.clear()
    run = drive(submission.submit(workflow="test_effect_in_atomic", input={})[0])
    assert run.status == Run.Status.FAILED and "inside transaction.atomic()" in run.error
    assert tests.workflows.effect_in_atomic_calls == [] and not Receipt.objects.exists()


# --- the recovery sweep ---------------------------------------------------------------------------------------------


def _age(run: Run) -> None:
    Run.objects.filter(pk=run.pk).update(updated_at=timezone.now() - timedelta(minutes=1))


def _retry_causes(run: Run) -> list[str]:
    return [e.data["cause"] for e in AuditEntry.objects.filter(action="run.retry", run_id=run.id)]


def test_the_sweep_gives_a_job_to_a_queued_run_that_has_none(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    ProcrastinateJob.objects.filter(lock=f"run:{run.pk}").delete()  # lost, e.g. with a restored backup
    assert recovery.sweep() == {"owner_gone": 0, "no_job": 0}  # too recent to suspect
    _age(run)
    assert recovery.sweep() == {"owner_gone": 0, "no_job": 1}
    assert queued_jobs(run) == 1 and _retry_causes(run) == ["no_job"]
    _age(run)
    assert recovery.sweep() == {"owner_gone": 0, "no_job": 0}


def test_the_sweep_wakes_only_as_many_waiting_runs_as_their_tenant_has_free_slots(demo, settings):
    settings.TENANT_MAX_RUNNING = 2
    busy, _ = submission.submit(workflow="refund", input=SMALL_REFUND, tenant="acme")
    Run.objects.filter(pk=busy.pk).update(status=Run.Status.RUNNING, owner="alive")
    waiting = [submission.submit(workflow="refund", input=SMALL_REFUND, tenant="acme")[0] for _ in range(3)]
    ProcrastinateJob.objects.filter(lock__in=[f"run:{run.pk}" for run in [busy, *waiting]]).delete()
    Run.objects.filter(pk__in=[run.pk for run in waiting]).update(waiting_for_slot_since=timezone.now())
    for run in waiting:
        _age(run)
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as owner_session:
        _lock(owner_session, busy.pk)
        # One slot free: the oldest waiting run gets a job, the others keep waiting without one.
        assert recovery.sweep() == {"owner_gone": 0, "no_job": 1}
        assert [queued_jobs(run) for run in waiting] == [1, 0, 0]
        # That job is about to take the slot: nothing more to wake.
        assert recovery.sweep() == {"owner_gone": 0, "no_job": 0}


def test_the_sweep_requeues_a_running_run_whose_owner_is_gone_and_frees_its_dead_job(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    ProcrastinateJob.objects.filter(lock=f"run:{run.pk}").delete()
    with connection.cursor() as cursor:  # the dead worker's job, still `doing`
        cursor.execute(
            "INSERT INTO procrastinate_jobs (queue_name, task_name, lock, args, status)"
            " VALUES ('agent', 'advance_run', %s, '{}', 'doing') RETURNING id",
            [f"run:{run.pk}"],
        )
        dead_job = cursor.fetchone()[0]
    Run.objects.filter(pk=run.pk).update(status=Run.Status.RUNNING, owner="worker-that-died")
    assert recovery.sweep()["owner_gone"] == 1
    assert Run.objects.values_list("status", "owner").get(pk=run.pk) == (Run.Status.QUEUED, "")
    assert ProcrastinateJob.objects.get(pk=dead_job).status == "aborted"
    assert queued_jobs(run) == 1 and _retry_causes(run) == ["owner_gone"]
    assert drive(run).status == Run.Status.SUCCEEDED


def test_the_sweep_leaves_a_run_whose_owner_holds_its_lock_however_old_it_looks(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    Run.objects.filter(pk=run.pk).update(
        status=Run.Status.RUNNING, owner="slow-but-alive", updated_at=timezone.now() - timedelta(hours=1)
    )
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as owner_session:
        _lock(owner_session, run.pk)
        assert recovery.sweep()["owner_gone"] == 0
        assert Run.objects.get(pk=run.pk).owner == "slow-but-alive"
    # The owner's session ended (its backend exits a moment after the client closes): now it is gone.
    wait_until(lambda: recovery.sweep()["owner_gone"] == 1, timeout=10, message="the ended session's lock to free")


def test_a_job_that_finds_the_run_locked_by_a_live_session_leaves_it_and_tries_again_later(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    ProcrastinateJob.objects.filter(lock=f"run:{run.pk}").delete()
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as other:
        _lock(other, run.pk)
        run = drive(run)
        assert run.status == Run.Status.QUEUED and not Step.objects.filter(run=run).exists()
        job = ProcrastinateJob.objects.get(lock=f"run:{run.pk}", status="todo")
        assert job.scheduled_at > timezone.now()  # after OWNER_WAIT_SECONDS


# --- the stalled-job sweep ------------------------------------------------------------------------------------------


def _insert_job(cursor, lock: str, status: str) -> int:
    cursor.execute(
        "INSERT INTO procrastinate_jobs (queue_name, task_name, lock, queueing_lock, args, status)"
        " VALUES ('agent', 'advance_run', %s, %s, '{}', %s) RETURNING id",
        [lock, lock, status],
    )
    return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_a_queueing_lock_collision_does_not_stop_the_stalled_sweep_nor_wedge_the_run():
    with connection.cursor() as cursor:
        colliding = _insert_job(cursor, "run:a", "doing")  # no worker: stalled
        waiting = _insert_job(cursor, "run:a", "todo")  # a newer job of the same run already waits
        other = _insert_job(cursor, "run:b", "doing")  # stalled too, after it in the sweep
    connector = psycopg_connector.PsycopgConnector(conninfo=database_url(connection.settings_dict))

    async def sweep():
        with app.replace_connector(connector) as sweeping_app:
            await sweeping_app.open_async()
            try:
                await requeue_stalled_jobs.func(type("Context", (), {"app": sweeping_app})(), timestamp=0)
            finally:
                await sweeping_app.close_async()

    # In a thread of its own: the browser tests' Playwright leaves an event loop in this one.
    sweeper = threading.Thread(target=lambda: asyncio.run(sweep()))
    sweeper.start()
    sweeper.join(30)
    statuses = dict(ProcrastinateJob.objects.filter(pk__in=[colliding, waiting, other]).values_list("pk", "status"))
    assert statuses == {colliding: "aborted", waiting: "todo", other: "todo"}


# --- one lock order -------------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_cancel_and_a_decision_at_the_same_moment_do_not_deadlock(bob):
    call_command("demo_setup", verbosity=0)
    errors: list[BaseException] = []
    for _ in range(8):
        run = drive(submission.submit(workflow="refund", input=REFUND)[0])
        card = Approval.objects.get(run=run)
        start = threading.Barrier(2)

        def act(action, start=start):
            try:
                start.wait()
                action()
            except Exception as exc:  # noqa: BLE001 - collected and checked below
                errors.append(exc)
            finally:
                connections.close_all()

        threads = [
            threading.Thread(target=act, args=(lambda card=card: card.decide(bob, "approve"),)),
            threading.Thread(target=act, args=(lambda run=run: run.cancel(),)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    # Whichever wins, the other sees its outcome (AlreadyDecided, or a finished run): never a deadlock.
    assert not [e for e in errors if "deadlock" in str(e).lower()], errors


def test_the_sweep_recovers_every_ownerless_run_oldest_first_past_its_batch(demo):
    live, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    gone = [submission.submit(workflow="refund", input=SMALL_REFUND)[0] for _ in range(5)]
    for age, run in enumerate([live, *gone]):
        Run.objects.filter(pk=run.pk).update(
            status=Run.Status.RUNNING, owner=f"owner-{age}", created_at=timezone.now() - timedelta(hours=10 - age)
        )
    ProcrastinateJob.objects.all().delete()
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as owner_session:
        _lock(owner_session, live.pk)  # the oldest run's owner is alive
        # A batch of 2: the 5 ownerless runs are all recovered, in three batches; the live one is left alone.
        assert recovery.sweep(limit=2)["owner_gone"] == 5
        assert Run.objects.get(pk=live.pk).status == Run.Status.RUNNING
    assert set(Run.objects.filter(pk__in=[r.pk for r in gone]).values_list("status", flat=True)) == {"queued"}
    order = [e.run_id for e in AuditEntry.objects.filter(action="run.retry").order_by("pk")]
    assert order == [r.pk for r in gone]  # oldest first


def test_two_runs_never_share_a_lock_unless_their_ids_share_64_bits():
    a = uuid.UUID("12345678-9abc-def0-0000-000000000001")
    b = uuid.UUID("12345678-9abc-def0-ffff-ffffffffffff")  # the same first 64 bits: the same lock
    c = uuid.UUID("12345678-9abc-def1-0000-000000000001")
    assert ownership.key(a) == ownership.key(b) != ownership.key(c)
    assert ownership.key("ffffffff-ffff-ffff-0000-000000000000") == (-1, -1)  # signed, as pg_advisory_lock takes
    assert ownership.lock_params("ffffffff-ffff-ffff-0000-000000000000") == {"lock_hi": -1, "lock_lo": -1}


def _advisory_locks(cursor) -> list[tuple[int, bool]]:
    """The run locks (two-key advisory locks) of the test database, as pg_locks shows them: (pid, granted)."""
    cursor.execute(
        "SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    return cursor.fetchall()


def test_the_lock_check_is_true_only_in_the_session_holding_the_lock_and_leaves_it_as_it_was(demo):
    """HELD_SQL asks the lock manager: it gives back one of the holder's two counts and takes it again. Checked any
    number of times it leaves the lock held as it was (two unlocks let it go); in a session that does not hold it,
    whether another holds it or nobody does, it is false and takes nothing."""
    run_id = uuid.uuid4()
    params = ownership.lock_params(run_id)
    check = "SELECT " + ownership.HELD_SQL
    with (
        psycopg.connect(database_url(connection.settings_dict), autocommit=True) as holder,
        psycopg.connect(database_url(connection.settings_dict), autocommit=True) as other,
    ):
        holder_pid = holder.info.backend_pid
        # Nobody holds it: false, and nothing is taken.
        assert other.execute(check, params).fetchone()[0] is False
        assert _advisory_locks(other.cursor()) == []
        _lock(holder, run_id)
        for _ in range(3):
            assert holder.execute(check, params).fetchone()[0] is True
        assert _advisory_locks(other.cursor()) == [(holder_pid, True)]
        # Another session holds it: false, and the holder keeps it.
        assert other.execute(check, params).fetchone()[0] is False
        assert other.execute(queries["try_lock_run"], params).fetchone()[0] is False
        assert _advisory_locks(other.cursor()) == [(holder_pid, True)]
        # Both counts are there after the checks: the first unlock leaves it held, the second lets it go.
        assert holder.execute("SELECT pg_advisory_unlock(%(lock_hi)s, %(lock_lo)s)", params).fetchone()[0]
        assert _advisory_locks(other.cursor()) == [(holder_pid, True)]
        assert holder.execute(queries["unlock_run"], params).fetchone()[0] is False  # the job's unlock: one left
        assert _advisory_locks(other.cursor()) == []
        assert holder.execute(check, params).fetchone()[0] is False
        # Its job's own unlock lets both counts go at once.
        _lock(other, run_id)
        assert other.execute(queries["unlock_run"], params).fetchone()[0] is True
        assert _advisory_locks(holder.cursor()) == []


def test_a_step_checkpoint_is_prepared_in_the_jobs_session_and_still_refuses_a_session_without_the_lock(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    claimed, _ = _claim(run.pk, "job-a")
    claimed.checkpoint(0, Usage(), **_step_fields())
    # Prepared on the server, in this session (runs.sql.prepared_cursor), not parsed and planned at every step.
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'WITH moved AS%%'")
        assert cursor.fetchone()[0] == 1
    assert Run.objects.values_list("cursor", flat=True).get(pk=run.pk) == 1
    # The prepared statement checks the session's lock as the unprepared one did: let it go, and nothing is written.
    ownership.unlock(run.pk)
    with pytest.raises(OwnershipLost):
        claimed.checkpoint(1, Usage(), **_step_fields(name="lookup"))
    assert Run.objects.values_list("cursor", flat=True).get(pk=run.pk) == 1
    assert list(Step.objects.filter(run=run).values_list("seq", flat=True)) == [0]
