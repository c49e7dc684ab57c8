"""The client's calls, one by one, against the fake console: request, get, wait, consume, report."""

from __future__ import annotations

from datetime import datetime, timezone

import httpx
import pytest
from conftest import BASE_URL
from fake_console import FakeConsole

from hitl_client import (
    AlreadyConsumed,
    ApprovalRequest,
    Client,
    Conflict,
    DigestMismatch,
    ExecutionStatus,
    NotApproved,
    NotConsumed,
    NotFound,
    RequestStatus,
    UnexpectedResponse,
    WaitTimeout,
    arguments_digest,
)

REFUND = {"order_id": "o-42", "amount_cents": 500}


def ask(client: Client, arguments=REFUND, key="order-42-refund", **fields) -> ApprovalRequest:
    return client.request_approval("payments", "refund", arguments, idempotency_key=key, rationale="late", **fields)


def test_request_wait_consume_report_round_trip(client, console):
    request = ask(client, current={"refunded_cents": 0}, risk="high", schema={"type": "object"})
    assert request.status is RequestStatus.PENDING and request.arguments is None
    assert request.execution.status is ExecutionStatus.NOT_STARTED and not request.shadow
    assert request.url == f"/api/approval-requests/{request.id}"
    assert console.calls("GET") == 0  # the POST's answer is the request's whole state
    assert console.only().body["current"] == {"refunded_cents": 0} and console.only().body["risk"] == "high"

    console.approves_while_waiting(by="bob")
    decision = client.wait(request.id, timeout=60)
    assert decision.status is RequestStatus.APPROVED and decision.decided_by == "bob"
    assert decision.arguments == REFUND and decision.arguments_digest == arguments_digest(REFUND)
    assert isinstance(decision.decided_at, datetime) and decision.decided_at.tzinfo == timezone.utc

    go = client.consume(request.id, arguments_digest(decision.arguments))
    assert go.arguments == REFUND and go.execution.status is ExecutionStatus.PENDING

    execution = client.report(request.id, ok=True, result={"refund_id": "r-1"})
    assert execution.status is ExecutionStatus.SUCCEEDED and execution.result == {"refund_id": "r-1"}
    assert client.get(request.id).execution.result == {"refund_id": "r-1"}


def test_fields_left_out_are_not_sent(client, console):
    ask(client)
    assert set(console.only().body) == {"channel", "action", "arguments", "idempotency_key", "rationale"}


def test_the_same_key_gives_back_the_same_request(client, console):
    first = ask(client)
    console.approve(first.id)
    again = ask(client)
    assert again.id == first.id and again.status is RequestStatus.APPROVED
    assert len(console.requests) == 1


def test_the_same_key_for_other_arguments_is_a_conflict(client, console):
    ask(client)
    with pytest.raises(Conflict) as raised:
        ask(client, arguments={**REFUND, "amount_cents": 50_000})
    assert (raised.value.status, raised.value.error) == (409, "conflict")
    assert len(console.requests) == 1


def test_wait_long_polls_until_a_decision(client, console):
    request = ask(client)
    polls = []

    def reviewer(fake):
        polls.append(fake.id)
        if len(polls) == 3:
            console.approve(fake.id)

    console.reviewer = reviewer
    assert client.wait(request.id, poll=7).status is RequestStatus.APPROVED
    assert len(polls) == 3
    waits = [path for method, path in console.seen if method == "GET"]
    assert len(waits) == 3  # the three long polls (the request's state came with the POST's answer)


def test_wait_sends_the_poll_as_the_long_polls_length(console):
    sent = []

    def handler(http: httpx.Request) -> httpx.Response:
        if http.method == "GET":
            sent.append(http.url.params["wait"])
        return console.handler(http)

    console.approves_while_waiting()
    with Client(BASE_URL, "tok-alice", transport=httpx.MockTransport(handler)) as client:
        client.wait(ask(client).id, timeout=3600, poll=42)
    assert sent == ["42"]


def test_wait_gives_up_after_its_timeout(client, console):
    request = ask(client)
    with pytest.raises(WaitTimeout) as raised:
        client.wait(request.id, timeout=0)
    assert isinstance(raised.value, TimeoutError)
    assert raised.value.request.id == request.id and raised.value.request.status is RequestStatus.PENDING
    console.approve(request.id)
    assert client.wait(request.id, timeout=0).status is RequestStatus.APPROVED


OUT_OF_RANGE = [
    lambda client, id: client.get(id, wait=61),
    lambda client, id: client.get(id, wait=-1),
    lambda client, id: client.wait(id, poll=0),
    lambda client, id: client.wait(id, poll=61),
]


@pytest.mark.parametrize("call", OUT_OF_RANGE)
def test_wait_lengths_outside_the_contract_are_refused_before_sending(client, console, call):
    request = ask(client)
    sent = len(console.seen)
    with pytest.raises(ValueError):
        call(client, request.id)
    assert len(console.seen) == sent


@pytest.mark.parametrize("status", ["rejected", "expired", "cancelled"])
def test_wait_returns_every_final_status(client, console, status):
    request = ask(client)
    decide = {
        "rejected": lambda id: console.reject(id, comment="no"),
        "expired": console.expire,
        "cancelled": console.cancel,
    }
    decide[status](request.id)
    decided = client.wait(request.id, timeout=0)
    assert decided.status.value == status and decided.arguments is None


def test_a_second_consume_is_already_consumed_with_the_receipt(client, console):
    request = ask(client)
    console.approve(request.id)
    client.consume(request.id, arguments_digest(REFUND))
    with pytest.raises(AlreadyConsumed) as raised:
        client.consume(request.id, arguments_digest(REFUND))  # another call: another nonce
    assert raised.value.status == 409
    assert raised.value.execution.status is ExecutionStatus.PENDING
    first, second = console.nonces
    assert first != second and len(first) == 32


def test_the_same_nonce_gets_the_same_go_until_an_outcome_is_reported(client, console):
    request = ask(client)
    console.approve(request.id)
    first = client.consume(request.id, arguments_digest(REFUND), nonce="attempt-1")
    again = client.consume(request.id, arguments_digest(REFUND), nonce="attempt-1")
    assert first.go and again.go and again.arguments == first.arguments == REFUND
    assert console.consumed_digests == [arguments_digest(REFUND)]  # one receipt
    client.report(request.id, ok=True, result="done")
    with pytest.raises(AlreadyConsumed) as raised:
        client.consume(request.id, arguments_digest(REFUND), nonce="attempt-1")
    assert raised.value.execution.status is ExecutionStatus.SUCCEEDED


def test_a_shadow_cards_consume_is_no_go(client, console):
    console.shadow_channels.add("payments")
    request = ask(client)
    assert request.shadow
    console.approve(request.id)
    go = client.consume(request.id, arguments_digest(REFUND))
    assert (go.go, go.shadow) == (False, True)
    assert go.execution.status is ExecutionStatus.SUCCEEDED and go.execution.result["shadow"] is True
    assert client.get(request.id).shadow


@pytest.mark.parametrize("result", [{"refund_id": "r-1"}, ["a", "b"], "done", 42, 0.5, False, None])
def test_a_result_may_be_any_json_value(client, console, result):
    request = ask(client)
    console.approve(request.id)
    client.consume(request.id, arguments_digest(REFUND))
    assert client.report(request.id, ok=True, result=result).result == result
    assert client.get(request.id).execution.result == result


def test_another_digest_is_refused_and_nothing_is_written(client, console):
    request = ask(client)
    console.approve(request.id, edit={**REFUND, "amount_cents": 300})
    with pytest.raises(DigestMismatch) as raised:
        client.consume(request.id, arguments_digest(REFUND))  # what was asked, not what was approved
    assert raised.value.error == "digest_mismatch"
    assert console.only().execution == "not_started"


def test_a_consume_before_the_decision_is_not_approved(client, console):
    request = ask(client)
    with pytest.raises(NotApproved, match="pending"):
        client.consume(request.id, arguments_digest(REFUND))
    assert console.only().execution == "not_started"


def test_a_result_before_consume_is_refused(client, console):
    request = ask(client)
    console.approve(request.id)
    with pytest.raises(NotConsumed):
        client.report(request.id, ok=True, result={})
    assert console.only().execution == "not_started"


def test_the_same_result_again_is_taken_and_another_is_a_conflict(client, console):
    request = ask(client)
    console.approve(request.id)
    client.consume(request.id, arguments_digest(REFUND))
    client.report(request.id, ok=False, error="card declined")
    assert client.report(request.id, ok=False, error="card declined").status is ExecutionStatus.FAILED
    with pytest.raises(Conflict):
        client.report(request.id, ok=True, result={"refund_id": "r-1"})
    assert console.only().error == "card declined"


def test_a_report_needs_an_error_text_when_not_ok(client):
    with pytest.raises(ValueError):
        client.report("x", ok=False)
    with pytest.raises(ValueError):
        client.report("x", ok=True, error="both")


def test_it_sends_the_token_and_never_shows_it(console):
    headers = []

    def handler(http: httpx.Request) -> httpx.Response:
        headers.append(http.headers)
        return console.handler(http)

    with Client(BASE_URL + "/", "tok-alice", transport=httpx.MockTransport(handler)) as client:
        request = ask(client)
        assert "tok-alice" not in repr(client) and "tok-alice" not in repr(request)
    assert headers[0]["Authorization"] == "Bearer tok-alice"
    assert headers[0]["User-Agent"].startswith("hitl-console-client")


def test_it_keeps_a_base_urls_path():
    paths = []

    def handler(http: httpx.Request) -> httpx.Response:
        paths.append(http.url.raw_path.split(b"?")[0])
        return httpx.Response(404, json={"error": "not_found", "detail": ""})

    transport = httpx.MockTransport(handler)
    with Client("http://proxy.test/console", "t", transport=transport) as client, pytest.raises(NotFound):
        client.get("a/b")  # an id is one path segment, whatever it holds
    assert paths == [b"/console/api/approval-requests/a%2Fb"]


# -- answers that are not the contract's --------------------------------------------------------------------


def _answering(body, status=200) -> Client:
    return Client(BASE_URL, "t", transport=httpx.MockTransport(lambda http: httpx.Response(status, json=body)))


def _valid(console: FakeConsole) -> dict:
    with Client(BASE_URL, "tok-alice", transport=httpx.MockTransport(console.handler)) as client:
        return console.representation(console.requests[ask(client).id])


@pytest.mark.parametrize(
    "change",
    [
        {"status": "maybe"},
        {"status": None},
        {"edited": "no"},
        {"arguments": ["not", "an", "object"]},
        {"decided_at": "yesterday"},
        {"comment": None},
        {"id": True},
        {"execution": {"status": "pending"}},
        {"execution": None},
    ],
)
def test_an_answer_that_breaks_the_contract_is_refused(console, change):
    body = {**_valid(console), **change}
    with _answering(body) as client, pytest.raises(UnexpectedResponse):
        client.get(body["id"] or "x")


@pytest.mark.parametrize("missing", ["status", "arguments", "execution", "expires_at", "edited"])
def test_an_answer_missing_a_field_is_refused(console, missing):
    body = _valid(console)
    del body[missing]
    with _answering(body) as client, pytest.raises(UnexpectedResponse, match=missing):
        client.get(body["id"])


def test_fields_the_contract_does_not_name_are_ignored(console):
    body = {**_valid(console), "sla_seconds": 60, "future_field": {"x": 1}}
    with _answering(body) as client:
        assert client.get(body["id"]).id == body["id"]


def test_an_answer_that_is_not_json_is_refused():
    transport = httpx.MockTransport(lambda http: httpx.Response(200, text="<html>hi</html>"))
    with Client(BASE_URL, "t", transport=transport) as client, pytest.raises(UnexpectedResponse):
        client.get("x")


@pytest.mark.parametrize(
    "flags",
    [
        {"go": False},  # no shadow: neither a go nor a shadow's no-go
        {"go": False, "shadow": False},
        {"go": True, "shadow": True},
        {"go": "yes", "shadow": False},
        {"go": True, "shadow": False, "arguments": None},
    ],
)
def test_a_consumes_answer_that_is_neither_a_go_nor_a_shadows_no_go_is_refused(client, console, flags):
    request = ask(client)
    console.approve(request.id)
    body = {
        "arguments": REFUND,
        "arguments_digest": arguments_digest(REFUND),
        "execution": console.only().execution_json(),
        **flags,
    }
    with _answering(body) as other, pytest.raises(UnexpectedResponse):
        other.consume(request.id, arguments_digest(REFUND))
