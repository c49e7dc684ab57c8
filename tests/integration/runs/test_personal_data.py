"""Personal data in a run's flow (runs.personal, runs.erasure; docs/personal-data.md): the input's marked fields and
a read's declared ones are sealed before anything is written, an effect gets them in clear through `ctx.pii` and
what comes back (its answer, its error) is scrubbed to references; erasure destroys the subject's key, cancels
their runs in flight and is audited; keys that are missing or wrong fail with a clear error, never clear text."""

from __future__ import annotations

import base64
import json
import os

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import connection
from pydantic import BaseModel, ConfigDict, Field

import tests.workflows  # noqa: F401 - registers test_personal
from approvals.models import Approval
from console.checks import check_pii_keys
from core import pii
from core.models import ApiToken, AuditEntry, PiiSubject, PiiValue
from jobs.models import DeadLetter
from runs import engine, submission
from runs.erasure import erase_subject
from runs.errors import Fatal, IdempotencyConflict, InvalidInput
from runs.models import Receipt, Run, Step
from runs.personal import Known, Pii, seal_read
from runs.tools import tool
from runs.workflow import Workflow, register
from tests.engine_helpers import REFUND, drive
from tests.workflows import personal_sent

pytestmark = pytest.mark.django_db

EMAIL, NAME = "zelda.quist@example.org", "Zelda cus_pd1"
INPUT = {"customer_id": "cus_pd1", "email": EMAIL}


@pytest.fixture(autouse=True)
def _sent():
    personal_sent.clear()
    yield
    personal_sent.clear()


def everything_written(run: Run) -> str:
    """The run's rows, its steps, receipts, dead letters and audit entries, as text."""
    rows = [Run.objects.filter(pk=run.pk).values().get()]
    rows += list(Step.objects.filter(run=run).values())
    rows += list(Receipt.objects.filter(run=run).values())
    rows += list(DeadLetter.objects.filter(run_id=run.id).values())
    rows += list(AuditEntry.objects.filter(run_id=run.id).values())
    return json.dumps(rows, default=str)


def test_the_inputs_marked_fields_are_sealed_before_the_run_is_written():
    run, created = submission.submit(workflow="test_personal", input=INPUT)
    assert created
    stored = Run.objects.get(pk=run.pk).input
    assert stored["customer_id"] == "cus_pd1" and pii.is_ref(stored["email"])
    assert pii.reveal(stored["email"]) == EMAIL
    value = PiiValue.objects.get()
    assert (value.field, value.run_id, value.subject.subject) == ("input.email", run.id, "cus_pd1")
    assert EMAIL not in everything_written(run)


def test_a_resubmission_with_the_same_key_is_the_same_run_though_its_references_are_new():
    run, created = submission.submit(workflow="test_personal", input=INPUT, idempotency_key="pd-1")
    again, created_again = submission.submit(workflow="test_personal", input=INPUT, idempotency_key="pd-1")
    assert created and not created_again and again.id == run.id
    assert PiiValue.objects.count() == 1  # the second request's sealed value went with its refused INSERT
    with pytest.raises(IdempotencyConflict):
        submission.submit(workflow="test_personal", input={**INPUT, "email": "x@y.z"}, idempotency_key="pd-1")


def test_a_run_seals_its_read_opens_values_for_its_effect_and_keeps_only_references(demo):
    run = drive(submission.submit(workflow="test_personal", input=INPUT)[0])
    assert run.status == Run.Status.SUCCEEDED, run.error
    # The external system got the clear values...
    assert personal_sent == [{"to": EMAIL, "body": f"Dear {NAME}"}]
    # ...the run kept references: the read's output and tape, the effect's receipt and output.
    read = run.steps.get(name="profile")
    assert read.output["id"] == "cus_pd1" and pii.reveal(read.output["name"]) == NAME
    assert read.tape[0]["answer"]["name"] == read.output["name"]
    effect = run.steps.get(name="write_to_them")
    assert effect.output["accepted"] == run.input["email"]
    assert effect.output["echo"] == f"Dear {read.output['name']}"
    assert Receipt.objects.get(run=run).response == effect.output
    text = everything_written(run)
    assert EMAIL not in text and NAME not in text


def test_an_effects_error_quoting_clear_values_is_recorded_with_references(demo):
    run = drive(submission.submit(workflow="test_personal", input={**INPUT, "fail": True})[0])
    assert run.status == Run.Status.FAILED
    assert personal_sent and personal_sent[0]["to"] == EMAIL  # sent, refused by the system, quoting them
    step = run.steps.get(name="write_to_them")
    assert run.input["email"] in step.error and "refused" in step.error
    letter = DeadLetter.objects.get(run_id=run.id)
    assert run.input["email"] in letter.error
    text = everything_written(run)
    assert EMAIL not in text and NAME not in text


def test_a_wrong_or_missing_key_fails_the_step_with_its_message_and_sends_nothing(demo, settings):
    run, _ = submission.submit(workflow="test_personal", input=INPUT)
    settings.DEVELOPMENT = False
    settings.PII_KEYS = base64.b64encode(os.urandom(32)).decode()  # not the key that wrapped the subject's
    with pytest.raises(pii.KeyUnknown):
        engine.advance(run.id, engine.JobInfo())
    step = Step.objects.get(run=run, name="profile")
    assert step.status == Step.Status.FAILED and "PII_KEYS does not hold" in step.error
    settings.PII_KEYS = ""
    with pytest.raises(pii.KeysMissing):
        engine.advance(run.id, engine.JobInfo(attempts=1))
    step.refresh_from_db()
    assert "PII_KEYS is not set" in step.error
    assert personal_sent == [] and EMAIL not in everything_written(run)


def test_a_schema_that_marks_personal_data_without_a_subject_is_refused_at_registration():
    class NoSubject(BaseModel):
        email: str = Field(json_schema_extra={"x-pii": True})

    with pytest.raises(pii.SchemaError, match="x-pii-subject"):
        register(Workflow("test_personal_no_subject", input_schema=NoSubject))

    gated = Workflow("test_personal_gate_no_subject")
    gated.gate("email", proposal=NoSubject)(lambda ctx: None)
    with pytest.raises(pii.SchemaError):
        register(gated)

    class WithSubject(NoSubject):
        model_config = ConfigDict(json_schema_extra={"x-pii-subject": "customer_id"})

        customer_id: str

    assert Workflow("w", input_schema=WithSubject).personal_data() == ["input.email"]


def test_pii_declarations_are_checked():
    with pytest.raises(ValueError, match="tuple of dotted paths"):
        Pii(fields="email", subject="id")
    with pytest.raises(ValueError, match="identifies the person"):
        Pii(fields=("email",), subject="")
    with pytest.raises(ValueError, match="on a read tool"):
        tool(kind="effect", channel="email", pii=Pii(fields=("to",), subject="id"))(lambda ctx, to: {})
    with pytest.raises(ValueError, match="runs.personal.Pii"):
        Workflow("w").read(pii={"fields": ["x"]})
    assert Pii(fields=("name", "contact.email", "phones[]"), subject="id").schema() == {
        "type": "object",
        "x-pii-subject": "id",
        "properties": {
            "name": {"x-pii": True},
            "contact": {"properties": {"email": {"x-pii": True}}},
            "phones": {"items": {"x-pii": True}},
        },
    }


def test_a_read_without_its_subject_keeps_nothing_personal_and_an_answer_without_a_person_passes():
    declared, known = Pii(fields=("name",), subject="id"), Known()
    assert seal_read(declared, {"error": "not found"}, field="crm", run_id=None, known=known) == {"error": "not found"}
    with pytest.raises(Fatal, match="without its subject"):
        seal_read(declared, {"name": NAME}, field="crm", run_id=None, known=known)
    assert not PiiValue.objects.exists() and not known


def test_scrubbing_an_error_rewrites_its_chain():
    known = Known({EMAIL: "pii:" + "a" * 32})
    try:
        try:
            raise ValueError(f"bad {EMAIL}")
        except ValueError as inner:
            raise RuntimeError(f"send to {EMAIL} failed") from inner
    except RuntimeError as exc:
        known.scrub_error(exc)
        assert str(exc) == f"send to pii:{'a' * 32} failed" and str(exc.__cause__) == f"bad pii:{'a' * 32}"


def test_an_erased_subjects_new_run_is_refused_with_nothing_written():
    submission.submit(workflow="test_personal", input=INPUT)
    erase_subject("cus_pd1", by="tester")
    runs, values = Run.objects.count(), PiiValue.objects.count()
    with pytest.raises(InvalidInput) as refused:
        submission.submit(workflow="test_personal", input=INPUT)
    assert refused.value.errors[0]["loc"] == "input.customer_id" and "erased" in refused.value.errors[0]["msg"]
    assert (Run.objects.count(), PiiValue.objects.count()) == (runs, values)


def test_the_api_refuses_an_erased_subjects_new_run_with_a_422(demo, client):
    submission.submit(workflow="test_personal", input=INPUT)
    erase_subject("cus_pd1", by="tester")
    _, raw = ApiToken.issue(User.objects.get(username="agent"))
    response = client.post(
        "/api/runs",
        data=json.dumps({"workflow": "test_personal", "input": INPUT}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {raw}"},
    )
    assert response.status_code == 422 and "erased" in response.content.decode()
    assert EMAIL not in response.content.decode()


def test_erase_subject_cancels_the_parked_run_closes_its_card_and_keeps_the_audit_chain_whole(demo, capsys):
    customer = "cus_erase1"
    run = drive(submission.submit(workflow="refund", input={**REFUND, "customer_id": customer})[0])
    assert run.status == Run.Status.WAITING_HUMAN
    card = Approval.objects.get(run=run)
    to = card.proposed["email"]["to"]
    assert pii.is_ref(to) and pii.reveal(to) == f"{customer}@example.com"
    done_run = drive(submission.submit(workflow="refund", input={**REFUND, "customer_id": "cus_other"})[0])

    call_command("erase_subject", customer, "--reason", "GDPR art. 17 request #12")

    out = capsys.readouterr().out
    assert "key destroyed, 2 personal value(s) unreadable" in out and str(run.id) in out
    run.refresh_from_db()
    card.refresh_from_db()
    assert run.status == Run.Status.CANCELLED and "was erased: GDPR art. 17 request #12" in run.result["reason"]
    assert card.status == Approval.Status.CANCELLED
    assert pii.present(card.proposed)["email"]["to"] == pii.ERASED
    with pytest.raises(pii.Erased):
        pii.reveal(to)
    entry = AuditEntry.objects.get(action="pii.erase")
    assert entry.data["subject"] == customer and entry.data["values"] == 2
    assert entry.data["cancelled_runs"] == [str(run.id)] and entry.data["reason"] == "GDPR art. 17 request #12"
    assert list(AuditEntry.verify_chain()) == []
    call_command("audit_verify")
    assert Run.objects.get(pk=done_run.pk).status == Run.Status.WAITING_HUMAN  # another customer's: untouched

    call_command("erase_subject", customer)  # twice: nothing more to do
    assert "already erased" in capsys.readouterr().out
    with pytest.raises(CommandError, match="no personal data of subject 'cus_nobody'"):
        call_command("erase_subject", "cus_nobody")


def test_an_erased_subjects_run_that_only_names_them_ends_cancelled_at_its_read(demo):
    run = drive(submission.submit(workflow="refund", input={**REFUND, "customer_id": "cus_erase2"})[0])
    erase_subject("cus_erase2", by="tester")
    again = drive(submission.submit(workflow="refund", input={**REFUND, "customer_id": "cus_erase2"})[0])
    assert again.status == Run.Status.CANCELLED and "erased" in again.result["reason"]
    assert not PiiValue.objects.filter(run_id=again.id).exists()
    assert Run.objects.get(pk=run.pk).status == Run.Status.CANCELLED


def test_erasing_names_the_runs_of_the_subject_that_have_sealed_nothing_yet(demo):
    queued, _ = submission.submit(workflow="refund", input={**REFUND, "customer_id": "cus_erase3"})
    PiiSubject.objects.create(subject="cus_erase3", key_id="x", wrapped_key=b"x")
    done = erase_subject("cus_erase3", by="tester", reason="asked")
    assert done.cancelled == [str(queued.id)]
    queued.refresh_from_db()
    assert queued.status == Run.Status.CANCELLED and queued.result["reason"].endswith("was erased: asked")


def test_the_admin_action_erases_the_selected_subjects(demo, alice, client):
    run = drive(submission.submit(workflow="refund", input={**REFUND, "customer_id": "cus_erase4"})[0])
    client.force_login(alice)
    subject = PiiSubject.objects.get(subject="cus_erase4")
    page = client.get("/admin/core/piisubject/")
    assert page.status_code == 200 and b"cus_erase4" in page.content
    response = client.post(
        "/admin/core/piisubject/", {"action": "erase", "_selected_action": [subject.pk]}, follow=True
    )
    assert response.status_code == 200 and b"key destroyed" in response.content
    subject.refresh_from_db()
    assert subject.wrapped_key is None and subject.erased_by == alice.username
    assert Run.objects.get(pk=run.pk).status == Run.Status.CANCELLED
    assert AuditEntry.objects.get(action="pii.erase").actor == alice.username


def test_the_keys_check_errors_outside_development_when_a_workflow_marks_personal_data(settings):
    settings.DEVELOPMENT, settings.PII_KEYS = False, ""
    (error,) = check_pii_keys(None)
    assert error.id == "console.E002" and "PII_KEYS is not set" in error.msg and "test_personal" in error.msg
    settings.PII_KEYS = "not-a-key"
    assert "not the base64 encoding of 32 bytes" in check_pii_keys(None)[0].msg
    settings.PII_KEYS = base64.b64encode(os.urandom(32)).decode()
    assert check_pii_keys(None) == []
    settings.DEVELOPMENT, settings.PII_KEYS = True, ""
    assert check_pii_keys(None) == []


def test_no_clear_value_reaches_a_table(demo):
    """In-process, the system test's dump in miniature: every table's rows, as text, have neither the input's email
    nor the read's name; the vault holds them as ciphertext only."""
    run = drive(submission.submit(workflow="test_personal", input=INPUT)[0])
    assert run.status == Run.Status.SUCCEEDED
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        tables = [name for (name,) in cursor.fetchall()]
        for table in tables:
            cursor.execute(f'SELECT row_to_json(t)::text FROM "{table}" t')  # noqa: S608 - names from the catalog
            text = "\n".join(row for (row,) in cursor.fetchall())
            assert EMAIL not in text and NAME not in text, table
