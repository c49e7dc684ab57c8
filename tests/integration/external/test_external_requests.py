"""Approval requests over the API (issue 19, external.api): an external agent asks for a person's sign-off on one
action; the card is in the inbox like any other; the agent consumes the approval once, with the arguments the
person approved, and reports the outcome. Driven through the API as the agent and the reviewer use it."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm
from procrastinate.contrib.django.models import ProcrastinateJob

from approvals import sla
from approvals.models import Approval, Notification
from core.models import ApiToken, AuditEntry, Channel
from external.models import ActionRequest
from runs.models import Receipt, Run, ShadowEffect, Step

REFUND = {"order_id": "ord_42", "amount_cents": 12_500, "currency": "EUR"}
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "amount_cents": {"type": "integer", "minimum": 1, "maximum": 20_000},
        "currency": {"type": "string", "enum": ["EUR", "USD"]},
    },
    "required": ["order_id", "amount_cents", "currency"],
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
def agent(client, demo):
    return Api(client, demo["agent"])


@pytest.fixture
def reviewer(client, demo):
    return Api(client, demo["reviewer"])


def ask(agent, key="refund-42", **fields):
    body = {
        "channel": "payments",
        "action": "refund_order",
        "arguments": REFUND,
        "current": {"order_id": "ord_42", "refunded_cents": 0},
        "rationale": {"summary": "The parcel never arrived.", "rule_id": "RF-3", "confidence": 0.9},
        "display": {"headline": "order_id", "amount_minor": "amount_cents", "currency": "currency"},
        "schema": SCHEMA,
        "idempotency_key": key,
        **fields,
    }
    return agent.post("/api/approval-requests", body)


def digest(arguments) -> str:
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def decide(reviewer, card_id, decision, **body):
    (card,) = [c for c in reviewer.get("/api/approvals")[1] if c["id"] == card_id]
    return reviewer.post(
        f"/api/approvals/{card_id}/decision", {"decision": decision, "version": card["version"], **body}
    )


def nothing_written(request_id) -> bool:
    request = ActionRequest.objects.get(pk=request_id)
    return request.receipt_id is None and not Receipt.objects.filter(key=f"external:{request_id}").exists()


def test_a_request_is_a_card_in_the_inbox_and_its_run_is_the_agents_timeline(agent, reviewer):
    status, body = ask(agent)
    assert status == 202 and body["status"] == "pending" and body["url"] == f"/api/approval-requests/{body['id']}"
    run = Run.objects.get(pk=body["run_id"])
    assert (run.status, run.workflow, run.created_by.username) == ("external", "external", "agent")
    (card,) = [c for c in reviewer.get("/api/approvals")[1] if c["run_id"] == body["run_id"]]
    assert card["id"] == body["card_id"] and card["proposed"] == REFUND and card["current"]["refunded_cents"] == 0
    assert (card["headline"], card["amount_minor"], card["currency"]) == ("ord_42", 12_500, "EUR")
    assert card["summary"] == "The parcel never arrived." and card["rule_id"] == "RF-3"
    assert [(s.name, s.status) for s in run.steps.all()] == [("refund_order", "waiting")]
    # A second request of the same session joins its run, as its next step.
    status, second = ask(agent, key="note-42", action="add_note", arguments={"text": "hi"}, schema=None,
                         display=None, run=body["run_id"])  # fmt: skip
    assert status == 202 and second["run_id"] == body["run_id"]
    assert list(run.steps.values_list("seq", "name")) == [(0, "refund_order"), (1, "add_note")]
    assert AuditEntry.objects.filter(action="external.request", run_id=run.id).count() == 2


def test_the_same_key_gives_the_same_request_and_another_request_under_it_is_refused(agent):
    first = ask(agent)[1]
    status, again = ask(agent)
    assert status == 200 and again["id"] == first["id"]
    # An agent re-run after a crash sees the world as it is now: the same action and arguments are the same request.
    status, rerun = ask(agent, current={"order_id": "ord_42", "refunded_cents": 12_500}, rationale="again")
    assert status == 200 and rerun["id"] == first["id"] and rerun["execution"]["status"] == "not_started"
    status, body = ask(agent, arguments={**REFUND, "amount_cents": 1})
    assert status == 409 and body["error"] == "conflict"
    assert ActionRequest.objects.count() == 1 and Approval.objects.count() == 1


@pytest.mark.parametrize(
    "fields, status, loc",
    [
        ({"channel": "nowhere"}, 404, None),
        ({"schema": {"type": "object", "properties": {"a": {"type": "not-a-type"}}}}, 422, "schema"),
        ({"arguments": {**REFUND, "amount_cents": 50_000}}, 422, "arguments.amount_cents"),
        ({"callback_url": "ftp://example.com/hook"}, 422, None),
        ({"callback_url": "http://testserver/api/runs"}, 422, "callback_url"),
        ({"run": "00000000-0000-0000-0000-000000000001"}, 404, None),
        ({"expires_in": 5}, 422, None),
        ({"action": "drop tables;"}, 422, None),
    ],
    ids=[
        "unknown channel",
        "bad schema",
        "arguments off schema",
        "not http",
        "the console",
        "no such run",
        "too short",
        "bad action",
    ],  # fmt: skip
)
def test_a_bad_request_is_refused_and_nothing_is_written(agent, fields, status, loc):
    code, body = ask(agent, **fields)
    assert code == status, body
    if loc:
        assert any(e["loc"] == loc for e in body["detail"]), body
    assert not ActionRequest.objects.exists() and not Approval.objects.exists()
    assert not Run.objects.filter(status="external").exists()


def test_a_token_without_request_channel_gets_403_and_another_users_run_is_not_found(client, demo, agent):
    remove_perm("core.request_channel", demo["agent"], Channel.objects.get(name="payments"))
    assert ask(agent)[0] == 403
    assert ask(agent, channel="email")[0] == 202  # its other channels still
    other = User.objects.create_user("bot")
    assign_perm("core.request_channel", other, Channel.objects.get(name="email"))
    run_id = ActionRequest.objects.get().run_id
    status, _ = ask(Api(client, other), channel="email", run=str(run_id))
    assert status == 404
    assert Api(client, other).get(f"/api/approval-requests/{ActionRequest.objects.get().id}")[0] == 404


def test_an_approved_request_is_consumed_once_with_the_edited_arguments(agent, reviewer):
    request = ask(agent)[1]
    assert agent.get(f"/api/approval-requests/{request['id']}")[1]["arguments"] is None  # nothing to run yet
    code, _ = agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(REFUND)})
    assert code == 409 and nothing_written(request["id"])  # not approved yet

    edited = {**REFUND, "amount_cents": 9_000}
    assert decide(reviewer, request["card_id"], "edit", payload=edited, comment="partial")[0] == 200
    code, state = agent.get(f"/api/approval-requests/{request['id']}")
    assert state["status"] == "approved" and state["edited"] and state["arguments"] == edited
    assert state["arguments_digest"] == digest(edited) and state["decided_by"] == "reviewer"
    assert state["comment"] == "partial" and state["execution"]["status"] == "not_started"

    # The digest of what the agent first asked is not the approval's.
    code, body = agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(REFUND)})
    assert (code, body["error"]) == (409, "digest_mismatch") and nothing_written(request["id"])
    code, go = agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(edited)})
    assert code == 200 and go["go"] and go["arguments"] == edited and go["execution"]["status"] == "pending"
    code, again = agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(edited)})
    assert (code, again["error"], again["execution"]["status"]) == (409, "already_consumed", "pending")
    assert Receipt.objects.filter(key=f"external:{request['id']}").count() == 1
    # Until the outcome comes, it is unknown: on the run's timeline too.
    assert Step.objects.get(run_id=request["run_id"]).status == "unknown"

    code, body = agent.post(f"/api/approval-requests/{request['id']}/result", {"ok": True, "result": {"id": "re_1"}})
    execution = body["execution"]
    assert code == 200 and execution["status"] == "succeeded" and execution["result"] == {"id": "re_1"}
    # The same outcome again is answered as recorded (a retry after a lost answer); another one is refused.
    assert (
        agent.post(f"/api/approval-requests/{request['id']}/result", {"ok": True, "result": {"id": "re_1"}})[0] == 200
    )
    code, body = agent.post(f"/api/approval-requests/{request['id']}/result", {"ok": False, "error": "boom"})
    assert code == 409 and body["execution"]["status"] == "succeeded"
    step = Step.objects.get(run_id=request["run_id"])
    assert (step.status, step.output) == ("done", {"result": {"id": "re_1"}})
    actions = list(AuditEntry.objects.filter(run_id=request["run_id"]).order_by("pk").values_list("action", flat=True))
    assert actions == ["external.request", "approval.edit", "external.consume", "external.result"]


def test_an_edit_must_fit_the_schema_and_a_request_without_one_cannot_be_edited(agent, reviewer):
    request = ask(agent)[1]
    code, body = decide(reviewer, request["card_id"], "edit", payload={**REFUND, "amount_cents": 50_000})
    assert code == 422 and any(e["loc"] == "amount_cents" for e in body["detail"]), body
    plain = ask(agent, key="plain", schema=None)[1]
    code, body = decide(reviewer, plain["card_id"], "edit", payload={**REFUND, "amount_cents": 1})
    assert code == 422 and "no schema" in json.dumps(body)
    assert decide(reviewer, plain["card_id"], "approve")[0] == 200  # approving it is fine
    assert Approval.objects.get(pk=request["card_id"]).status == "pending"


def test_a_rejection_reaches_the_agent_with_the_comment_and_nothing_can_run(agent, reviewer):
    request = ask(agent)[1]
    assert decide(reviewer, request["card_id"], "reject", comment="refunded by phone", reason="duplicate")[0] == 200
    state = agent.get(f"/api/approval-requests/{request['id']}")[1]
    assert (state["status"], state["comment"], state["reason"], state["arguments"]) == (
        "rejected",
        "refunded by phone",
        "duplicate",
        None,
    )
    code, body = agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(REFUND)})
    assert (code, body["error"]) == (409, "not_approved") and nothing_written(request["id"])
    assert Step.objects.get(run_id=request["run_id"]).output["decision"] == "rejected"


def test_a_consume_while_the_kill_switch_is_engaged_is_423_and_works_once_released(agent, reviewer, demo):
    request = ask(agent)[1]
    decide(reviewer, request["card_id"], "approve")
    payments = Channel.objects.get(name="payments")
    payments.engage_kill_switch(demo["ops"], "incident")
    code, body = agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(REFUND)})
    assert (code, body["error"]) == (423, "locked") and "incident" in body["detail"] and nothing_written(request["id"])
    payments.release_kill_switch(demo["ops"], "all clear")
    assert agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(REFUND)})[0] == 200


def test_a_result_before_consume_and_a_failure_without_its_error_are_refused(agent, reviewer):
    request = ask(agent)[1]
    decide(reviewer, request["card_id"], "approve")
    code, body = agent.post(f"/api/approval-requests/{request['id']}/result", {"ok": True, "result": 1})
    assert (code, body["error"]) == (409, "not_consumed")
    agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(REFUND)})
    assert agent.post(f"/api/approval-requests/{request['id']}/result", {"ok": False})[0] == 422
    code, body = agent.post(f"/api/approval-requests/{request['id']}/result", {"ok": False, "error": "declined"})
    assert (code, body["execution"]["status"], body["execution"]["error"]) == (200, "failed", "declined")
    assert Step.objects.get(run_id=request["run_id"]).status == "failed"


def test_two_person_channels_need_two_approvals_before_anything_can_run(agent, reviewer, client, demo):
    Channel.objects.filter(name="payments").update(required_approvals=2)
    rita = User.objects.create_user("rita")
    assign_perm("core.approve_channel", rita, Channel.objects.get(name="payments"))
    request = ask(agent)[1]
    decide(reviewer, request["card_id"], "approve")
    assert agent.get(f"/api/approval-requests/{request['id']}")[1]["status"] == "pending"
    decide(Api(client, rita), request["card_id"], "approve")
    state = agent.get(f"/api/approval-requests/{request['id']}")[1]
    assert state["status"] == "approved" and state["decided_by"] == "reviewer, rita"


def test_expiry_is_fail_closed_and_escalation_expires_at_the_next_deadline(agent):
    expiring = ask(agent, expires_in=60)[1]
    escalating = ask(agent, key="esc", expires_in=60, on_expiry="escalate")[1]
    later = timezone.now() + timedelta(seconds=61)
    assert sla.apply_sla(expiring["card_id"], later) == "expire"
    assert agent.get(f"/api/approval-requests/{expiring['id']}")[1]["status"] == "expired"
    assert sla.apply_sla(escalating["card_id"], later) == "escalate"
    card = Approval.objects.get(pk=escalating["card_id"])
    assert (
        card.status == "escalated" and agent.get(f"/api/approval-requests/{escalating['id']}")[1]["status"] == "pending"
    )
    assert sla.apply_sla(card.pk, card.due_at + timedelta(seconds=1)) == "expire"
    assert agent.get(f"/api/approval-requests/{escalating['id']}")[1]["status"] == "expired"
    code, _ = agent.post(f"/api/approval-requests/{expiring['id']}/consume", {"arguments_digest": digest(REFUND)})
    assert code == 409 and nothing_written(expiring["id"])
    assert AuditEntry.objects.filter(action="sla.expire").count() == 2


def test_a_shadow_request_is_recorded_and_never_run(agent, reviewer):
    Channel.objects.filter(name="payments").update(shadow=True)
    request = ask(agent)[1]
    assert decide(reviewer, request["card_id"], "approve", agreement="agree")[0] == 200
    code, go = agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(REFUND)})
    assert code == 200 and go["go"] is False and go["shadow"] is True and go["execution"]["status"] == "succeeded"
    assert ShadowEffect.objects.filter(key=f"external:{request['id']}").exists()


def test_cancelling_the_run_cancels_its_pending_requests(agent, demo, client):
    request = ask(agent)[1]
    code, _ = agent.post(f"/api/runs/{request['run_id']}/cancel", {})
    assert code == 200
    assert agent.get(f"/api/approval-requests/{request['id']}")[1]["status"] == "cancelled"
    assert ask(agent, key="after", run=request["run_id"])[0] == 409  # a cancelled session takes no more


def test_an_action_that_needs_no_person_has_no_card_and_still_runs_once(agent, demo):
    assert ask(agent, approval="never")[0] == 403  # only with act_unreviewed on the channel
    assign_perm("core.act_unreviewed", demo["agent"], Channel.objects.get(name="crm"))
    status, request = ask(agent, key="note", channel="crm", action="add_note", arguments={"text": "hi"}, schema=None,
                          display=None, approval="never")  # fmt: skip
    assert status == 202 and request["card_id"] is None and request["status"] == "approved"
    go = agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest({"text": "hi"})})
    assert go[0] == 200 and go[1]["go"]
    again = agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest({"text": "hi"})})
    assert again[0] == 409


def test_a_decision_is_posted_to_the_callback_with_its_job(agent, reviewer):
    request = ask(agent, callback_url="https://8.8.8.8/hooks/decisions")[1]
    decide(reviewer, request["card_id"], "approve")
    (notification,) = Notification.objects.filter(backend="callback")
    assert notification.payload["url"] == "https://8.8.8.8/hooks/decisions"
    assert notification.payload["body"]["status"] == "approved" and notification.payload["body"]["id"] == request["id"]
    assert ProcrastinateJob.objects.filter(task_name="approvals.tasks.send_notification").exists()


def test_a_consume_whose_answer_was_lost_is_answered_again_for_its_own_nonce_only(agent, reviewer):
    request = ask(agent)[1]
    decide(reviewer, request["card_id"], "approve")
    path = f"/api/approval-requests/{request['id']}/consume"
    first = agent.post(path, {"arguments_digest": digest(REFUND), "nonce": "attempt-1"})
    again = agent.post(path, {"arguments_digest": digest(REFUND), "nonce": "attempt-1"})
    assert first[0] == again[0] == 200 and first[1]["go"] and again[1]["go"]
    assert agent.post(path, {"arguments_digest": digest(REFUND), "nonce": "attempt-2"})[0] == 409
    assert agent.post(path, {"arguments_digest": digest(REFUND)})[0] == 409
    assert Receipt.objects.filter(key=f"external:{request['id']}").count() == 1
    agent.post(f"/api/approval-requests/{request['id']}/result", {"ok": True, "result": "done"})
    # Once the outcome is recorded, nobody gets a go, the same nonce included.
    assert agent.post(path, {"arguments_digest": digest(REFUND), "nonce": "attempt-1"})[0] == 409


@pytest.mark.parametrize("result", [{"id": "re_1"}, ["re_1", "re_2"], "re_1", 42, 1.5, True, None])
def test_a_result_is_answered_as_its_execution_and_may_be_any_json_value(agent, reviewer, result):
    # The contract: `200 {execution}`, the receipt under `execution` as in a consume's answer and a 409's body.
    request = ask(agent)[1]
    decide(reviewer, request["card_id"], "approve")
    agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(REFUND)})
    code, body = agent.post(f"/api/approval-requests/{request['id']}/result", {"ok": True, "result": result})
    assert code == 200 and set(body) == {"execution"}, body
    assert (body["execution"]["status"], body["execution"]["result"]) == ("succeeded", result)
    again = agent.post(f"/api/approval-requests/{request['id']}/result", {"ok": True, "result": result})
    assert again == (200, body)
    assert agent.get(f"/api/approval-requests/{request['id']}")[1]["execution"] == body["execution"]


def test_the_inbox_row_bulk_approves_only_what_it_shows_whatever_the_display_paths(client, demo, agent):
    """Issue 24: an agent's `display` paths choose the row's headline and amount. A request whose every argument is
    one of those is approved in bulk; one with another argument (or a current equal to its arguments, which does not
    hide them) is refused in bulk, its row saying what it leaves out; its card still shows everything."""
    shown = ask(agent, key="shown", current=None, schema=None)[1]
    hidden = ask(agent, key="hidden", current=None, schema=None, arguments={**REFUND, "iban": "XX00 1234 5678 9000"})[1]
    claimed = ask(agent, key="claimed", current=REFUND, schema=None, arguments={**REFUND, "note": "already done"})[1]
    client.force_login(demo["reviewer"])
    rows = client.get("/").content.decode()
    row = rows.split(f'id="row-{hidden["card_id"]}"', 1)[1].split("</tr>", 1)[0]
    assert "1 field not shown here" in row and "ord_42" in row and "125.00" in row
    row = rows.split(f'id="row-{claimed["card_id"]}"', 1)[1].split("</tr>", 1)[0]
    assert "1 field not shown here" in row
    row = rows.split(f'id="row-{shown["card_id"]}"', 1)[1].split("</tr>", 1)[0]
    assert "not shown here" not in row

    picked = [f"{r['card_id']}:1" for r in (shown, hidden, claimed)]
    response = client.post("/approvals/bulk", {"cards": picked, "decision": "approve"}, headers={"HX-Request": "true"})
    assert response.status_code == 200 and "1 of 3 cards decided" in response.content.decode()
    statuses = {r["id"]: agent.get(f"/api/approval-requests/{r['id']}")[1]["status"] for r in (shown, hidden, claimed)}
    assert statuses == {shown["id"]: "approved", hidden["id"]: "pending", claimed["id"]: "pending"}
    page = client.get(f"/approvals/{hidden['card_id']}/").content.decode()
    assert 'data-path="iban" data-op="added"' in page
