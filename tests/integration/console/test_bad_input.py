"""Bad input never reaches the database: NaN/Infinity, NUL characters, lone surrogates, deep nesting and huge
integers in JSON bodies (422 naming the field), NUL in paths, query strings, cookies and form fields (400), and
a value PostgreSQL refuses (DataError, 400). Never a 500 for anything a client sends."""

from __future__ import annotations

import json

import pytest
from django.db import DataError
from guardian.shortcuts import assign_perm

from approvals.models import Approval, Decision
from core.models import ApiToken, AuditEntry, Channel
from runs import submission
from runs.models import Run
from tests.engine_helpers import REFUND, drive
from tests.unit.test_safe_input import nested, runs_body

REFUND_JSON = json.dumps(REFUND)


def bearer(user) -> dict:
    _, raw = ApiToken.issue(user)
    return {"Authorization": f"Bearer {raw}"}


@pytest.fixture
def agent(demo):
    return bearer(demo["agent"])


@pytest.fixture
def card(demo) -> Approval:
    run, _ = submission.submit(workflow="refund", input=REFUND, created_by=demo["agent"])
    assert drive(run).status == Run.Status.WAITING_HUMAN
    return Approval.objects.get(run=run)


def post_json(client, path: str, body: str | bytes, headers: dict):
    return client.post(path, data=body, content_type="application/json", headers=headers)


# Each body as a client sends it (raw text: json.dumps would refuse or escape some of these), and the path
# to the field the 422 must name: one of each kind the parser refuses. Every case of the parser (core.safe_input):
# tests/unit/test_safe_input.py.
REFUSED_RUN_BODIES = {
    "NaN": (runs_body('{"customer_id": "c", "amount_cents": NaN}'), ["body", "input", "amount_cents"]),
    "NUL in a key": (runs_body('{"rea\\u0000son": "x"}'), ["body", "input"]),
    "NUL in a top-level value": ('{"workflow": "ref\\u0000und", "input": {}}', ["body", "workflow"]),
    "lone surrogate deep in a list": (runs_body('{"tags": ["ok", ["\\ud83d"]]}'), ["body", "input", "tags", 1, 0]),
    "integer beyond 2**53": (runs_body(f'{{"amount_cents": {2**53 + 1}}}'), ["body", "input", "amount_cents"]),
    "a float beyond 2**53 (an integer, to JSON)": (
        runs_body('{"amount_cents": 1e300}'),
        ["body", "input", "amount_cents"],
    ),
    "integer of 5000 digits": (runs_body('{"amount_cents": ' + "9" * 5000 + "}"), ["body", "input"]),
    "33 levels deep": (runs_body(nested(32)), ["body", "input"]),
    "far too deep for the parser": (runs_body("[" * 20_000 + "]" * 20_000), ["body"]),
}


@pytest.mark.parametrize(("body", "loc"), REFUSED_RUN_BODIES.values(), ids=REFUSED_RUN_BODIES.keys())
def test_it_refuses_a_run_body_with_422_naming_the_field(client, agent, body, loc):
    response = post_json(client, "/api/runs", body, agent)

    assert response.status_code == 422, response.content
    answer = response.json()
    assert set(answer) == {"error", "detail"}
    assert answer["error"] == "invalid"
    (problem,) = answer["detail"]
    assert problem["type"] == "unsafe_json"
    # Named as the client wrote it (the parser's root, "body", is not part of it), at or below `loc`.
    expected = ".".join(map(str, loc[1:])) or "body"
    assert problem["loc"] == expected or problem["loc"].startswith(expected + "."), problem["loc"]
    assert problem["msg"]
    assert not Run.objects.exists()


def test_it_refuses_raw_utf8_encoded_surrogates(client, agent):
    """json.loads decodes bytes with 'surrogatepass': a surrogate written as raw bytes gets through it."""
    body = runs_body('{"reason": "x"}').encode().replace(b'"x"', b'"\xed\xa0\x80"')

    response = post_json(client, "/api/runs", body, agent)

    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == "input.reason"
    assert not Run.objects.exists()


def test_text_that_is_not_json_stays_a_400(client, agent):
    response = post_json(client, "/api/runs", b'{"workflow": "refund", "input": \xff}', agent)

    assert response.status_code == 400
    assert response.json()["error"] == "bad_request"
    assert not Run.objects.exists()


def test_the_decision_api_refuses_a_nul_in_the_comment_and_the_card_stays_pending(client, demo, card):
    headers = bearer(demo["reviewer"])
    body = f'{{"decision": "reject", "reason": "policy", "comment": "no\\u0000", "version": {card.version}}}'

    response = post_json(client, f"/api/approvals/{card.pk}/decision", body, headers)

    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == "comment"
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING
    assert not Decision.objects.exists()


@pytest.mark.parametrize("payload", ['{"refund": {"amount_cents": NaN}}', '{"refund": {"note": "\\ud800"}}'])
def test_the_decision_api_refuses_a_bad_edit_payload(client, demo, card, payload):
    headers = bearer(demo["reviewer"])
    body = f'{{"decision": "edit", "payload": {payload}, "version": {card.version}}}'
    audit_before = AuditEntry.objects.count()

    response = post_json(client, f"/api/approvals/{card.pk}/decision", body, headers)

    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"].startswith("payload.refund.")
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING
    assert AuditEntry.objects.count() == audit_before


# --- query strings and paths of the API ---------------------------------------------------------------------

API_GETS = {
    "NUL in a query parameter": "/api/approvals?status=%00",
    "NUL in a query parameter's name": "/api/approvals?st%00atus=pending",
    "NUL in a path parameter": "/api/runs/%00",
    "NUL in the middle of a path": "/api/runs/ab%00cd",
}


@pytest.mark.parametrize("path", API_GETS.values(), ids=API_GETS.keys())
def test_the_api_answers_a_nul_in_the_url_with_400_json(client, agent, path):
    response = client.get(path, headers=agent)

    assert response.status_code == 400
    assert response["Content-Type"].startswith("application/json")
    answer = response.json()
    assert answer["error"] == "bad_request"
    assert "NUL" in answer["detail"]


def test_the_api_answers_a_nul_in_a_channel_name_with_400_json_and_changes_nothing(client, demo):
    headers = bearer(demo["ops"])
    body = json.dumps({"engaged": True, "reason": "test"})

    response = post_json(client, "/api/channels/pay%00ments/kill-switch", body, headers)

    assert response.status_code == 400
    assert response.json()["error"] == "bad_request"
    assert not Channel.objects.filter(kill_switch_engaged=True).exists()


def test_a_nul_in_a_header_is_400(client, agent):
    response = client.get("/api/me", headers={**agent, "X-Note": "a\x00b"})

    assert response.status_code == 400
    assert response.json()["error"] == "bad_request"


# --- console pages ------------------------------------------------------------------------------------------

CONSOLE_GETS = [
    "/?workflow=%00",
    "/?channel=%00",
    "/?after=%00",
    "/runs/?workflow=%00",
    "/runs/?status=%00",
    "/audit/?q=%00",
    "/audit/?actor=%00",
    "/channels/pay%00ments/kill-switch/",
    "/approvals/%00/",
]


@pytest.mark.parametrize("path", CONSOLE_GETS)
def test_console_pages_answer_a_nul_in_the_url_with_a_400_page(client, demo, path):
    client.force_login(demo["admin"])

    response = client.get(path)

    assert response.status_code == 400
    assert response["Content-Type"].startswith("text/html")
    assert "NUL character" in response.content.decode()


def test_a_nul_in_a_cookie_is_400_before_the_session_is_looked_up(client, demo):
    # Django unquotes "\000" in a quoted cookie value into a NUL.
    response = client.get("/", HTTP_COOKIE='sessionid="' + "\\000" * 8 + '"')

    assert response.status_code == 400


def test_a_nul_in_a_reject_comment_on_the_card_is_400_and_the_card_stays_pending(client, demo, card):
    client.force_login(demo["reviewer"])
    data = {"decision": "reject", "reason": "policy", "comment": "no\x00", "version": card.version}

    for headers in ({}, {"HX-Request": "true"}):
        response = client.post(f"/approvals/{card.pk}/decide", data, headers=headers)

        assert response.status_code == 400
        assert "NUL character" in response.content.decode()
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING
    assert not Decision.objects.exists()


def test_a_nul_in_a_bulk_decision_is_400(client, demo, card):
    client.force_login(demo["reviewer"])

    response = client.post("/approvals/bulk", {"ids": [card.pk], "decision": "reject", "comment": "\x00"})

    assert response.status_code == 400
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING


def test_a_nul_in_a_kill_switch_reason_is_400(client, demo):
    client.force_login(demo["ops"])
    assign_perm("core.operate_channel", demo["ops"], Channel.objects.get(name="payments"))

    response = client.post("/channels/payments/kill-switch/", {"engaged": "1", "reason": "x\x00"})

    assert response.status_code == 400
    assert not Channel.objects.filter(kill_switch_engaged=True).exists()


def test_a_nul_in_the_login_form_is_400(client, demo):
    response = client.post("/accounts/login/", {"username": "reviewer\x00", "password": "demo"})

    assert response.status_code == 400


# --- DataError ----------------------------------------------------------------------------------------------


def test_a_data_error_in_the_api_is_400_json(client, agent, monkeypatch):
    def refuse(**kwargs):
        raise DataError("value too long for type character varying(100)\n")

    monkeypatch.setattr(submission, "submit", refuse)

    response = post_json(client, "/api/runs", runs_body(REFUND_JSON), agent)

    assert response.status_code == 400
    answer = response.json()
    assert answer["error"] == "bad_request"
    assert "value too long" in answer["detail"]


# --- integers out of range in paths -------------------------------------------------------------------------


def test_an_id_beyond_bigint_in_an_api_path_is_a_4xx(client, demo, card):
    headers = bearer(demo["reviewer"])
    body = json.dumps({"decision": "approve", "version": 1})

    response = post_json(client, f"/api/approvals/{10**30}/decision", body, headers)

    assert 400 <= response.status_code < 500, response.content
    assert set(response.json()) == {"error", "detail"}


def test_an_id_beyond_bigint_in_a_console_path_is_a_404(client, demo):
    client.force_login(demo["admin"])

    assert client.get(f"/approvals/{10**30}/").status_code == 404
