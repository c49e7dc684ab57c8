"""Who sees personal data (issue 29, docs/personal-data.md): a card keeps references; every page and API
answer shows them masked; a holder of view_pii on the card's channel reveals them, one audit entry `pii.view` per
reveal; an erased subject's values read "[erased]"; a missing or wrong key is said, never shown in clear."""

from __future__ import annotations

import base64
import json
import os

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import transaction
from guardian.shortcuts import assign_perm

import tests.workflows  # noqa: F401 - the test workflows
from approvals import cards, personal
from approvals.models import Approval, Decision, Notification
from approvals.tasks import send_notification
from core import pii
from core.models import ApiToken, AuditEntry, Channel, PiiSubject, PiiValue
from runs import submission
from runs.gates import ApprovalRequest, Kind
from runs.models import Run, Step
from slackapp import posting
from tests.engine_helpers import REFUND, drive
from tests.integration.approvals.test_notify import Receiver, escalated_card

KEY = base64.b64encode(os.urandom(32)).decode()
EMAIL, NAME = "jane.doe@example.com", "Jane Doe"
HTMX = {"HX-Request": "true"}


@pytest.fixture
def keys(settings):
    settings.PII_KEYS = KEY
    settings.DEVELOPMENT = False
    return settings


@pytest.fixture
def channels(db):
    call_command("demo_setup", verbosity=0)
    return {c.name: c for c in Channel.objects.all()}


@pytest.fixture
def reviewer(channels):
    """Reviews payments; no view_pii."""
    user = User.objects.create_user("rev", password="password")
    assign_perm("core.approve_channel", user, channels["payments"])
    return user


@pytest.fixture
def holder(channels):
    """Reviews payments and holds view_pii there."""
    user = User.objects.create_user("holder", password="password")
    assign_perm("core.approve_channel", user, channels["payments"])
    assign_perm("core.view_pii", user, channels["payments"])
    return user


@pytest.fixture
def card(channels, keys) -> Approval:
    """A refund card whose proposal, summary and headline hold references to the customer's email and name."""
    agent = User.objects.get(username="agent")
    run, _ = submission.submit(workflow="refund", input=REFUND, created_by=agent)
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN
    card = Approval.objects.get(run=run)
    email = pii.seal(EMAIL, subject="cus_1042", field="customer.email", run_id=run.pk)
    name = pii.seal(NAME, subject="cus_1042", field="customer.name", run_id=run.pk)
    proposed = {**card.proposed, "email": {**card.proposed["email"], "to": email, "body": f"Dear {name},"}}
    Approval.objects.filter(pk=card.pk).update(
        proposed=proposed, summary=f"Refund for {name}", headline=f"Refund to {email}"
    )
    step = run.steps.get(seq=1)  # the customer's lookup: its output holds the reference too
    Step.objects.filter(pk=step.pk).update(output={**(step.output or {}), "email": email})
    card.refresh_from_db()
    card.refs = {"email": email, "name": name}
    return card


def api(client, user):
    _, raw = ApiToken.issue(user)
    return {"Authorization": f"Bearer {raw}"}


def assert_masked(text: str) -> None:
    assert EMAIL not in text and NAME not in text and "Jane" not in text
    assert "j***@example.com" in text and "J*** D***" in text
    assert "pii:" not in text  # not even the references: what a person reads is a mask


def test_a_reviewer_without_view_pii_sees_masks_on_the_page_the_inbox_and_the_api(client, card, reviewer):
    client.force_login(reviewer)
    page = client.get(f"/approvals/{card.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert_masked(html)
    assert "Reveal personal data" not in html
    inbox = client.get("/").content.decode()
    assert f"card-{card.pk}" in inbox or f"/approvals/{card.pk}/" in inbox
    assert_masked(inbox)
    headers = api(client, reviewer)
    one = client.get(f"/api/approvals/{card.pk}", headers=headers)
    assert one.status_code == 200
    assert_masked(one.content.decode())
    assert (
        one.json()["proposed"]["email"]["to"] == "j***@example.com" and one.json()["summary"] == "Refund for J*** D***"
    )
    assert_masked(client.get("/api/approvals", headers=headers).content.decode())
    # The run page and the run API are masked too (ops' view: masked for everyone; reveals are on the card).
    for text in (
        client.get(f"/runs/{card.run_id}/").content.decode(),
        client.get(f"/api/runs/{card.run_id}", headers=headers).content.decode(),
    ):
        assert EMAIL not in text and "j***@example.com" in text and "pii:" not in text
    # Nothing changed: the card keeps its references.
    card.refresh_from_db()
    assert card.proposed["email"]["to"] == card.refs["email"]


def test_reveal_without_view_pii_is_refused_and_not_audited(client, card, reviewer):
    client.force_login(reviewer)
    response = client.post(f"/approvals/{card.pk}/reveal", headers=HTMX)
    assert response.status_code == 403 and EMAIL not in response.content.decode()
    response = client.post(f"/api/approvals/{card.pk}/reveal", headers=api(client, reviewer))
    assert response.status_code == 403 and response.json()["error"] == "forbidden"
    assert EMAIL not in response.content.decode()
    assert not AuditEntry.objects.filter(action="pii.view").exists()


def test_a_holder_sees_masks_until_a_reveal_and_each_reveal_is_audited(client, card, holder):
    client.force_login(holder)
    html = client.get(f"/approvals/{card.pk}/").content.decode()
    assert_masked(html)
    assert "Reveal personal data" in html and f"/approvals/{card.pk}/reveal" in html
    assert not AuditEntry.objects.filter(action="pii.view").exists()  # a page view reveals nothing

    revealed = client.post(f"/approvals/{card.pk}/reveal", headers=HTMX)
    assert revealed.status_code == 200
    text = revealed.content.decode()
    assert EMAIL in text and NAME in text and "proposed.email.to" in text
    (entry,) = AuditEntry.objects.filter(action="pii.view")
    assert (entry.actor, entry.approval_id, entry.channel, entry.target) == (
        "holder",
        card.pk,
        "payments",
        f"approval:{card.pk}",
    )
    assert set(entry.data["fields"]) == {
        "proposed.email.to",
        "proposed.email.body",
        "current.email.to",  # the address on the customer's record (the demo's CRM read seals it)
        "summary",
        "headline",
    }
    # The card's references: the test's own, and the demo CRM read's sealed address in the card's current state.
    assert set(card.refs.values()) < set(entry.data["refs"]) == pii.refs_in([card.proposed, card.current, card.summary])
    assert EMAIL not in json.dumps(entry.data) and NAME not in json.dumps(entry.data)
    # The page itself is masked again afterwards.
    assert_masked(client.get(f"/approvals/{card.pk}/").content.decode())

    response = client.post(f"/api/approvals/{card.pk}/reveal", headers=api(client, holder))
    assert response.status_code == 200
    fields = {item["path"]: item for item in response.json()["fields"]}
    assert fields["proposed.email.to"]["value"] == EMAIL and fields["proposed.email.body"]["value"] == NAME
    assert fields["proposed.email.to"]["field"] == "customer.email" and not fields["proposed.email.to"]["erased"]
    assert AuditEntry.objects.filter(action="pii.view").count() == 2
    assert AuditEntry.objects.filter(action="pii.view").order_by("pk").last().data["via"] == "api"


def test_a_superuser_holds_view_pii_on_every_channel(client, card):
    admin = User.objects.create_superuser("root", password="password")
    assert client.post(f"/api/approvals/{card.pk}/reveal", headers=api(client, admin)).status_code == 200


def test_an_erased_subject_shows_erased_on_the_page_the_api_and_a_reveal(client, card, holder):
    with transaction.atomic():
        pii.erase_key("cus_1042", by="test")
    client.force_login(holder)
    html = client.get(f"/approvals/{card.pk}/").content.decode()
    assert "[erased]" in html and EMAIL not in html and "j***@example.com" not in html
    body = client.get(f"/api/approvals/{card.pk}", headers=api(client, holder)).json()
    assert body["proposed"]["email"]["to"] == "[erased]" and body["summary"] == "Refund for [erased]"
    revealed = client.post(f"/api/approvals/{card.pk}/reveal", headers=api(client, holder)).json()
    assert all(item["erased"] and item["value"] is None for item in revealed["fields"])


@pytest.mark.parametrize(
    ("setting", "code", "said"),
    [
        ("", "pii_keys_missing", "PII_KEYS is not set"),
        (base64.b64encode(os.urandom(32)).decode(), "pii_key_unknown", "its key is not in PII_KEYS"),
    ],
    ids=["missing", "another-key"],  # the same ids in every xdist worker
)
def test_a_missing_or_wrong_key_is_said_never_shown_in_clear(client, card, holder, settings, setting, code, said):
    settings.PII_KEYS = setting
    client.force_login(holder)
    page = client.get(f"/approvals/{card.pk}/")
    assert page.status_code == 200  # the card is shown; its personal values are not
    html = page.content.decode()
    assert f"[personal data unavailable: {said}]" in html
    assert EMAIL not in html and "Traceback" not in html and "pii:" not in html
    response = client.get(f"/api/approvals/{card.pk}", headers=api(client, holder))
    assert response.status_code == 503 and response.json()["error"] == code and EMAIL not in response.content.decode()
    reveal = client.post(f"/api/approvals/{card.pk}/reveal", headers=api(client, holder))
    assert reveal.status_code == 503 and reveal.json()["error"] == code
    assert client.post(f"/approvals/{card.pk}/reveal").status_code == 503
    assert not AuditEntry.objects.filter(action="pii.view").exists()


def test_a_wrong_key_of_the_same_id_is_unreadable(client, card, holder):
    # The subject's key wrapped by another key claiming the same id: a wrong key, never a guess.
    PiiSubject.objects.update(wrapped_key=os.urandom(60))
    client.force_login(holder)
    html = client.get(f"/approvals/{card.pk}/").content.decode()
    assert "[personal data unavailable: PII_KEYS holds a wrong key]" in html and EMAIL not in html


SCHEMA = {
    "type": "object",
    "x-pii-subject": "customer_id",
    "properties": {
        "customer_id": {"type": "string"},
        "email": {"type": "string", "x-pii": True},
        "note": {"type": "string"},
        "amount_cents": {"type": "integer"},
    },
}


def _spec(proposed, **fields) -> cards.CardSpec:
    question = ApprovalRequest(channel="payments", proposed=proposed)
    return cards.CardSpec(kind=Kind.ACTION, proposed=proposed, args_hash=question.args_hash(), schema=SCHEMA, **fields)


def test_open_card_seals_what_the_schema_marks_and_hashes_the_references(channels, keys):
    run = Run.objects.create(workflow="refund", workflow_version=1, input={}, status=Run.Status.WAITING_HUMAN)
    proposed = {"customer_id": "cus_9", "email": EMAIL, "note": f"write to {EMAIL}", "amount_cents": 5}
    spec = _spec(proposed, summary=f"Refund {EMAIL}", display={"headline": EMAIL, "amount_minor": 5, "currency": ""})
    card = cards.open_card(run, 0, channels["payments"], spec, policy=None)
    row = Approval.objects.filter(pk=card.pk).values().get()
    assert EMAIL not in json.dumps(row, default=str)
    ref = row["proposed"]["email"]
    assert pii.is_ref(ref) and pii.open(ref) == EMAIL
    assert row["proposed"]["note"] == f"write to {ref}" and row["summary"] == f"Refund {ref}" and row["headline"] == ref
    assert row["args_hash"] == ApprovalRequest(channel="payments", proposed=row["proposed"]).args_hash()
    assert row["args_hash"] != spec.args_hash
    assert PiiValue.objects.get().field == "email"
    # The same proposal asked again (a resumed gate) gets the same references: the same question, the same hash.
    again = personal.card_proposal(run.pk, proposed, SCHEMA)
    assert again == row["proposed"] and PiiValue.objects.count() == 1
    assert personal.card_proposal(run.pk, {**proposed, "email": "x@y.org"}, SCHEMA, create=False)["email"] == "x@y.org"


def test_open_card_refuses_marks_without_a_subject(channels, keys):
    run = Run.objects.create(workflow="refund", workflow_version=1, input={}, status=Run.Status.WAITING_HUMAN)
    spec = _spec({"email": EMAIL})
    with pytest.raises(pii.SchemaError):
        cards.open_card(run, 0, channels["payments"], spec, policy=None)
    assert not Approval.objects.exists()


def test_an_edit_keeps_references_whatever_view_it_comes_from(client, card, holder):
    ref = card.refs["email"]
    # As shown (masked), a new value of the amount: the mask is its reference again.
    shown = client.get(f"/api/approvals/{card.pk}", headers=api(client, holder)).json()
    payload = {**shown["proposed"], "refund": {**shown["proposed"]["refund"], "amount_cents": 100}}
    response = client.post(
        f"/api/approvals/{card.pk}/decision",
        json.dumps({"decision": "edit", "version": shown["version"], "payload": payload, "comment": "less"}),
        content_type="application/json",
        headers=api(client, holder),
    )
    assert response.status_code == 200, response.content
    edit = Decision.objects.get(approval=card, decision="edit")
    assert edit.payload["email"]["to"] == ref and edit.payload["email"]["body"] == f"Dear {card.refs['name']},"
    assert edit.payload["refund"]["amount_cents"] == 100
    # A clear value typed back in is scrubbed to its reference.
    typed = {**card.proposed, "email": {**card.proposed["email"], "to": EMAIL, "body": f"Dear {NAME}, sorry"}}
    kept = personal.keep_personal(card, typed)
    assert kept["email"]["to"] == ref and kept["email"]["body"] == f"Dear {card.refs['name']}, sorry"


def test_slack_and_email_never_reveal(card, holder):
    view = posting.view_of(card)
    text = json.dumps([view.headline, view.summary, [str(c) for c in view.changes]], default=str)
    assert EMAIL not in text and NAME not in text and "j***@example.com" in view.headline
    assert view.summary == "Refund for J*** D***"


def test_the_edit_form_shows_masks_and_an_edit_left_masked_keeps_the_references(client, card, holder):
    client.force_login(holder)
    html = client.get(f"/approvals/{card.pk}/").content.decode()
    assert "Dear J*** D***," in html  # the editable body, as the form shows it
    fields = {
        "decision": "edit",
        "version": card.version,
        "p:refund.amount_cents": 100,
        "p:refund.currency": card.proposed["refund"]["currency"],
        "p:email.subject": card.proposed["email"]["subject"],
        "p:email.body": "Dear J*** D***, sorry",
        "comment": "less",
    }
    response = client.post(f"/approvals/{card.pk}/decide", fields, headers=HTMX)
    assert response.status_code == 200, response.content.decode()[:2000]
    edit = Decision.objects.get(approval=card, decision="edit")
    assert edit.payload["email"]["body"] == f"Dear {card.refs['name']}, sorry"
    assert edit.payload["email"]["to"] == card.refs["email"]
    assert_masked(response.content.decode())


def test_escalation_emails_and_the_webhook_show_masks(card, settings, mailoutbox):
    receiver = Receiver()
    try:
        settings.NOTIFY_BACKENDS = ["email", "webhook"]
        settings.NOTIFY_WEBHOOK_URL, settings.NOTIFY_WEBHOOK_SECRET = receiver.url, "secret"
        escalated = escalated_card()
        for notification in Notification.objects.filter(approval=escalated):
            # The card's summary as the notification carries it, with the customer's references in it.
            notification.payload = {**notification.payload, "summary": f"Refund to {card.refs['email']}"}
            notification.save(update_fields=["payload"])
            assert send_notification(notification_id=notification.pk) == "sent"
        (request,) = receiver.requests
        sent = [request["body"].decode(), *(m.body for m in mailoutbox), *(m.alternatives[0][0] for m in mailoutbox)]
        assert mailoutbox and all(EMAIL not in text and "pii:" not in text for text in sent)
        assert "j***@example.com" in sent[0]
    finally:
        receiver.close()
