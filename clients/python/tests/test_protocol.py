"""The contract's calls as the generators both clients drive (hitl_client._protocol), driven here by hand: what each
call sends, which answers it retries and how long it sleeps first, how a wait cuts its long polls to its timeout,
and which exception each refusal is. No HTTP: the calls through a transport are test_client_calls.py and
test_client_errors.py."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from hitl_client import _protocol as protocol
from hitl_client._protocol import RetryPolicy, Send, Sleep
from hitl_client.errors import (
    AlreadyConsumed,
    ApiError,
    Conflict,
    ConnectionFailed,
    DigestMismatch,
    Invalid,
    Locked,
    NotFound,
    RateLimited,
    ServerError,
    UnexpectedResponse,
    WaitTimeout,
)

EXECUTION = {"status": "not_started", "consumed_at": None, "completed_at": None, "result": None, "error": ""}


def request_json(status: str = "pending", **fields: Any) -> dict:
    return {
        "id": "r-1",
        "run_id": None,
        "card_id": None,
        "channel": "payments",
        "action": "refund",
        "status": status,
        "arguments": {"order_id": "o-1"},
        "arguments_digest": None,
        "edited": False,
        "decided_by": None,
        "decided_at": None,
        "comment": "",
        "reason": "",
        "expires_at": None,
        "execution": EXECUTION,
        **fields,
    }


def answer(status: int, body: Any = None, *, headers: dict | None = None, text: str | None = None) -> httpx.Response:
    request = httpx.Request("GET", "http://console.test/api/approval-requests/r-1")
    if text is not None:
        return httpx.Response(status, text=text, headers=headers, request=request)
    return httpx.Response(status, json=body, headers=headers, request=request)


def drive(flow, answers: list) -> tuple[list, Any]:
    """Runs `flow`, answering each Send with the next of `answers` (an exception is thrown in) and each Sleep with
    None; gives back what it yielded and what it returned."""
    yielded, answers = [], list(answers)
    try:
        op = next(flow)
        while True:
            yielded.append(op)
            if isinstance(op, Send):
                reply = answers.pop(0)
                op = flow.throw(reply) if isinstance(reply, BaseException) else flow.send(reply)
            else:
                op = flow.send(None)
    except StopIteration as done:
        assert not answers, f"answers left over: {answers}"
        return yielded, done.value


QUICK = RetryPolicy(retries=2, backoff=0, max_backoff=0)
BROKEN = httpx.ConnectError("connection refused")


# --- sending, and sending again ------------------------------------------------------------------------------------


def test_a_call_safe_to_repeat_is_sent_again_after_a_broken_connection_a_429_or_a_5xx():
    flow = protocol.send(Send("GET", "/x"), QUICK, idempotent=True)
    yielded, response = drive(flow, [BROKEN, answer(503, {"error": "unavailable"}), answer(200, {"ok": True})])
    assert [type(op) for op in yielded] == [Send, Sleep, Send, Sleep, Send]
    assert response.json() == {"ok": True}


@pytest.mark.parametrize("status", sorted(protocol.RETRYABLE_STATUSES))
def test_it_gives_up_after_its_retries_with_the_last_answers_error(status):
    flow = protocol.send(Send("GET", "/x"), QUICK, idempotent=True)
    with pytest.raises(RateLimited if status == 429 else ServerError):
        drive(flow, [answer(status, {"error": "busy"})] * 3)


def test_a_broken_connection_after_the_retries_is_connection_failed_with_its_cause():
    with pytest.raises(ConnectionFailed, match="GET /x: ConnectError") as failed:
        drive(protocol.send(Send("GET", "/x"), QUICK, idempotent=True), [BROKEN] * 3)
    assert failed.value.__cause__ is BROKEN


def test_a_call_not_safe_to_repeat_is_sent_once():
    with pytest.raises(ConnectionFailed):
        drive(protocol.send(Send("POST", "/x"), QUICK, idempotent=False), [BROKEN])
    with pytest.raises(ServerError):
        drive(protocol.send(Send("POST", "/x"), QUICK, idempotent=False), [answer(503, {"error": "unavailable"})])


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 413, 422, 423, 501])
def test_a_refusal_is_never_sent_again(status):
    with pytest.raises(ApiError):
        drive(protocol.send(Send("GET", "/x"), QUICK, idempotent=True), [answer(status, {"error": "no"})])


def test_the_backoff_is_jittered_within_its_bound_and_capped():
    policy = RetryPolicy(retries=9, backoff=0.5, max_backoff=3.0)
    random.seed(3)
    for attempt, bound in enumerate([0.5, 1.0, 2.0, 3.0, 3.0]):
        delays = [policy.delay(attempt) for _ in range(200)]
        assert all(0 <= d <= bound for d in delays) and max(delays) > bound * 0.9


def test_a_retry_after_is_waited_out_up_to_the_cap():
    policy = RetryPolicy(backoff=0.1, max_backoff=10.0)
    assert 5 <= policy.delay(0, "5") <= 10
    assert policy.delay(0, " 30 ") == 10  # never longer than the cap
    assert policy.delay(0, "Wed, 21 Oct 2026 07:28:00 GMT") <= 0.1  # a date is not read: the backoff stands
    flow = protocol.send(Send("GET", "/x"), policy, idempotent=True)
    yielded, _ = drive(flow, [answer(429, {"error": "rate_limited"}, headers={"Retry-After": "7"}), answer(200, {})])
    assert 7 <= yielded[1].seconds <= 10


# --- the calls ------------------------------------------------------------------------------------------------------


def test_a_request_id_is_one_path_segment():
    assert protocol._path("r/../1?x", "consume") == "/api/approval-requests/r%2F..%2F1%3Fx/consume"


def test_get_holds_the_answer_back_for_its_wait_and_refuses_lengths_outside_the_contract():
    yielded, request = drive(protocol.get("r-1", 30, QUICK), [answer(200, request_json())])
    assert yielded == [Send("GET", "/api/approval-requests/r-1", params={"wait": 30}, held_for=30)]
    assert request.id == "r-1" and not request.decided
    for wait in (-1, protocol.MAX_WAIT + 1):
        with pytest.raises(ValueError, match="wait must be 0 to 60 seconds"):
            next(protocol.get("r-1", wait, QUICK))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_wait_long_polls_until_a_decision():
    flow = protocol.wait("r-1", None, 25, QUICK)
    yielded, request = drive(flow, [answer(200, request_json()), answer(200, request_json("approved"))])
    assert [op.params["wait"] for op in yielded] == [25, 25]
    assert request.status.value == "approved"


def test_wait_cuts_its_last_poll_to_what_is_left_of_its_timeout_rounded_up():
    clock = Clock()
    flow = protocol.wait("r-1", 50.5, 20, QUICK, clock=clock)
    polls = []
    op = next(flow)
    with pytest.raises(WaitTimeout, match="Request r-1 was not decided within 50.5 s") as timed_out:
        while True:
            polls.append(op.params["wait"])
            clock.now += op.params["wait"]  # the console held the answer that long
            op = flow.send(answer(200, request_json()))
    assert polls == [20, 20, 11]  # 10.5 s left: a poll of 11 (a shorter one would make the loop busy)
    assert timed_out.value.request.id == "r-1"


@pytest.mark.parametrize("poll", [0, protocol.MAX_WAIT + 1])
def test_wait_refuses_polls_outside_the_contract(poll):
    with pytest.raises(ValueError, match="poll must be 1 to 60 seconds"):
        next(protocol.wait("r-1", None, poll, QUICK))


def test_consume_sends_the_digest_under_one_nonce_every_time_it_is_sent():
    go = {
        "go": True,
        "shadow": False,
        "arguments": {"order_id": "o-1"},
        "arguments_digest": "ab",
        "execution": EXECUTION,
    }
    yielded, result = drive(
        protocol.consume("r-1", "ab", QUICK), [BROKEN, answer(502, text="bad gateway"), answer(200, go)]
    )
    sends = [op for op in yielded if isinstance(op, Send)]
    assert len(sends) == 3 and len({op.json["nonce"] for op in sends}) == 1
    assert sends[0].path == "/api/approval-requests/r-1/consume"
    assert sends[0].json["arguments_digest"] == "ab" and len(sends[0].json["nonce"]) == 32
    assert result.go and result.arguments == {"order_id": "o-1"}
    yielded, _ = drive(protocol.consume("r-1", "ab", QUICK, nonce="mine"), [answer(200, go)])
    assert yielded[0].json == {"arguments_digest": "ab", "nonce": "mine"}


def test_a_reports_answer_without_its_execution_breaks_the_contract():
    with pytest.raises(UnexpectedResponse, match="The result's answer has no execution."):
        drive(protocol.report("r-1", {"ok": True}, QUICK), [answer(200, {"status": "approved"})])
    _, execution = drive(protocol.report("r-1", {"ok": True}, QUICK), [answer(200, {"execution": EXECUTION})])
    assert execution.status.value == "not_started"


def test_an_answer_that_is_not_json_breaks_the_contract():
    with pytest.raises(UnexpectedResponse, match="GET /api/approval-requests/r-1 answered 200 without JSON."):
        drive(protocol.get("r-1", 0, QUICK), [answer(200, text="<html>")])


# --- refusals ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (400, "bad_request", Invalid),
        (404, "not_found", NotFound),
        (413, "too_large", Invalid),
        (423, "locked", Locked),
        (429, "rate_limited", RateLimited),
        (409, "digest_mismatch", DigestMismatch),
        (409, "something_new", Conflict),
        (500, "internal", ServerError),
        (504, "timeout", ServerError),
    ],
)
def test_each_refusal_is_the_exception_of_its_status_and_code(status, code, kind):
    error = protocol.error_from_response(answer(status, {"error": code, "detail": "why"}))
    assert type(error) is kind and (error.status, error.error, error.detail) == (status, code, "why")


def test_already_consumed_carries_the_receipt_when_there_is_a_readable_one():
    error = protocol.error_from_response(answer(409, {"error": "already_consumed", "execution": EXECUTION}))
    assert isinstance(error, AlreadyConsumed) and error.execution.status.value == "not_started"
    unreadable = protocol.error_from_response(answer(409, {"error": "already_consumed", "execution": {"x": 1}}))
    assert isinstance(unreadable, AlreadyConsumed) and unreadable.execution is None


def test_an_error_page_that_is_not_the_consoles_keeps_its_status_and_text():
    error = protocol.error_from_response(answer(502, text="<h1>Bad gateway</h1>"))
    assert type(error) is ServerError and (error.error, error.detail) == ("http_502", "<h1>Bad gateway</h1>")
