"""The OpenAPI document promises no more than the server takes: each body below is refused by the server (422,
nothing written) and is invalid against the document's own schema for it, so that a client generated from the
document cannot send it. And bodies the server takes are valid against it. (tests/system/test_api_fuzz.py checks
the same with generated input, against the production server.)"""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from approvals.models import Approval, Decision
from console.api import api
from core.models import ApiToken, AuditEntry, Channel, GlobalKillSwitch
from external import asks, executions, status
from runs import submission
from runs.models import Breaker, Receipt, Run
from tests.engine_helpers import REFUND, drive


@pytest.fixture
def demo(demo):
    """The demo's users, each with an API token (issued now: issuing one is audited)."""
    for user in demo.values():
        user.headers = {"Authorization": f"Bearer {ApiToken.issue(user)[1]}"}
    return demo


@pytest.fixture(scope="module")
def document() -> dict:
    return json.loads(json.dumps(api.get_openapi_schema()))


def body_validator(document: dict, method: str, path: str) -> jsonschema_rs.Validator:
    schema = document["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    # The body's schema, resolved against the document's components (other keywords of the document are ignored).
    return jsonschema_rs.Draft202012Validator({**document, **schema}, validate_formats=True)


def post(client, user, path: str, body) -> object:
    return client.post(path, data=json.dumps(body), content_type="application/json", headers=user.headers)


def test_the_document_has_no_key_twice_in_an_object(client):
    """JSON parsers keep the last of two equal keys; YAML parsers, Swagger UI's among them, refuse the document
    (a response keyed "422" beside ninja's 422 left /api/docs blank)."""

    def no_duplicates(pairs):
        keys = [key for key, _ in pairs]
        duplicated = sorted({key for key in keys if keys.count(key) > 1})
        assert not duplicated, f"keys given twice in one object: {duplicated}"
        return dict(pairs)

    json.loads(client.get("/api/openapi.json").content, object_pairs_hook=no_duplicates)


KILL_SWITCH_BODIES = {
    "empty reason": {"engaged": True, "reason": ""},
    "blank reason": {"engaged": True, "reason": " \t\n"},
    "a reason of what strip() removes and ECMA's \\s does not": {"engaged": True, "reason": "\x1c\x85"},
    "empty reason on release": {"engaged": False, "reason": ""},
    "a NUL in a key of an extra field": {"engaged": True, "reason": "drill", "note": {"a\x00b": 1}},
    "a NUL in the reason": {"engaged": True, "reason": "dri\x00ll"},
    "an integer beyond 2**53 in an extra field": {"engaged": True, "reason": "drill", "n": 2**53 + 1},
    "a float beyond 2**53 in an extra field": {"engaged": True, "reason": "drill", "n": -1.39e16},
    # Taken for a boolean before (pydantic's lax mode), a release: the API fuzzer's finding, 2026-12-06.
    "engaged as a number": {"engaged": 0.0, "reason": "drill"},
    "engaged as a string": {"engaged": "true", "reason": "drill"},
}


@pytest.mark.parametrize("body", KILL_SWITCH_BODIES.values(), ids=KILL_SWITCH_BODIES.keys())
@pytest.mark.parametrize("path", ["/api/kill-switch", "/api/channels/{name}/kill-switch"])
def test_a_kill_switch_body_the_server_refuses_is_invalid_in_the_document(client, demo, document, path, body):
    before = (AuditEntry.objects.count(), GlobalKillSwitch.load().kill_switch_engaged)
    response = post(client, demo["ops"], path.replace("{name}", "payments"), body)

    assert response.status_code == 422, response.content
    assert (AuditEntry.objects.count(), GlobalKillSwitch.load().kill_switch_engaged) == before
    assert not Channel.objects.get(name="payments").kill_switch_engaged
    assert not body_validator(document, "post", path).is_valid(body)


def test_a_kill_switch_body_the_server_takes_is_valid_in_the_document(client, demo, document):
    body = {"engaged": True, "reason": " drill ", "extra": {"ignored": [1, 2.5, None]}}
    assert body_validator(document, "post", "/api/kill-switch").is_valid(body)
    assert post(client, demo["ops"], "/api/kill-switch", body).status_code == 200


BREAKER_BODIES = {
    "empty reason": {"state": "open", "reason": ""},
    "blank reason": {"state": "closed", "reason": "\u3000"},
    "a NUL in a key": {"state": "open", "reason": "drill", "\x00": None},
}


@pytest.mark.parametrize("body", BREAKER_BODIES.values(), ids=BREAKER_BODIES.keys())
def test_a_breaker_body_the_server_refuses_is_invalid_in_the_document(client, demo, document, body):
    response = post(client, demo["ops"], "/api/breakers/payments", body)

    assert response.status_code == 422, response.content
    assert not Breaker.objects.filter(forced=True).exists()
    assert not AuditEntry.objects.filter(action__startswith="breaker.").exists()
    assert not body_validator(document, "post", "/api/breakers/{system}").is_valid(body)


RUN_BODIES = {
    "an empty cost limit": {"workflow": "refund", "input": REFUND, "cost_limit": ""},
    "a cost limit with 7 digits before the point": {"workflow": "refund", "input": REFUND, "cost_limit": "1234567"},
    "a cost limit with 7 decimals": {"workflow": "refund", "input": REFUND, "cost_limit": "0.0000001"},
    "a cost limit as a number": {"workflow": "refund", "input": REFUND, "cost_limit": 2.5},
    "a cost limit with a sign": {"workflow": "refund", "input": REFUND, "cost_limit": "+1"},
    "a cost limit with a newline": {"workflow": "refund", "input": REFUND, "cost_limit": "1\n"},
    "an unknown workflow": {"workflow": "", "input": {}},
    "an input that does not fit the workflow": {"workflow": "refund", "input": {}},
    "a currency that is no ISO 4217 code": {"workflow": "refund", "input": {**REFUND, "currency": "XYZ"}},
    "a NUL in a key of the input": {"workflow": "refund", "input": {**REFUND, "a\x00": 1}},
    "a NUL in a key of an extra field": {"workflow": "refund", "input": REFUND, "x": {"\x00": 1}},
    "an integer beyond 2**53 in an extra field": {"workflow": "refund", "input": REFUND, "x": [2**53 + 1]},
    "a float beyond 2**53 in an extra field": {"workflow": "refund", "input": REFUND, "x": 1.5e16},
    "a priority as a string": {"workflow": "refund", "input": REFUND, "priority": "5"},
}


@pytest.mark.parametrize("body", RUN_BODIES.values(), ids=RUN_BODIES.keys())
def test_a_run_body_the_server_refuses_is_invalid_in_the_document(client, demo, document, body):
    response = post(client, demo["agent"], "/api/runs", body)

    assert response.status_code == 422, response.content
    assert not Run.objects.exists()
    assert not body_validator(document, "post", "/api/runs").is_valid(body)


RUNS_TAKEN = {
    "a cost limit": ({"workflow": "refund", "input": REFUND, "cost_limit": "2.50"}, "2.500000"),
    "the largest cost limit": ({"workflow": "refund", "input": REFUND, "cost_limit": "999999.999999"}, "999999.999999"),
    "an integral float for a strict integer": (
        {"workflow": "refund", "input": {**REFUND, "amount_cents": 900.0}},
        None,
    ),
}


@pytest.mark.parametrize(("body", "cost_limit"), RUNS_TAKEN.values(), ids=RUNS_TAKEN.keys())
def test_a_run_body_the_server_takes_is_valid_in_the_document(client, demo, document, body, cost_limit):
    assert body_validator(document, "post", "/api/runs").is_valid(body)

    response = post(client, demo["agent"], "/api/runs", body)

    assert response.status_code == 202, response.content
    run = Run.objects.get()
    assert (str(run.cost_limit) if run.cost_limit is not None else None) == cost_limit
    assert run.input["amount_cents"] == int(body["input"]["amount_cents"])


@pytest.fixture
def card(demo) -> Approval:
    run, _ = submission.submit(workflow="refund", input=REFUND, created_by=demo["agent"])
    drive(run)
    return Approval.objects.get(run=run)


DECISION_BODIES = {
    "an edit without a payload": {"decision": "edit"},
    "an edit with a payload that is not an object": {"decision": "edit", "payload": None},
    "a rejection without a comment": {"decision": "reject"},
    "a rejection with a blank comment": {"decision": "reject", "comment": "\u2028 "},
    "a version beyond 2**53": {"decision": "approve", "version": 2**60},
    "a version as a string": {"decision": "approve", "version": "1"},
    "a NUL in a key of the payload": {"decision": "edit", "payload": {"\x00": 1}},
}


@pytest.mark.parametrize("body", DECISION_BODIES.values(), ids=DECISION_BODIES.keys())
def test_a_decision_body_the_server_refuses_is_invalid_in_the_document(client, demo, document, card, body):
    body = {"version": card.version, **body}
    response = post(client, demo["reviewer"], f"/api/approvals/{card.pk}/decision", body)

    assert response.status_code == 422, response.content
    assert not Decision.objects.exists()
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.PENDING
    assert not body_validator(document, "post", "/api/approvals/{card_id}/decision").is_valid(body)


def test_what_depends_on_the_card_is_documented_as_a_422(client, demo, document, card):
    """`agreement` on a card that is not shadow: valid against the schema (the card's kind is not in the request),
    so the operation says it, and declares the 422 it is answered with."""
    body = {"decision": "approve", "version": card.version, "agreement": "agree"}
    operation = document["paths"]["/api/approvals/{card_id}/decision"]["post"]

    assert body_validator(document, "post", "/api/approvals/{card_id}/decision").is_valid(body)
    response = post(client, demo["reviewer"], f"/api/approvals/{card.pk}/decision", body)

    assert response.status_code == 422 and "shadow" in response.json()["detail"]
    assert "shadow" in operation["description"] and "shadow" in operation["responses"]["422"]["description"]
    assert operation["responses"]["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorOut"
    }


@pytest.fixture
def consumed(demo, client):
    """An external agent's request, approved and consumed: its result is what the agent reports next."""
    request, _ = asks.open_request(
        demo["agent"], asks.Ask(channel="payments", action="refund", arguments={"n": 1}, idempotency_key="k")
    )
    request.card.decide(demo["reviewer"], "approve", version=request.card.version)
    executions.consume(demo["agent"], request.id, status.digest({"n": 1}))
    return request


RESULT_BODIES = {
    "a failure whose error is null": {"ok": False, "error": None},
    "a failure without its error": {"ok": False, "result": 1},
    "a failure with an empty error": {"ok": False, "error": ""},
    "a success with an error": {"ok": True, "error": "boom"},
    "a NUL in a failure's error": {"ok": False, "error": "a\x00"},
    "ok as a number": {"ok": 1, "result": 1},
    "ok as a string": {"ok": "true", "result": 1},
}


@pytest.mark.parametrize("body", RESULT_BODIES.values(), ids=RESULT_BODIES.keys())
def test_a_result_body_the_server_refuses_is_invalid_in_the_document(client, demo, document, consumed, body):
    response = post(client, demo["agent"], f"/api/approval-requests/{consumed.id}/result", body)

    assert response.status_code == 422, response.content
    assert Receipt.objects.get(key=f"external:{consumed.id}").status == Receipt.Status.PENDING  # nothing recorded
    assert not body_validator(document, "post", "/api/approval-requests/{request_id}/result").is_valid(body)


RESULTS_TAKEN = {
    "an object": {"ok": True, "result": {"refund_id": "re_1", "amounts": [1, 2.5]}},
    "a string": {"ok": True, "result": "done"},
    "null": {"ok": True, "result": None},
    "no result": {"ok": True},
    "a success whose error is null": {"ok": True, "result": 1, "error": None},
    "a failure": {"ok": False, "error": "card declined"},
    # A result is any valid JSON (issue 24, defect 10: tests/integration/external/test_external_results.py).
    "an integer beyond 2**53 in the result": {"ok": True, "result": {"n": 2**53 + 1}},
    "a float beyond 2**53 as the result": {"ok": True, "result": -1.39e16},
    "a NUL in the result": {"ok": True, "result": ["a\x00"]},
    "a NUL in a key of the result": {"ok": True, "result": {"\x00": 1}},
}


@pytest.mark.parametrize("body", RESULTS_TAKEN.values(), ids=RESULTS_TAKEN.keys())
def test_a_result_body_the_server_takes_is_valid_in_the_document(client, demo, document, consumed, body):
    assert body_validator(document, "post", "/api/approval-requests/{request_id}/result").is_valid(body)

    response = post(client, demo["agent"], f"/api/approval-requests/{consumed.id}/result", body)

    assert response.status_code == 200, response.content
