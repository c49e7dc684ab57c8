"""Issue 24, defect 10: every outcome can be recorded.

- An agent's result (`POST /api/approval-requests/{id}/result`) may be any valid JSON: integers beyond 2**53
  (a snowflake id, 2**63+1) kept exactly, NUL characters in strings and keys (which PostgreSQL's jsonb cannot
  hold: stored as the result's JSON text, answered as the value), nesting far deeper than the rest of the API
  takes. The other fields of the API keep their rules.
- A person with `operate_channel` on the request's channel records the outcome of an execution whose outcome is
  unknown (consumed, no result) from the run page: once, audited; the agent's later result is then a conflict.
  Others who see the run get 403, others 404, and nothing changes."""

from __future__ import annotations

import json
import re
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from guardian.shortcuts import assign_perm

from core import safe_input
from core.models import AuditEntry, Channel
from external.models import ActionRequest
from runs.models import Receipt, Step
from tests.integration.external.test_external_requests import REFUND, Api, ask, decide, digest

BIG = 2**63 + 1
SNOWFLAKE = 1_234_567_890_123_456_789_012


@pytest.fixture
def agent(client, demo):
    return Api(client, demo["agent"])


@pytest.fixture
def reviewer(client, demo):
    return Api(client, demo["reviewer"])


@pytest.fixture
def consumed(agent, reviewer) -> dict:
    """An approved request whose approval the agent consumed: its outcome is unknown until someone records it."""
    request = ask(agent)[1]
    assert decide(reviewer, request["card_id"], "approve")[0] == 200
    code, go = agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(REFUND)})
    assert code == 200 and go["go"]
    assert Step.objects.get(run_id=request["run_id"], seq=0).status == "unknown"
    return request


def post_raw(agent: Api, path: str, text: str):
    response = agent.client.post(path, text, content_type="application/json", headers=agent.headers)
    return response.status_code, json.loads(response.content)


def nested(depth: int):
    """A value `depth` levels of objects and arrays deep."""
    value: object = "bottom"
    for level in range(depth):
        value = [value] if level % 2 else {"level": value}
    return value


# --- the agent's result: any JSON -------------------------------------------------------------------------------

ANY_JSON = {
    "2**63+1": BIG,
    "a snowflake id in an object": {"id": SNOWFLAKE, "ids": [BIG, -BIG], "ok": True},
    "a float written as a huge integer": {"n": 1.39e16},
    "a NUL in a string": {"text": "a\x00b", "list": ["\x00"]},
    "a NUL in a key": {"\x00key": 1, "nested": {"k\x00": [BIG]}},
    "a lone surrogate": {"text": "\ud800"},
    "nesting 33 deep": nested(33),
    "nesting 255 deep (with the body, the limit: 256)": nested(255),
}


@pytest.mark.parametrize("result", ANY_JSON.values(), ids=ANY_JSON.keys())
def test_any_json_result_is_recorded_exactly(agent, consumed, result):
    path = f"/api/approval-requests/{consumed['id']}"
    # Sent as JSON text exactly as a client writes it (json.dumps escapes the NUL and the surrogate).
    code, body = post_raw(agent, f"{path}/result", json.dumps({"ok": True, "result": result}))
    assert code == 200, body
    assert body["execution"]["status"] == "succeeded" and body["execution"]["result"] == result
    # Read back through GET, parsed by Python's json (exact integers): the same value, 2**63+1 to the digit.
    response = agent.client.get(path, headers=agent.headers)
    text = response.content.decode()
    assert json.loads(text)["execution"]["result"] == result
    if result == BIG:
        assert f'"result": {BIG}' in text or f'"result":{BIG}' in text
    # The same outcome again is answered as recorded; another one is the conflict.
    assert post_raw(agent, f"{path}/result", json.dumps({"ok": True, "result": result}))[0] == 200
    code, conflict = agent.post(f"{path}/result", {"ok": True, "result": "something else"})
    assert (code, conflict["error"], conflict["execution"]["result"]) == (409, "conflict", result)
    step = Step.objects.get(run_id=consumed["run_id"], seq=0)
    assert step.status == "done"
    (entry,) = AuditEntry.objects.filter(action="external.result", run_id=consumed["run_id"])
    assert entry.actor == "agent"
    call_command("audit_verify", stdout=StringIO())  # the entry was hashed as PostgreSQL stored it
    # Every page that shows it shows it (no 500 for a deep or a NUL-holding result).
    admin = page(User.objects.get(username="admin"))
    for url in (f"/runs/{consumed['run_id']}/", f"/approvals/{consumed['card_id']}/", "/audit/"):
        assert admin.get(url).status_code == 200, url


def test_a_big_integer_in_the_raw_text_round_trips_to_the_digit(agent, consumed):
    path = f"/api/approval-requests/{consumed['id']}"
    text = f'{{"ok": true, "result": {{"id": {BIG}, "snowflake": {SNOWFLAKE}, "neg": -{BIG}}}}}'
    code, body = post_raw(agent, f"{path}/result", text)
    assert code == 200, body
    raw = agent.client.get(path, headers=agent.headers).content.decode()
    assert str(BIG) in raw and str(SNOWFLAKE) in raw and f"-{BIG}" in raw
    assert "e+" not in raw.split('"result"')[1].split("}")[0]  # never a float
    stored = Receipt.objects.get(key=f"external:{consumed['id']}").response
    assert stored["result"] == {"id": BIG, "snowflake": SNOWFLAKE, "neg": -BIG}


def test_a_result_deeper_than_the_limit_is_refused_clearly_and_nothing_is_recorded(agent, consumed):
    path = f"/api/approval-requests/{consumed['id']}/result"
    code, body = agent.post(path, {"ok": True, "result": nested(safe_input.MAX_FREE_DEPTH + 5)})
    assert code == 422 and body["error"] == "invalid"
    assert f"nested deeper than {safe_input.MAX_FREE_DEPTH} levels" in json.dumps(body["detail"])
    assert body["detail"][0]["loc"].split(".")[0] == "result"  # named as sent (no body, body prefix)
    assert Receipt.objects.get(key=f"external:{consumed['id']}").status == "pending"


BAD_ELSEWHERE = {
    "an integer beyond 2**53 in a request's arguments": (
        "/api/approval-requests",
        {"channel": "payments", "action": "x", "arguments": {"n": BIG}, "idempotency_key": "big"},
    ),
    "a NUL in a request's arguments": (
        "/api/approval-requests",
        {"channel": "payments", "action": "x", "arguments": {"n": "a\x00"}, "idempotency_key": "nul"},
    ),
}


@pytest.mark.parametrize(("path", "body"), BAD_ELSEWHERE.values(), ids=BAD_ELSEWHERE.keys())
def test_the_rest_of_the_api_keeps_its_rules(agent, consumed, path, body):
    code, answer = agent.post(path, body)
    assert code == 422, answer
    assert ActionRequest.objects.count() == 1


def test_a_result_with_an_error_holding_a_nul_is_still_refused(agent, consumed):
    # The error is text the console shows and stores in text columns: its rules stay (the result is the JSON).
    code, _ = agent.post(f"/api/approval-requests/{consumed['id']}/result", {"ok": False, "error": "a\x00"})
    assert code == 422
    assert Receipt.objects.get(key=f"external:{consumed['id']}").status == "pending"


# --- a person records the outcome from the run page -------------------------------------------------------------


def page(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def text_of(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


def record(client: Client, request: dict, outcome: str, text: str):
    return client.post(f"/runs/{request['run_id']}/steps/0/outcome", {"outcome": outcome, "text": text})


def test_ops_record_a_success_with_a_note_once_and_the_agent_then_gets_the_conflict(demo, agent, consumed):
    ops = page(demo["ops"])
    run_page = text_of(ops.get(f"/runs/{consumed['run_id']}/"))
    assert "Record the outcome" in run_page and f'action="/runs/{consumed["run_id"]}/steps/0/outcome"' in run_page

    response = record(ops, consumed, "succeeded", "Refund re_9 seen in the payments dashboard.")
    assert response.status_code == 302 and response["Location"] == f"/runs/{consumed['run_id']}/"
    receipt = Receipt.objects.get(key=f"external:{consumed['id']}")
    assert receipt.status == "done" and receipt.reconciled
    assert receipt.response["ok"] is True and receipt.response["recorded_by"] == "ops"
    step = Step.objects.get(run_id=consumed["run_id"], seq=0)
    assert step.status == "done" and step.output["note"] == "Refund re_9 seen in the payments dashboard."
    (entry,) = AuditEntry.objects.filter(action="external.result", run_id=consumed["run_id"])
    assert (entry.actor, entry.actor_type) == ("ops", "human")
    assert entry.data["by_hand"] is True and entry.data["note"] == "Refund re_9 seen in the payments dashboard."
    assert entry.channel == "payments" and entry.target == f"action_request:{consumed['id']}"

    # What the agent reads: succeeded, recorded by a person.
    execution = agent.get(f"/api/approval-requests/{consumed['id']}")[1]["execution"]
    assert execution["status"] == "succeeded" and execution["recorded_by"] == "ops"
    assert execution["note"] == "Refund re_9 seen in the payments dashboard."
    # The page no longer offers it, and a second record is refused, changing nothing.
    assert "Record the outcome" not in text_of(ops.get(f"/runs/{consumed['run_id']}/"))
    again = record(ops, consumed, "failed", "No, it failed.")
    assert again.status_code == 409 and "recorded already" in text_of(again)
    assert Receipt.objects.get(pk=receipt.pk).response == receipt.response
    assert AuditEntry.objects.filter(action="external.result").count() == 1
    # The agent's result, arriving late, is the conflict answer with what is recorded.
    code, body = agent.post(f"/api/approval-requests/{consumed['id']}/result", {"ok": True, "result": {"id": "re_9"}})
    assert (code, body["error"], body["execution"]["recorded_by"]) == (409, "conflict", "ops")


def test_ops_record_a_failure_with_its_error(demo, agent, consumed):
    response = record(page(demo["ops"]), consumed, "failed", "The payment provider declined it: card expired.")
    assert response.status_code == 302
    execution = agent.get(f"/api/approval-requests/{consumed['id']}")[1]["execution"]
    assert (execution["status"], execution["error"]) == ("failed", "The payment provider declined it: card expired.")
    step = Step.objects.get(run_id=consumed["run_id"], seq=0)
    assert step.status == "failed" and step.error == "The payment provider declined it: card expired."
    (entry,) = AuditEntry.objects.filter(action="external.result")
    assert entry.data["ok"] is False and entry.data["error"] == "The payment provider declined it: card expired."


@pytest.mark.parametrize(
    ("outcome", "text", "error"),
    [
        ("succeeded", "", "Say how you know"),
        ("failed", "   ", "Say how you know"),
        ("maybe", "x", "succeeded or failed"),
        ("failed", "x" * 5001, "at most 5000"),
    ],
)
def test_a_bad_form_is_422_and_records_nothing(demo, consumed, outcome, text, error):
    response = record(page(demo["ops"]), consumed, outcome, text)
    assert response.status_code == 422 and error in text_of(response)
    assert Receipt.objects.get(key=f"external:{consumed['id']}").status == "pending"
    assert not AuditEntry.objects.filter(action="external.result").exists()


@pytest.mark.parametrize(("who", "status"), [("reviewer", 403), ("agent", 403), ("outsider", 404)])
def test_without_operate_channel_nothing_changes(demo, consumed, who, status):
    client = page(demo[who])
    if status == 403:
        assert "Record the outcome" not in text_of(client.get(f"/runs/{consumed['run_id']}/"))
    response = record(client, consumed, "succeeded", "I say it worked.")
    assert response.status_code == status
    assert Receipt.objects.get(key=f"external:{consumed['id']}").status == "pending"
    assert Step.objects.get(run_id=consumed["run_id"], seq=0).status == "unknown"
    assert not AuditEntry.objects.filter(action="external.result").exists()


def test_operate_channel_on_another_channel_is_not_enough(demo, consumed):
    """An ops person who operates only the email channel sees the run (ops see every run) and may not record an
    outcome on payments."""
    ops_email = User.objects.create_user("ops-email")
    ops_email.groups.add(*demo["ops"].groups.all())
    assign_perm("core.operate_channel", ops_email, Channel.objects.get(name="email"))
    client = page(ops_email)
    assert "Record the outcome" not in text_of(client.get(f"/runs/{consumed['run_id']}/"))
    assert record(client, consumed, "succeeded", "It worked.").status_code == 403
    assert Receipt.objects.get(key=f"external:{consumed['id']}").status == "pending"


def test_only_an_unknown_outcome_can_be_recorded(demo, agent, reviewer):
    request = ask(agent)[1]
    ops = page(demo["ops"])
    # Not consumed: nothing was executed, so there is no outcome to record.
    response = record(ops, request, "succeeded", "It worked.")
    assert response.status_code == 409 and "not consumed" in text_of(response)
    assert not Receipt.objects.exists()
    # A step that is no request's: 404.
    assert ops.post(f"/runs/{request['run_id']}/steps/7/outcome", {"outcome": "failed", "text": "x"}).status_code == 404


def test_what_python_cannot_carry_is_refused_naming_the_field(agent, consumed):
    path = f"/api/approval-requests/{consumed['id']}/result"
    huge = "9" * (safe_input.MAX_FREE_DIGITS + 1)
    for text, why in (
        (f'{{"ok": true, "result": {{"n": {huge}}}}}', "digits"),
        (f'{{"ok": true, "result": [{"9" * 400}.5]}}', "fraction"),
        ('{"ok": true, "result": NaN}', "NaN"),
    ):
        code, body = post_raw(agent, path, text)
        assert code == 422 and why in json.dumps(body["detail"]), body
        assert body["detail"][0]["loc"].split(".")[0] == "result"  # named as sent (no body, body prefix)
    assert Receipt.objects.get(key=f"external:{consumed['id']}").status == "pending"
    # 1e400 is an integer, which jsonb's numeric keeps to the digit.
    code, body = post_raw(agent, path, '{"ok": true, "result": {"n": 1e400, "x": 0.1}}')
    assert code == 200 and body["execution"]["result"] == {"n": 10**400, "x": 0.1}
