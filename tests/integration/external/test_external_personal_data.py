"""An external agent's personal data (issue 29): arguments its schema marks `x-pii` are sealed as the console keeps
them (the card, the request, the step, the audit log hold references; reviewers see masks), a mark without a
subject is refused with 422, and the agent gets the clear values back when it reads and consumes its decision."""

from __future__ import annotations

import base64
import hashlib
import json
import os

import pytest
from django.db import transaction
from procrastinate.contrib.django.models import ProcrastinateJob

from approvals.models import Approval, Notification
from core import outbound_url, pii
from core.models import ApiToken, AuditEntry, PiiValue
from external.callbacks import CallbackBackend
from external.models import ActionRequest
from runs.models import Receipt, Step

KEY = base64.b64encode(os.urandom(32)).decode()
EMAIL = "jane.doe@example.com"
ARGUMENTS = {"customer_id": "cus_7", "email": EMAIL, "amount_cents": 500}
SCHEMA = {
    "type": "object",
    "x-pii-subject": "customer_id",
    "properties": {
        "customer_id": {"type": "string"},
        "email": {"type": "string", "format": "email", "pattern": "^[^@]+@[^@]+$", "x-pii": True},
        "amount_cents": {"type": "integer", "minimum": 1},
    },
    "required": ["customer_id", "email", "amount_cents"],
    "additionalProperties": False,
}


class Api:
    def __init__(self, client, user):
        _, raw = ApiToken.issue(user)
        self.client, self.headers = client, {"Authorization": f"Bearer {raw}"}

    def get(self, path):
        response = self.client.get(path, headers=self.headers)
        return response.status_code, response.json()

    def post(self, path, body):
        response = self.client.post(path, json.dumps(body), content_type="application/json", headers=self.headers)
        return response.status_code, response.json()


@pytest.fixture
def agent(client, demo, settings):
    settings.PII_KEYS = KEY
    return Api(client, demo["agent"])


@pytest.fixture
def reviewer(client, demo):
    return Api(client, demo["reviewer"])


def ask(agent, key="refund-7", **fields):
    body = {
        "channel": "payments",
        "action": "refund_customer",
        "arguments": ARGUMENTS,
        "rationale": {"summary": "The customer asked."},
        "display": {"headline": "email"},
        "schema": SCHEMA,
        "idempotency_key": key,
        **fields,
    }
    return agent.post("/api/approval-requests", body)


def digest(arguments) -> str:
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def kept_nowhere_in_clear(request_id) -> None:
    request = ActionRequest.objects.get(pk=request_id)
    rows = [
        request.arguments,
        Approval.objects.filter(pk=request.card_id).values().get(),
        list(Step.objects.filter(run_id=request.run_id).values("input", "output")),
        list(AuditEntry.objects.filter(run_id=request.run_id).values("data")),
        list(Receipt.objects.filter(run_id=request.run_id).values()),
        list(Notification.objects.values("payload")),
        list(ProcrastinateJob.objects.values("args")),
    ]
    assert EMAIL not in json.dumps(rows, default=str)


def test_marked_arguments_are_kept_as_references_and_shown_masked(agent, reviewer):
    status, body = ask(agent)
    assert status == 202, body
    kept_nowhere_in_clear(body["id"])
    card = Approval.objects.get(pk=body["card_id"])
    ref = card.proposed["email"]
    assert pii.is_ref(ref) and pii.open(ref) == EMAIL and PiiValue.objects.get().subject.subject == "cus_7"
    assert ActionRequest.objects.get(pk=body["id"]).arguments["email"] == ref and card.headline == ref
    status, shown = reviewer.get(f"/api/approvals/{card.pk}")
    assert shown["proposed"]["email"] == "j***@example.com" and shown["headline"] == "j***@example.com"
    # The same ask again (an agent re-run) is the same request: its fingerprint is of what the agent sent.
    status, again = ask(agent)
    assert status == 200 and again["id"] == body["id"] and PiiValue.objects.count() == 1


def test_marks_without_a_subject_or_without_its_value_are_refused(agent):
    schema = {key: value for key, value in SCHEMA.items() if key != "x-pii-subject"}
    status, body = ask(agent, schema=schema)
    assert status == 422 and body["error"] == "invalid"
    assert any("x-pii-subject" in error["msg"] for error in body["detail"])
    status, body = ask(agent, key="k2", arguments={"email": EMAIL, "amount_cents": 5, "customer_id": ""})
    assert status == 422 and any(error["loc"] == "arguments.customer_id" for error in body["detail"])
    assert not ActionRequest.objects.exists() and not PiiValue.objects.exists()


def test_the_agent_gets_its_values_in_clear_to_execute_and_the_console_keeps_references(agent, reviewer, monkeypatch):
    status, body = ask(agent)
    card_id = body["card_id"]
    ActionRequest.objects.filter(pk=body["id"]).update(callback_url="https://agent.example.net/decisions")
    status, card = reviewer.get(f"/api/approvals/{card_id}")
    status, decided = reviewer.post(
        f"/api/approvals/{card_id}/decision", {"decision": "approve", "version": card["version"]}
    )
    assert status == 200, decided
    status, state = agent.get(f"/api/approval-requests/{body['id']}")
    assert state["status"] == "approved" and state["arguments"] == ARGUMENTS
    assert state["arguments_digest"] == digest(ARGUMENTS)
    status, go = agent.post(
        f"/api/approval-requests/{body['id']}/consume", {"arguments_digest": digest(ARGUMENTS), "nonce": "n1"}
    )
    assert status == 200 and go["go"] and go["arguments"] == ARGUMENTS
    kept_nowhere_in_clear(body["id"])  # the receipt's preview and the audit's consume hold references
    # The decision's callback waits in the outbox with references; it is sent with the agent's values in clear.
    (notification,) = Notification.objects.filter(event="external.decision")
    assert pii.is_ref(notification.payload["body"]["arguments"]["email"])
    sent = {}
    # The network only: the agent's endpoint is not there (the outbox, the database, are real).
    monkeypatch.setattr(outbound_url, "post", lambda url, body, headers, timeout: sent.update(body=json.loads(body)))
    CallbackBackend().send(notification)
    assert sent["body"]["arguments"] == ARGUMENTS


def test_an_edit_keeps_references_and_is_checked_on_the_values(agent, reviewer):
    status, body = ask(agent)
    card_id = body["card_id"]
    status, card = reviewer.get(f"/api/approvals/{card_id}")
    # As shown (masked), the amount lowered: the email's mask is its reference again, and fits the schema's pattern.
    payload = {**card["proposed"], "amount_cents": 400}
    status, decided = reviewer.post(
        f"/api/approvals/{card_id}/decision", {"decision": "edit", "version": card["version"], "payload": payload}
    )
    assert status == 200, decided
    status, state = agent.get(f"/api/approval-requests/{body['id']}")
    assert state["arguments"] == {**ARGUMENTS, "amount_cents": 400} and state["edited"]
    kept_nowhere_in_clear(body["id"])


def test_an_erased_subject_cannot_be_executed(agent, reviewer):
    status, body = ask(agent)
    status, card = reviewer.get(f"/api/approvals/{body['card_id']}")
    reviewer.post(f"/api/approvals/{body['card_id']}/decision", {"decision": "approve", "version": card["version"]})
    with transaction.atomic():
        pii.erase_key("cus_7", by="test")
    status, state = agent.get(f"/api/approval-requests/{body['id']}")
    assert state["arguments"]["email"] == "[erased]"
    status, refused = agent.post(
        f"/api/approval-requests/{body['id']}/consume", {"arguments_digest": state["arguments_digest"]}
    )
    assert status == 409 and "erased" in refused["detail"]
    assert ActionRequest.objects.get(pk=body["id"]).receipt_id is None


def test_a_marked_schema_whose_walk_grows_exponentially_is_refused_quickly(agent):
    # Each level: anyOf two references to the next, and a mark at the end: 2**30 paths to the mark.
    levels = {f"l{i}": {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}, {"$ref": f"#/$defs/l{i + 1}"}]} for i in range(30)}
    schema = {**SCHEMA, "$defs": {**levels, "l30": {"type": "string", "x-pii": True}}}
    schema["properties"] = {**SCHEMA["properties"], "code": {"$ref": "#/$defs/l0"}}
    status, body = ask(agent, schema=schema)
    assert status == 422 and any("too large" in error["msg"] for error in body["detail"]), body
    assert not ActionRequest.objects.exists()
