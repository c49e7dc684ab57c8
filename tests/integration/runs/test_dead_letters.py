"""The dead-letter queue: requeue from the last checkpoint, resolve with a note, both audited; Django admin's
list, detail, filters and actions, and who may use them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import PermissionDenied
from django.db import connection

import tests.workflows  # noqa: F401 - registers the test workflows
from approvals.models import Approval
from core.models import AuditEntry
from demo import sandbox
from jobs.models import DeadLetter
from runs import dead_letters, submission
from runs.access import may_requeue_dead_letters, may_resolve_dead_letters
from runs.dead_letters import DeadLetterError
from runs.models import Run, Step
from runs.workflow import Retryable
from tests.conftest import approves_every_channel
from tests.engine_helpers import SMALL_REFUND, drive, model_calls, queued_jobs

CHANGELIST = "/admin/jobs/deadletter/"


@pytest.fixture
def bob(bob, demo):
    """The reviewer, with approve_channel on every channel of these tests (Approval.decide checks it)."""
    return approves_every_channel(bob)


def _dead_at_issue_refund() -> tuple[Run, DeadLetter]:
    """A refund refused by the payment system (a Fatal 400) after four done steps."""
    run, _ = submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {"issue_refund": ["fatal"]}})
    run = drive(run)
    assert run.status == Run.Status.FAILED
    _job_done(run)
    return run, DeadLetter.objects.get(run_id=run.id)


def _job_done(run: Run) -> None:
    """`drive` runs the engine in-process, so the run's job is still todo: end it as its worker would."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE procrastinate_jobs SET status = 'succeeded' WHERE queueing_lock = %s", [f"run:{run.id}"])


@pytest.fixture
def letter(demo):
    return _dead_at_issue_refund()[1]


@pytest.fixture
def staff_carol(carol):
    carol.is_staff = True
    carol.save(update_fields=["is_staff"])
    return carol


def test_it_requeues_from_the_checkpoint_and_the_run_succeeds(demo, alice):
    run, letter = _dead_at_issue_refund()
    assert list(run.steps.values_list("name", "status")) == [
        ("classify", "done"),
        ("lookup_customer", "done"),
        ("draft_refund", "done"),
        ("approve_refund", "done"),
        ("issue_refund", "failed"),
    ]
    assert model_calls(run) == 2 and queued_jobs(run) == 0

    run = dead_letters.requeue(letter, alice)
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED and run.finished_at is None
    assert run.error == "" and run.attempt == 0 and run.cursor == 4
    assert queued_jobs(run) == 1

    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert model_calls(run, "classify") == 1 and model_calls(run, "draft_refund") == 1  # replayed, not recomputed
    assert Step.objects.get(run=run, name="issue_refund").attempt == 1  # the first of a fresh budget
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}

    letter.refresh_from_db()
    assert letter.resolution == "requeued" and letter.resolved_by == alice and letter.resolved_at is not None


def test_a_requeue_is_audited(letter, carol):
    dead_letters.requeue(letter, carol)
    entry = AuditEntry.objects.get(action="dead_letter.requeue")
    assert entry.actor == "carol" and entry.actor_type == "human"
    assert entry.run_id == letter.run_id and entry.target == f"dead_letter:{letter.pk}"
    assert entry.data["before"]["status"] == "failed" and entry.data["step"] == "issue_refund"
    assert list(AuditEntry.verify_chain()) == []


def test_a_requeue_gives_a_fresh_attempt_budget(demo, alice):
    run, _ = submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {"classify": ["429"] * 4}})
    for attempt in range(2):
        with pytest.raises(Retryable):
            drive(run, attempts=attempt)
    run = drive(run, attempts=2)
    assert run.status == Run.Status.FAILED
    letter = DeadLetter.objects.get(run_id=run.id)
    assert letter.attempts == 3
    _job_done(run)

    dead_letters.requeue(letter, alice)
    assert AuditEntry.objects.get(action="dead_letter.requeue").data["before"]["step_attempts"] == 3
    with pytest.raises(Retryable):  # the fourth 429: retried, not dead-lettered at once
        drive(run, attempts=0)
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    run = drive(run, attempts=1)
    assert run.status == Run.Status.SUCCEEDED
    assert model_calls(run, "classify") == 5


def test_a_requeued_run_that_fails_again_gets_a_new_letter(demo, alice):
    run, _ = submission.submit(
        workflow="refund", input={**SMALL_REFUND, "faults": {"issue_refund": ["fatal", "fatal"]}}
    )
    run = drive(run)
    dead_letters.requeue(DeadLetter.objects.get(run_id=run.id), alice)
    run = drive(run)
    assert run.status == Run.Status.FAILED
    assert list(DeadLetter.objects.filter(run_id=run.id).order_by("id").values_list("resolution", flat=True)) == [
        "requeued",
        "",
    ]


def test_a_letter_is_requeued_once(letter, alice, carol):
    dead_letters.requeue(letter, alice)
    with pytest.raises(DeadLetterError, match="already requeued by alice"):
        dead_letters.requeue(letter, carol)
    assert AuditEntry.objects.filter(action="dead_letter.requeue").count() == 1


def test_a_run_that_is_no_longer_failed_is_not_requeued(letter, alice):
    Run.objects.filter(pk=letter.run_id).update(status="cancelled")
    with pytest.raises(DeadLetterError, match="is cancelled, not failed"):
        dead_letters.requeue(letter, alice)
    letter.refresh_from_db()
    assert letter.resolved_at is None


def test_a_run_a_person_rejected_is_not_requeued(demo, bob, alice):
    run = drive(submission.submit(workflow="test_reject_fails", input={})[0])
    Approval.objects.get(run=run).decide(bob, "reject", comment="no")
    run = drive(run)
    letter = DeadLetter.objects.get(run_id=run.id)
    with pytest.raises(DeadLetterError, match="a person rejected this run"):
        dead_letters.requeue(letter, alice)
    run.refresh_from_db()
    assert run.status == Run.Status.FAILED


def test_it_resolves_with_a_note_and_audits_it(letter, alice):
    dead_letters.resolve(letter, alice, "  Refunded by hand in the payment dashboard  ")
    letter.refresh_from_db()
    assert letter.resolution == "resolved" and letter.note == "Refunded by hand in the payment dashboard"
    entry = AuditEntry.objects.get(action="dead_letter.resolve")
    assert entry.actor == "alice" and entry.data["note"] == "Refunded by hand in the payment dashboard"
    run = Run.objects.get(pk=letter.run_id)
    assert run.status == Run.Status.FAILED and queued_jobs(run) == 0  # resolving retries nothing


@pytest.mark.parametrize("note", ["", "   "])
def test_resolving_needs_a_note(letter, alice, note):
    with pytest.raises(DeadLetterError, match="needs a note"):
        dead_letters.resolve(letter, alice, note)
    letter.refresh_from_db()
    assert letter.resolved_at is None
    assert not AuditEntry.objects.filter(action="dead_letter.resolve").exists()


@pytest.mark.parametrize(
    ("user", "requeue", "resolve"),
    [("alice", True, True), ("carol", True, False), ("bob", False, False), ("dave", False, False)],
)
def test_who_may_requeue_and_resolve(letter, request, user, requeue, resolve):
    actor = request.getfixturevalue(user)
    assert may_requeue_dead_letters(actor) is requeue
    assert may_resolve_dead_letters(actor) is resolve
    if not resolve:
        with pytest.raises(PermissionDenied):
            dead_letters.resolve(letter, actor, "a note")
    if not requeue:
        with pytest.raises(PermissionDenied):
            dead_letters.requeue(letter, actor)
    letter.refresh_from_db()
    assert letter.resolved_at is None


# Django admin


def test_the_list_shows_what_failed(client, alice, letter):
    client.force_login(alice)
    response = client.get(CHANGELIST)
    assert response.status_code == 200
    body = response.content.decode()
    for text in ("refund", "issue_refund", "Fatal", "400 Bad Request", "open"):
        assert text in body


def test_the_detail_shows_input_traceback_and_links(client, alice, letter):
    client.force_login(alice)
    response = client.get(f"{CHANGELIST}{letter.pk}/change/")
    assert response.status_code == 200
    body = response.content.decode()
    assert "Traceback (most recent call last)" in body and "refuse_or_delay" in body
    assert "&quot;customer_id&quot;: &quot;cus_1042&quot;" in body  # pretty JSON of the input
    assert letter.trace_id in body
    assert f"/admin/runs/run/{letter.run_id}/change/" in body
    assert f"/admin/procrastinate/procrastinatejob/{letter.job_id}/change/" in body or letter.job_id is None


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("", {"recent", "old"}),
        ("?age=hour", {"recent"}),
        ("?age=week", {"recent"}),
        ("?age=older", {"old"}),
        ("?error_class=Fatal", {"recent"}),
        ("?error_class=UnknownWorkflow", {"old"}),
        ("?workflow=refund", {"recent", "old"}),
        ("?step=issue_refund", {"recent"}),
        ("?state=open", {"recent"}),
        ("?state=resolved", {"old"}),
    ],
)
def test_the_filters(client, alice, letter, query, expected):
    old = DeadLetter.objects.create(
        run_id=letter.run_id,
        workflow="refund",
        input={},
        error="UnknownWorkflow: no version 9",
        error_class="UnknownWorkflow",
        traceback="",
        attempts=1,
        trace_id="t",
    )
    DeadLetter.objects.filter(pk=old.pk).update(
        created_at=letter.created_at - timedelta(days=9),
        resolved_at=letter.created_at,
        resolution="resolved",
        note="n",
    )
    client.force_login(alice)
    response = client.get(CHANGELIST + query)
    assert response.status_code == 200
    shown = {letter.pk: "recent", old.pk: "old"}
    assert {shown[obj.pk] for obj in response.context["cl"].result_list} == expected


def test_an_admin_requeues_from_the_list(client, alice, letter):
    client.force_login(alice)
    response = client.post(CHANGELIST, {"action": "requeue", "_selected_action": [letter.pk]})
    assert response.status_code == 302
    letter.refresh_from_db()
    assert letter.resolution == "requeued"
    assert Run.objects.get(pk=letter.run_id).status == Run.Status.QUEUED


def test_ops_requeues_from_the_detail_page(client, staff_carol, letter):
    client.force_login(staff_carol)
    url = f"{CHANGELIST}{letter.pk}/change/"
    page = client.get(url)
    assert page.status_code == 200
    choices = dict(page.context["action_form"].fields["action"].choices)
    assert "requeue" in choices and "resolve" not in choices
    response = client.post(url, {"CHANGE_FORM-action": "requeue", "_selected_action": [letter.pk]})
    assert response.status_code == 302
    assert Run.objects.get(pk=letter.run_id).status == Run.Status.QUEUED
    assert AuditEntry.objects.get(action="dead_letter.requeue").actor == "carol"


def test_resolve_asks_for_a_note_on_an_intermediate_page(client, alice, letter):
    client.force_login(alice)
    response = client.post(CHANGELIST, {"action": "resolve", "_selected_action": [letter.pk]})
    assert response.status_code == 200
    assert b'name="note"' in response.content and b'value="resolve"' in response.content

    data = {"action": "resolve", "_selected_action": [letter.pk]}
    response = client.post(CHANGELIST, {**data, "apply": "1", "note": " "})
    assert response.status_code == 200 and b"A note is required" in response.content
    letter.refresh_from_db()
    assert letter.resolved_at is None

    response = client.post(CHANGELIST, {**data, "apply": "1", "note": "Customer refunded"})
    assert response.status_code == 302
    letter.refresh_from_db()
    assert letter.resolution == "resolved" and letter.note == "Customer refunded"
    assert AuditEntry.objects.get(action="dead_letter.resolve").data["note"] == "Customer refunded"


def test_resolve_from_the_detail_page_comes_back_to_it(client, alice, letter):
    client.force_login(alice)
    url = f"{CHANGELIST}{letter.pk}/change/"
    data = {"CHANGE_FORM-action": "resolve", "_selected_action": [letter.pk]}
    response = client.post(url, data)
    assert response.status_code == 200 and b'name="CHANGE_FORM-action"' in response.content
    response = client.post(url, {**data, "apply": "1", "note": "duplicate of another ticket"})
    assert response.status_code == 302 and response["Location"] == url
    letter.refresh_from_db()
    assert letter.resolution == "resolved"


def test_ops_cannot_resolve_even_by_posting(client, staff_carol, letter):
    client.force_login(staff_carol)
    client.post(CHANGELIST, {"action": "resolve", "_selected_action": [letter.pk], "apply": "1", "note": "x"})
    letter.refresh_from_db()
    assert letter.resolved_at is None
    assert not AuditEntry.objects.filter(action="dead_letter.resolve").exists()


@pytest.mark.parametrize("user", ["bob", "dave"])
def test_other_staff_see_nothing_and_change_nothing(client, request, letter, user):
    actor = request.getfixturevalue(user)
    actor.is_staff = True
    actor.save(update_fields=["is_staff"])
    client.force_login(actor)
    assert client.get(CHANGELIST).status_code == 403
    assert client.get(f"{CHANGELIST}{letter.pk}/change/").status_code == 403
    assert client.post(CHANGELIST, {"action": "requeue", "_selected_action": [letter.pk]}).status_code == 403
    assert b"Dead letters" not in client.get("/admin/").content
    letter.refresh_from_db()
    assert letter.resolved_at is None


def test_non_staff_are_sent_to_the_admin_login(client, carol, letter):
    client.force_login(carol)
    response = client.post(CHANGELIST, {"action": "requeue", "_selected_action": [letter.pk]})
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")
    assert Run.objects.get(pk=letter.run_id).status == Run.Status.FAILED


def test_nobody_adds_edits_or_deletes_letters(client, alice, letter):
    client.force_login(alice)
    assert client.get(f"{CHANGELIST}add/").status_code == 403
    assert client.post(f"{CHANGELIST}{letter.pk}/delete/").status_code == 403
    assert "delete_selected" not in dict(client.get(CHANGELIST).context["action_form"].fields["action"].choices)


def test_the_run_admin_is_read_only_with_its_steps(client, alice, letter):
    client.force_login(alice)
    response = client.get(f"/admin/runs/run/{letter.run_id}/change/")
    assert response.status_code == 200
    body = response.content.decode()
    for name in ("classify", "lookup_customer", "draft_refund", "approve_refund", "issue_refund"):
        assert name in body
    assert "Receipts" in body
    assert 'name="_save"' not in body
    assert client.get("/admin/runs/run/add/").status_code == 403


def test_procrastinate_jobs_show_in_admin(client, alice, letter):
    client.force_login(alice)
    index = client.get("/admin/").content.decode()
    assert "/admin/procrastinate/procrastinatejob/" in index and "/admin/jobs/deadletter/" in index
    assert client.get("/admin/procrastinate/procrastinatejob/").status_code == 200
