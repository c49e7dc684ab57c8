"""Issue 24's smaller items of the approvals API: the list's `pending` (cards waiting for a decision, escalated ones
included), `GET /api/approvals/{id}`, the card's `action`, the decision's reason taxonomy and the 422's field names."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group

from approvals import inbox, sla
from approvals.forms import RejectForm
from approvals.models import Approval, RejectReason
from console.api import api
from core import pii
from core.models import Channel
from tests.engine_helpers import REFUND
from tests.integration.approvals.test_api_approvals import bearer, decide, start_parked_run


def escalate(card: Approval) -> Approval:
    """The card's SLA runs out on a channel whose policy escalates (approvals.sla, as the timer applies it)."""
    group, _ = Group.objects.get_or_create(name="payments-leads")
    Channel.objects.filter(pk=card.channel_id).update(escalation_policy="escalate", escalation_group=group)
    assert sla.apply_sla(card.pk, card.due_at + timedelta(seconds=1)) == "escalate"
    card.refresh_from_db()
    assert card.status == Approval.Status.ESCALATED
    return card


# GET /api/approvals?status=pending: every card waiting for a decision


def test_pending_lists_escalated_cards_too_each_with_its_own_status(client, demo):
    _, waiting = start_parked_run(client, demo["agent"])
    _, overdue = start_parked_run(client, demo["agent"], {**REFUND, "customer_id": "cus_2001"})
    escalate(overdue)
    reviewer = bearer(demo["reviewer"])

    listed = client.get("/api/approvals?status=pending", headers=reviewer).json()
    default = client.get("/api/approvals", headers=reviewer).json()

    assert {(c["id"], c["status"]) for c in listed} == {(waiting.pk, "pending"), (overdue.pk, "escalated")}
    assert default == listed
    only_escalated = client.get("/api/approvals?status=escalated", headers=reviewer).json()
    assert [c["id"] for c in only_escalated] == [overdue.pk]


# GET /api/approvals/{id}: one card, as the list shows it, to whoever may see it


def test_one_card_reads_as_the_list_shows_it_with_its_action(client, demo):
    _, card = start_parked_run(client, demo["agent"])
    reviewer = bearer(demo["reviewer"])
    (listed,) = client.get("/api/approvals", headers=reviewer).json()

    response = client.get(f"/api/approvals/{card.pk}", headers=reviewer)

    assert response.status_code == 200, response.content
    one = response.json()
    assert {key: one[key] for key in listed} == listed  # the list's shape, and the same values
    assert one["action"] == listed["action"] == "approve_refund"  # the gate's step name
    for key in ("proposed", "current", "to_execute", "version", "due_at", "status", "policy_stage"):
        assert key in one
    # The customer's name and email are references on the card (core.pii), masked in every answer.
    assert (one["status"], one["version"], one["to_execute"]) == ("pending", card.version, pii.present(card.proposed))
    assert (one["may_decide"], one["why_not"]) == (True, None)


def test_the_runs_creator_sees_the_card_and_is_told_they_may_not_decide_it(client, demo):
    _, card = start_parked_run(client, demo["reviewer"])

    one = client.get(f"/api/approvals/{card.pk}", headers=bearer(demo["reviewer"])).json()

    assert one["id"] == card.pk and one["may_decide"] is False and "started" in one["why_not"]


@pytest.mark.parametrize("who", ["outsider", "ops"])
def test_who_may_not_see_a_card_gets_404_as_for_one_that_does_not_exist(client, demo, who):
    _, card = start_parked_run(client, demo["agent"])

    for path in (f"/api/approvals/{card.pk}", "/api/approvals/999999"):
        response = client.get(path, headers=bearer(demo[who]))
        assert (response.status_code, response.json()["error"]) == (404, "not_found")
    assert client.get(f"/api/approvals/{card.pk}").status_code == 401


def test_an_external_requests_card_names_its_action(client, demo):
    body = {
        "channel": "payments",
        "action": "refund_order",
        "arguments": {"order_id": "ord_42", "amount_cents": 12_500},
        "rationale": "The parcel never arrived.",
        "idempotency_key": "refund-42",
    }
    asked = client.post(
        "/api/approval-requests", json.dumps(body), content_type="application/json", headers=bearer(demo["agent"])
    )
    assert asked.status_code == 202, asked.content
    card_id = asked.json()["card_id"]
    reviewer = bearer(demo["reviewer"])

    (listed,) = client.get("/api/approvals", headers=reviewer).json()
    one = client.get(f"/api/approvals/{card_id}", headers=reviewer).json()

    assert listed["id"] == one["id"] == card_id
    assert listed["action"] == one["action"] == "refund_order"
    # The decision's answer is the same card, action included.
    decided = decide(client, reviewer, Approval.objects.get(pk=card_id), decision="approve")
    assert decided.status_code == 200 and decided.json()["action"] == "refund_order"


# POST /api/approvals/{id}/decision: a reason is one of the reject-reason taxonomy


@pytest.mark.parametrize("reason", ["because", "POLICY", ""])
def test_a_reason_outside_the_taxonomy_is_refused_with_422_naming_it(client, demo, reason):
    _, card = start_parked_run(client, demo["agent"])

    response = decide(client, demo["reviewer"], card, decision="reject", comment="no", reason=reason)

    assert response.status_code == 422, response.content
    assert response.json()["error"] == "invalid"
    assert "reason" in json.dumps(response.json()["detail"])
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING and not card.decisions.exists()


@pytest.mark.parametrize("reason", [*RejectReason.values, None])
def test_every_reason_of_the_taxonomy_is_taken_and_none_at_all(client, demo, reason):
    _, card = start_parked_run(client, demo["agent"])
    body = {"reason": reason} if reason is not None else {}

    response = decide(client, demo["reviewer"], card, decision="reject", comment="no", **body)

    assert response.status_code == 200, response.content
    assert card.decisions.get().reason == (reason or "")


def test_the_document_states_the_reasons_and_that_an_edit_replaces_the_proposal():
    document = json.loads(json.dumps(api.get_openapi_schema()))
    decision = document["components"]["schemas"]["DecisionIn"]["properties"]

    reasons = [option["enum"] for option in decision["reason"]["anyOf"] if "enum" in option]
    assert reasons == [RejectReason.values]
    assert "whole" in decision["payload"]["description"] and "proposed" in decision["payload"]["description"]


def test_the_web_forms_offer_the_same_reasons_as_the_api():
    """The card page's reject form (which email links open too) and the inbox's bulk reject: the same taxonomy. A
    decision from Slack carries no reason."""
    assert [value for value, _ in RejectForm().fields["reason"].choices if value] == RejectReason.values
    assert [value for value, _ in inbox.REJECT_REASONS] == RejectReason.values


# A 422 names each field as the client sent it: its dotted path in the body, or the parameter's name


def post_json(client, path: str, body: str, headers: dict):
    return client.post(path, data=body, content_type="application/json", headers=headers)


def locs(response) -> list:
    assert response.status_code == 422, response.content
    assert response.json()["error"] == "invalid"
    return [error["loc"] for error in response.json()["detail"]]


def test_a_run_body_422_names_its_fields_as_sent(client, demo):
    agent = bearer(demo["agent"])

    missing = post_json(client, "/api/runs", json.dumps({"input": {}}), agent)
    wrong_type = post_json(client, "/api/runs", json.dumps({"workflow": "refund", "input": [], "priority": "x"}), agent)
    unsafe = post_json(client, "/api/runs", '{"workflow": "refund", "input": {"tags": ["ok", "a\\u0000"]}}', agent)
    too_deep = post_json(client, "/api/runs", "[" * 20_000 + "]" * 20_000, agent)

    assert locs(missing) == ["workflow"]
    assert sorted(locs(wrong_type)) == ["input", "priority"]
    assert locs(unsafe) == ["input.tags.1"]
    assert locs(too_deep) == ["body"]  # the body as a whole


def test_a_decision_422_names_its_fields_as_sent_and_a_query_parameter_by_its_name(client, demo):
    _, card = start_parked_run(client, demo["agent"])
    reviewer = bearer(demo["reviewer"])
    path = f"/api/approvals/{card.pk}/decision"

    wrong = post_json(client, path, json.dumps({"decision": "maybe", "version": "latest"}), reviewer)
    edit = '{"decision": "edit", "payload": {"refund": {"note": "\\ud800"}}, "version": 1}'
    unsafe = post_json(client, path, edit, reviewer)

    assert sorted(locs(wrong)) == ["decision", "version"]
    assert locs(unsafe) == ["payload.refund.note"]
    assert locs(client.get("/api/approvals?status=maybe", headers=reviewer)) == ["status"]
    assert locs(client.get("/api/approvals/x", headers=reviewer)) == ["card_id"]


def test_a_card_read_past_its_deadline_has_its_deadline_applied_first(client, demo):
    """As a request's GET (external.status): the card never reads as waiting past its deadline because no timer
    job ran; here the channel's safe default rejects it."""
    _, card = start_parked_run(client, demo["agent"])
    Channel.objects.filter(pk=card.channel_id).update(escalation_policy="safe_default")
    Approval.objects.filter(pk=card.pk).update(due_at=card.due_at - timedelta(days=1))

    one = client.get(f"/api/approvals/{card.pk}", headers=bearer(demo["reviewer"])).json()

    assert (one["status"], one["may_decide"]) == ("rejected", False)
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.REJECTED
