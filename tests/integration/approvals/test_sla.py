"""SLA timers and the escalation policy. Time moves by passing `now` (or moving a deadline), never by sleeping."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.core import mail
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from procrastinate.contrib.django.models import ProcrastinateJob

from approvals import sla
from approvals.errors import AlreadyDecided
from approvals.models import Approval, Decision, Notification
from approvals.tasks import card_due, send_notification, sla_sweep
from core.models import AuditEntry, Channel
from demo import sandbox
from runs import submission
from runs.models import Run
from tests.conftest import approves_every_channel
from tests.engine_helpers import REFUND, drive
from tests.worker import wait_until

SECOND = timedelta(seconds=1)


@pytest.fixture
def bob(bob, demo):
    """The reviewer, with approve_channel on every channel of these tests (Approval.decide checks it)."""
    return approves_every_channel(bob)


@pytest.fixture
def leads(demo):
    group = Group.objects.create(name="payments-leads")
    User.objects.create_user("lena", email="lena@example.com").groups.add(group)
    User.objects.create_user("noemail").groups.add(group)
    return group


def payments(**changes) -> Channel:
    Channel.objects.filter(name="payments").update(**changes)
    return Channel.objects.get(name="payments")


def parked_card() -> Approval:
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    assert run.status == Run.Status.WAITING_HUMAN
    return Approval.objects.select_related("channel").get(run=run)


def timer_jobs(card: Approval, status: str = "todo"):
    return ProcrastinateJob.objects.filter(
        task_name="approvals.tasks.card_due", args={"card_id": card.pk}, status=status
    )


def fire_timer(card: Approval):
    """What a worker does with the card's timer job: take it (doing), run it, finish it."""
    job = timer_jobs(card).get()
    ProcrastinateJob.objects.filter(pk=job.pk).update(status="doing")
    try:
        return card_due(card_id=card.pk)
    finally:
        ProcrastinateJob.objects.filter(pk=job.pk).update(status="succeeded")


def past_due(card: Approval) -> Approval:
    """Move time past the card's deadline: its deadline moves into the past, with the waiting timer's."""
    due = timezone.now() - SECOND
    Approval.objects.filter(pk=card.pk).update(due_at=due)
    timer_jobs(card).update(scheduled_at=due)
    card.refresh_from_db()
    return card


def test_it_defers_the_timer_at_due_at_in_the_parking_transaction(demo):
    channel = payments(sla=timedelta(minutes=20))
    before = timezone.now()
    card = parked_card()
    assert before + channel.sla <= card.due_at <= timezone.now() + channel.sla
    job = timer_jobs(card).get()
    assert job.scheduled_at == card.due_at
    assert job.queue_name == "hitl" and job.queueing_lock == f"card-due:{card.pk}"


def test_a_card_parked_again_on_the_same_question_keeps_one_timer(demo):
    card = parked_card()
    run = card.run
    Run.objects.filter(pk=run.pk).update(status=Run.Status.QUEUED)
    drive(run)  # a resumed job parks on the same question
    assert Approval.objects.filter(run=run).count() == 1
    assert timer_jobs(card).count() == 1


def test_the_timer_before_the_deadline_does_nothing(demo):
    card = parked_card()
    assert sla.apply_sla(card.pk, card.due_at - SECOND) is None
    card.refresh_from_db()
    assert card.status == "pending" and not AuditEntry.objects.filter(action__startswith="sla.").exists()


def test_escalate_reassigns_notifies_and_sets_a_new_deadline_once(demo, leads, settings):
    settings.NOTIFY_BACKENDS = ["email"]
    payments(escalation_policy="escalate", escalation_group=leads, sla=timedelta(hours=1))
    card = parked_card()
    missed = card.due_at

    assert sla.apply_sla(card.pk, missed + SECOND) == "escalate"
    assert sla.apply_sla(card.pk, missed + SECOND) is None  # the sweep, a moment later

    card.refresh_from_db()
    assert card.status == "escalated" and card.assigned_group == leads
    assert card.due_at == missed + timedelta(hours=1)
    assert card.version == 1  # a reviewer's page loaded before still decides it
    assert card.run.status == Run.Status.WAITING_HUMAN
    entry = AuditEntry.objects.get(action="sla.escalate")
    assert (entry.actor, entry.actor_type, entry.approval_id) == ("system", "system", card.pk)
    assert entry.data["group"] == "payments-leads"
    notification = Notification.objects.get()
    assert (notification.backend, notification.status, notification.group) == ("email", "pending", leads)
    assert ProcrastinateJob.objects.filter(
        task_name="approvals.tasks.send_notification", queue_name="outbound", status="todo"
    ).exists()


def test_the_timer_escalates_then_rearms_for_the_new_deadline(demo, leads, settings):
    settings.NOTIFY_BACKENDS = ["email"]
    payments(escalation_policy="escalate", escalation_group=leads)
    card = past_due(parked_card())

    assert fire_timer(card) == "escalate"
    card.refresh_from_db()
    assert card.status == "escalated"
    assert timer_jobs(card).get().scheduled_at == card.due_at  # the next deadline has its own timer
    assert AuditEntry.objects.filter(action="sla.escalate").count() == 1


def test_an_escalated_card_is_still_decided_once(demo, leads, bob):
    payments(escalation_policy="escalate", escalation_group=leads)
    card = parked_card()
    sla.apply_sla(card.pk, card.due_at + SECOND)

    card.decide(bob, "approve", version=1)
    with pytest.raises(AlreadyDecided):
        card.decide(bob, "approve")
    card.refresh_from_db()
    assert card.status == "approved"
    run = drive(card.run)
    assert run.status == Run.Status.SUCCEEDED and sandbox.stats()["channels"]["payments"] == 1
    assert sla.apply_sla(card.pk, card.due_at + timedelta(days=1)) is None  # its later timer: a no-op


def test_safe_default_rejects_as_system_and_pays_nothing_once(demo):
    payments(escalation_policy="safe_default")
    card = parked_card()

    assert sla.apply_sla(card.pk, card.due_at + SECOND) == "safe_default"
    assert sla.apply_sla(card.pk, card.due_at + timedelta(hours=5)) is None

    card.refresh_from_db()
    assert card.status == "rejected" and card.decided_at is not None and card.version == 2
    decision = Decision.objects.get(approval=card)
    assert decision.actor is None and decision.decision == "reject"
    assert (decision.comment, decision.reason) == ("SLA expired: safe default", "policy")
    entry = AuditEntry.objects.get(action="sla.safe_default")
    assert (entry.actor, entry.actor_type) == ("system", "system")
    assert not Notification.objects.exists()

    run = card.run
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED and run.result["outcome"] == "rejected"
    assert run.result["by"] == "system"
    assert sandbox.stats()["channels"]["payments"] == 0 and sandbox.stats()["channels"]["email"] == 0


def test_a_reviewer_who_decided_first_wins_over_the_timer(demo, bob):
    payments(escalation_policy="safe_default")
    card = parked_card()
    card.decide(bob, "approve")
    assert sla.apply_sla(card.pk, card.due_at + SECOND) is None
    card.refresh_from_db()
    assert card.status == "approved" and Decision.objects.count() == 1
    assert not AuditEntry.objects.filter(action__startswith="sla.").exists()


def test_a_reviewer_after_the_safe_default_is_told_who_decided(demo, bob):
    payments(escalation_policy="safe_default")
    card = parked_card()
    sla.apply_sla(card.pk, card.due_at + SECOND)
    with pytest.raises(AlreadyDecided, match="already rejected by system"):
        card.decide(bob, "approve", version=1)
    assert Decision.objects.count() == 1


def test_the_sweep_applies_the_policy_to_overdue_cards_only(demo):
    payments(escalation_policy="safe_default")
    overdue = past_due(parked_card())
    on_time = parked_card()
    assert sla_sweep(timestamp=0) == 1
    overdue.refresh_from_db()
    on_time.refresh_from_db()
    assert overdue.status == "rejected" and on_time.status == "pending"
    assert sla_sweep(timestamp=0) == 0


def test_a_timer_that_finds_the_sweep_already_acted_does_nothing(demo):
    payments(escalation_policy="safe_default")
    card = past_due(parked_card())
    assert sla_sweep(timestamp=0) == 1
    assert fire_timer(card) is None
    assert AuditEntry.objects.filter(action="sla.safe_default").count() == 1
    assert Decision.objects.count() == 1


def test_a_timer_that_finds_the_deadline_moved_waits_for_the_new_one(demo, leads, settings):
    """The sweep escalated first, while the card's timer still waited for the old deadline: that timer fires,
    does nothing, and re-arms itself for the new deadline; the next deadline escalates again, once."""
    settings.NOTIFY_BACKENDS = ["email"]
    payments(escalation_policy="escalate", escalation_group=leads)
    card = past_due(parked_card())
    assert sla_sweep(timestamp=0) == 1
    card.refresh_from_db()
    assert timer_jobs(card).count() == 1  # the old timer still waits (one waiting timer per card)

    assert fire_timer(card) is None
    assert timer_jobs(card).get().scheduled_at == card.due_at
    assert AuditEntry.objects.filter(action="sla.escalate").count() == 1

    assert sla.apply_sla(card.pk, card.due_at + SECOND) == "escalate"  # the next deadline passes too
    assert sla.apply_sla(card.pk, card.due_at + SECOND) is None
    assert AuditEntry.objects.filter(action="sla.escalate").count() == 2
    assert Notification.objects.count() == 2


def race(n: int, work) -> list:
    """`work(i)` in n threads released together, each with its own database connection."""
    start = threading.Barrier(n)
    results: list = [None] * n

    def target(i: int) -> None:
        try:
            start.wait()
            results[i] = work(i)
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


@pytest.mark.parametrize("policy_name", ["escalate", "safe_default"])
def test_the_timer_and_the_sweep_racing_act_once(transactional_db, policy_name, settings):
    settings.NOTIFY_BACKENDS = ["email"]
    call_command("demo_setup", verbosity=0)
    payments(escalation_policy=policy_name)
    for _ in range(5):
        card = parked_card()
        now = card.due_at + SECOND
        results = race(3, lambda i, card=card, now=now: sla.apply_sla(card.pk, now))
        assert sorted(map(str, results)) == sorted([policy_name, "None", "None"])
        assert AuditEntry.objects.filter(action=f"sla.{policy_name}", approval_id=card.pk).count() == 1
    if policy_name == "escalate":
        assert Notification.objects.count() == 5
    else:
        assert Decision.objects.count() == 5


def test_a_reviewer_and_the_safe_default_racing_decide_once(transactional_db):
    call_command("demo_setup", verbosity=0)
    reviewer = User.objects.get(username="reviewer")
    payments(escalation_policy="safe_default")
    outcomes = set()
    for _ in range(6):
        card = parked_card()
        now = card.due_at + SECOND

        def work(i, card=card, now=now):
            if i == 0:
                return sla.apply_sla(card.pk, now)
            return Approval.objects.get(pk=card.pk).decide(reviewer, "approve", version=1).status

        timer, click = race(2, work)
        card.refresh_from_db()
        assert Decision.objects.filter(approval=card).count() == 1
        if timer == "safe_default":
            assert isinstance(click, AlreadyDecided) and card.status == "rejected"
        else:
            assert timer is None and click == "approved" and card.status == "approved"
        assert (
            AuditEntry.objects.filter(approval_id=card.pk, action__in=["sla.safe_default", "approval.approve"]).count()
            == 1
        )
        run = Run.objects.get(pk=card.run_id)
        assert run.status == Run.Status.QUEUED
        outcomes.add(card.status)
    assert outcomes <= {"approved", "rejected"}


def test_a_reviewer_and_the_escalation_racing_both_hold(transactional_db, settings):
    """Escalation leaves the card decidable: the click always counts, once; the escalation happens or not."""
    settings.NOTIFY_BACKENDS = ["email"]
    call_command("demo_setup", verbosity=0)
    reviewer = User.objects.get(username="reviewer")
    payments(escalation_policy="escalate")
    for _ in range(6):
        card = parked_card()
        now = card.due_at + SECOND

        def work(i, card=card, now=now):
            if i == 0:
                return sla.apply_sla(card.pk, now)
            return Approval.objects.get(pk=card.pk).decide(reviewer, "approve", version=1).status

        timer, click = race(2, work)
        card.refresh_from_db()
        assert click == "approved" and card.status == "approved"
        assert Decision.objects.filter(approval=card).count() == 1
        escalations = AuditEntry.objects.filter(approval_id=card.pk, action="sla.escalate").count()
        assert escalations == (1 if timer == "escalate" else 0)


def test_the_escalation_email_goes_to_the_group(demo, leads, settings):
    settings.NOTIFY_BACKENDS = ["email"]
    payments(escalation_policy="escalate", escalation_group=leads)
    card = parked_card()
    sla.apply_sla(card.pk, card.due_at + SECOND)

    assert send_notification(notification_id=Notification.objects.get().pk) == "sent"
    assert len(mail.outbox) == 1
    assert mail.outbox[0].to == ["lena@example.com"]
    assert f"/approvals/{card.pk}/" in mail.outbox[0].body
    assert Notification.objects.get().status == "sent"


def test_a_real_worker_fires_the_timer_from_the_database(start_worker):
    """Durable: the timer is a job row, so a worker started after the card opened (a restart) still fires it,
    and the run then ends as its workflow ends a rejection. (The deadline is one second away: no time is
    moved here, the worker's clock runs.)"""
    call_command("demo_setup", verbosity=0)
    payments(escalation_policy="safe_default", sla=timedelta(seconds=1))
    card = parked_card()
    start_worker()
    run = wait_until(
        lambda: Run.objects.filter(pk=card.run_id, status=Run.Status.SUCCEEDED).first(),
        timeout=30,
        message="the run to end after its card's safe default",
    )
    assert run.result["outcome"] == "rejected" and run.result["by"] == "system"
    assert Approval.objects.get(pk=card.pk).status == "rejected"
    assert timer_jobs(card, status="succeeded").count() == 1
    assert AuditEntry.objects.filter(action="sla.safe_default").count() == 1
    assert sandbox.stats()["channels"]["payments"] == 0


def test_a_failed_compensations_card_is_never_rejected_by_the_safe_default(demo):
    """Rejecting it says "a person undid it by hand": the deadline escalates it instead, as a reconcile card."""
    import tests.workflows  # noqa: F401, PLC0415 - registers test_undo_chain

    payments(escalation_policy="safe_default")
    faults = {"confirm": ["fatal"], "undo:pay": ["fatal"]}
    run = drive(
        submission.submit(workflow="test_undo_chain", input={"customer_id": "c1", "amount_cents": 5, "faults": faults})[
            0
        ]
    )
    card = Approval.objects.get(run=run, kind="undo_failed")
    assert sla.apply_sla(card.pk, card.due_at + SECOND) == "escalate"
    card.refresh_from_db()
    assert card.status == Approval.Status.ESCALATED and not Decision.objects.filter(approval=card).exists()
