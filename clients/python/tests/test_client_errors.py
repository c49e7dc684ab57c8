"""The console's refusals as exceptions, and which calls are repeated after a failure (only the safe ones)."""

from __future__ import annotations

import httpx
import pytest
from conftest import BASE_URL

from hitl_client import (
    AlreadyConsumed,
    ApiError,
    Client,
    Conflict,
    ConnectionFailed,
    DigestMismatch,
    ExecutionStatus,
    Forbidden,
    Invalid,
    Locked,
    NotApproved,
    NotConsumed,
    NotFound,
    RateLimited,
    RequestStatus,
    ServerError,
    Unauthorized,
    arguments_digest,
)
from hitl_client._protocol import Sleep

REFUND = {"order_id": "o-42", "amount_cents": 500}
DIGEST = arguments_digest(REFUND)


def ask(client, channel="payments", **fields):
    fields = {"idempotency_key": "k-1", "rationale": "late", **fields}
    return client.request_approval(channel, "refund", REFUND, **fields)


def answering(status, body, headers=None) -> Client:
    def handler(http):
        return httpx.Response(status, json=body, headers=headers) if body is not None else httpx.Response(status)

    return Client(BASE_URL, "t", transport=httpx.MockTransport(handler), backoff=0, retries=0)


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (400, "bad_request", Invalid),
        (401, "unauthorized", Unauthorized),
        (403, "forbidden", Forbidden),
        (404, "not_found", NotFound),
        (409, "conflict", Conflict),
        (409, "digest_mismatch", DigestMismatch),
        (409, "not_approved", NotApproved),
        (409, "not_consumed", NotConsumed),
        (409, "already_consumed", AlreadyConsumed),
        (409, "something_new", Conflict),
        (413, "too_large", Invalid),
        (422, "invalid", Invalid),
        (423, "locked", Locked),
        (429, "too_many_requests", RateLimited),
        (500, "error", ServerError),
        (503, "database_unavailable", ServerError),
        (418, "teapot", ApiError),
    ],
)
def test_each_refusal_is_its_exception_with_status_code_and_detail(status, code, kind):
    with answering(status, {"error": code, "detail": "why"}) as client, pytest.raises(kind) as raised:
        client.consume("r-1", DIGEST)
    assert type(raised.value) is kind
    assert (raised.value.status, raised.value.error, raised.value.detail) == (status, code, "why")
    assert f"{status} {code}: why" in str(raised.value)


def test_conflicts_are_all_caught_as_conflict():
    assert all(issubclass(kind, Conflict) for kind in (AlreadyConsumed, DigestMismatch, NotApproved, NotConsumed))


def test_field_errors_are_the_detail_as_sent():
    errors = [{"loc": ["body", "action"], "msg": "bad"}]
    with answering(422, {"error": "invalid", "detail": errors}) as client, pytest.raises(Invalid) as raised:
        ask(client)
    assert raised.value.detail == errors


def test_an_error_page_that_is_not_the_consoles_still_raises_with_its_status():
    transport = httpx.MockTransport(lambda http: httpx.Response(502, text="<html>Bad gateway</html>"))
    with Client(BASE_URL, "t", transport=transport, retries=0) as client, pytest.raises(ServerError) as raised:
        client.get("r-1")
    assert (raised.value.status, raised.value.error) == (502, "http_502")
    assert "Bad gateway" in raised.value.detail


def test_a_bad_token_is_unauthorized(console):
    transport = httpx.MockTransport(console.handler)
    with Client(BASE_URL, "tok-wrong", transport=transport) as client, pytest.raises(Unauthorized):
        ask(client)
    assert not console.requests


def test_a_channel_without_request_channel_is_forbidden(client, console):
    with pytest.raises(Forbidden):
        ask(client, channel="email")
    assert not console.requests


def test_an_unknown_channel_is_not_found(client, console):
    with pytest.raises(NotFound):
        ask(client, channel="nowhere")
    assert not console.requests


@pytest.mark.parametrize(
    "fields",
    [
        {"idempotency_key": ""},
        {"idempotency_key": "k" * 201},
        {"expires_in": 59},
        {"callback_url": "ftp://example.com/hook"},
        {"risk": "extreme"},
        {"on_expiry": "approve"},
    ],
)
def test_invalid_fields_are_refused_and_nothing_is_made(client, console, fields):
    with pytest.raises(Invalid):
        ask(client, **fields)
    assert not console.requests


def test_an_action_name_outside_the_contract_is_invalid(client, console):
    with pytest.raises(Invalid):
        client.request_approval("payments", "refund order!", REFUND, idempotency_key="k", rationale="r")
    assert not console.requests


def test_arguments_that_are_not_an_object_are_refused_before_sending(client, console):
    with pytest.raises(TypeError):
        client.request_approval("payments", "refund", ["o-42"], idempotency_key="k", rationale="r")
    assert not console.seen


# -- retries: only what is safe to repeat --------------------------------------------------------------------


def test_a_get_is_retried_after_a_5xx_and_a_broken_connection(client, console):
    request = ask(client)
    console.fail("GET", request.id, 503)
    console.fail("GET", request.id, "drop_request")
    assert client.get(request.id).id == request.id
    assert console.calls("GET", request.id) == 3  # 503, dropped, answered


def test_a_get_gives_up_after_its_retries(console):
    transport = httpx.MockTransport(console.handler)
    with Client(BASE_URL, "tok-alice", transport=transport, backoff=0, max_backoff=0, retries=2) as client:
        request = ask(client)
        console.fail("GET", request.id, 503, times=10)
        with pytest.raises(ServerError):
            client.get(request.id)
    assert console.calls("GET", request.id) == 1 + 2  # one try and 2 retries


def test_a_broken_connection_after_the_retries_is_connection_failed(client, console):
    request = ask(client)
    console.fail("GET", request.id, "drop_request", times=10)
    with pytest.raises(ConnectionFailed) as raised:
        client.get(request.id)
    assert isinstance(raised.value.__cause__, httpx.ConnectError)


def test_a_request_whose_answer_was_lost_is_asked_again_and_is_the_same(client, console):
    console.fail("POST", "/api/approval-requests", "drop_answer")
    request = ask(client)
    assert console.calls("POST", "/api/approval-requests") == 2
    assert list(console.requests) == [request.id]


def test_a_429_is_retried_after_its_retry_after(console):
    slept = []
    transport = httpx.MockTransport(console.handler)
    with Client(BASE_URL, "tok-alice", transport=transport, backoff=0, max_backoff=0.002) as client:
        client._do = _recording_sleeps(client._do, slept)
        request = ask(client)
        console.fail("GET", request.id, 429)
        assert client.get(request.id).id == request.id
    assert slept == [0.002]  # Retry-After would be 1 s; capped by max_backoff


def _recording_sleeps(do, slept):
    def recording(op):
        if isinstance(op, Sleep):
            slept.append(op.seconds)
        return do(op)

    return recording


def test_a_consume_after_a_5xx_is_sent_again_under_the_same_nonce_up_to_the_retries(client, console):
    request = ask(client)
    console.approve(request.id)
    console.fail("POST", "/consume", 500, times=10)
    with pytest.raises(ServerError):
        client.consume(request.id, DIGEST)
    assert console.calls("POST", "/consume") == 1 + 4 and console.calls("GET") == 0
    assert console.only().execution == "not_started"


def test_a_consume_that_never_arrived_is_sent_again(client, console):
    request = ask(client)
    console.approve(request.id)
    console.fail("POST", "/consume", "drop_request")
    go = client.consume(request.id, DIGEST)
    assert go.arguments == REFUND
    assert console.calls("POST", "/consume") == 2
    assert console.only().execution == "pending"


def test_a_consume_whose_answer_was_lost_is_sent_again_under_its_nonce_and_gets_the_same_go(client, console):
    request = ask(client)
    console.approve(request.id)
    console.fail("POST", "/consume", "drop_answer")
    go = client.consume(request.id, DIGEST)
    assert go.go and go.arguments == REFUND and go.execution.status is ExecutionStatus.PENDING
    # The console took the first, and gave the same go to the second under the same nonce: one receipt.
    assert console.calls("POST", "/consume") == 2 and console.consumed_digests == [DIGEST]
    first, again = console.nonces
    assert first == again


def test_a_consume_whose_answer_was_lost_and_another_process_took_the_go_is_already_consumed(client, console):
    request = ask(client)
    console.approve(request.id)
    console.fail("POST", "/consume", "drop_request")
    console.before_consume = console.consumed_by_another  # as the retry arrives (the first never did)
    with pytest.raises(AlreadyConsumed) as raised:
        client.consume(request.id, DIGEST)
    assert raised.value.execution.status is ExecutionStatus.PENDING
    assert console.consumed_digests == []


def test_a_locked_consume_is_not_retried_and_writes_nothing(client, console):
    request = ask(client)
    console.approve(request.id)
    console.locked_channels.add("payments")
    with pytest.raises(Locked) as raised:
        client.consume(request.id, DIGEST)
    assert raised.value.status == 423
    assert console.calls("POST", "/consume") == 1 and console.only().execution == "not_started"
    console.locked_channels.clear()
    assert client.consume(request.id, DIGEST).arguments == REFUND


def test_a_report_whose_answer_was_lost_is_sent_again_and_taken_once(client, console):
    request = ask(client)
    console.approve(request.id)
    client.consume(request.id, DIGEST)
    console.fail("POST", "/result", "drop_answer")
    execution = client.report(request.id, ok=True, result={"refund_id": "r-1"})
    assert execution.status is ExecutionStatus.SUCCEEDED
    assert console.calls("POST", "/result") == 2 and console.only().result == {"refund_id": "r-1"}


def test_a_refusal_is_never_retried(client, console):
    with pytest.raises(Forbidden):
        ask(client, channel="email")
    assert console.calls("POST", "/api/approval-requests") == 1


def test_status_is_read_after_the_same_key_is_retried(client, console):
    request = ask(client)
    console.approve(request.id)
    console.fail("POST", "/api/approval-requests", 502)
    assert ask(client).status is RequestStatus.APPROVED
