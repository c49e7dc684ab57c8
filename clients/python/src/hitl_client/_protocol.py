"""The contract's calls, once for both clients: each is a generator that yields what to do (send a request,
sleep, call the agent's function) and is sent back what happened. `Client` runs them with blocking I/O,
`AsyncClient` awaits them, so the retry rules and the exactly-once logic exist once (httpx's `Auth.auth_flow`
is driven the same way).
"""

from __future__ import annotations

import json
import math
import random
import time
import uuid
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from hitl_client.errors import (
    AlreadyConsumed,
    ApiError,
    Conflict,
    ConnectionFailed,
    DigestMismatch,
    Forbidden,
    Invalid,
    Locked,
    NotApproved,
    NotConsumed,
    NotFound,
    RateLimited,
    ServerError,
    Unauthorized,
    UnexpectedResponse,
    WaitTimeout,
)
from hitl_client.models import ApprovalRequest, Execution, Go

T = TypeVar("T")

PATH = "/api/approval-requests"
MAX_WAIT = 60  # the contract's ceiling for ?wait=
# Worth another try for a call that is safe to repeat: the console was busy or failed before answering.
RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Send:
    method: str
    path: str
    json: Any = None
    params: Mapping[str, Any] | None = None
    # A long poll holds the answer back this many seconds: the read timeout is extended by as much.
    held_for: float = 0
    # The approval request the call is about, for its trace (`_tracing.Traces`): `ask:<channel>:<key>`, `id:<id>`.
    trace_key: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Call:
    """Run the agent's function with these keyword arguments (awaited when it is a coroutine function)."""

    function: Callable[..., Any]
    kwargs: dict[str, Any]


Op = Send | Sleep | Call
Flow = Generator[Op, Any, T]


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter between `retries` repeats of a call that is safe to repeat."""

    retries: int = 4
    backoff: float = 0.5
    max_backoff: float = 10.0

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        delay = random.uniform(0, min(self.max_backoff, self.backoff * 2**attempt))
        if retry_after is not None and retry_after.strip().isdigit():
            # The console says when it expects to be back (503 while its database is unreachable, 429).
            delay = max(delay, min(float(retry_after), self.max_backoff))
        return delay


def send(request: Send, policy: RetryPolicy, *, idempotent: bool) -> Flow[httpx.Response]:
    """One call of the API. A call that is safe to repeat (idempotent) is sent again after a transport error, a
    429 or a 5xx; any other call is sent once, and its caller decides what a lost answer means."""
    attempt = 0
    while True:
        try:
            response: httpx.Response = yield request
        except httpx.TransportError as exc:
            if not idempotent or attempt >= policy.retries:
                raise ConnectionFailed(f"{request.method} {request.path}: {exc!r}") from exc
            delay = policy.delay(attempt)
        else:
            if response.is_success:
                return response
            if not idempotent or response.status_code not in RETRYABLE_STATUSES or attempt >= policy.retries:
                raise error_from_response(response)
            delay = policy.delay(attempt, response.headers.get("Retry-After"))
        attempt += 1
        yield Sleep(delay)


def request_approval(body: dict[str, Any], policy: RetryPolicy) -> Flow[ApprovalRequest]:
    # Safe to repeat: the idempotency key gives back the same request, whether or not the first one arrived. The
    # answer is the request's whole state (its decision and execution included), as GET would give it.
    trace_key = f"ask:{body.get('channel')}:{body.get('idempotency_key')}"
    response = yield from send(Send("POST", PATH, json=body, trace_key=trace_key), policy, idempotent=True)
    return ApprovalRequest.from_json(_json(response))


def get(request_id: str, wait: int, policy: RetryPolicy) -> Flow[ApprovalRequest]:
    if not 0 <= wait <= MAX_WAIT:
        raise ValueError(f"wait must be 0 to {MAX_WAIT} seconds, not {wait}.")
    request = Send("GET", _path(request_id), params={"wait": wait}, held_for=wait, trace_key=_about(request_id))
    response = yield from send(request, policy, idempotent=True)
    return ApprovalRequest.from_json(_json(response))


def wait(
    request_id: str, timeout: float | None, poll: int, policy: RetryPolicy, clock: Callable[[], float] = time.monotonic
) -> Flow[ApprovalRequest]:
    """Long-polls until the request is decided, expired or cancelled; WaitTimeout after `timeout` seconds."""
    if not 1 <= poll <= MAX_WAIT:
        raise ValueError(f"poll must be 1 to {MAX_WAIT} seconds, not {poll}.")
    deadline = None if timeout is None else clock() + timeout
    while True:
        # Rounded up: a poll shorter than a second would turn the loop into a busy one.
        seconds = poll if deadline is None else max(0, min(poll, math.ceil(deadline - clock())))
        request = yield from get(request_id, seconds, policy)
        if request.decided:
            return request
        if deadline is not None and clock() >= deadline:
            raise WaitTimeout(request, timeout or 0)


def consume(request_id: str, digest: str, policy: RetryPolicy, nonce: str | None = None) -> Flow[Go]:
    """The one "go", asked under a nonce made for this consume (or the caller's): the console answers the same
    go again to the same nonce while the execution is pending, so a consume whose answer was lost (the
    connection broke, a 5xx that may have come after the write) is sent again like any call that is safe to
    repeat. A process that died after its go makes a new nonce when it runs again, and gets AlreadyConsumed."""
    body = {"arguments_digest": digest, "nonce": nonce or uuid.uuid4().hex}
    request = Send("POST", _path(request_id, "consume"), json=body, trace_key=_about(request_id))
    response = yield from send(request, policy, idempotent=True)
    return Go.from_json(_json(response))


def report(request_id: str, body: dict[str, Any], policy: RetryPolicy) -> Flow[Execution]:
    # Safe to repeat: the same result sent again is taken as the same (200), another one is a 409.
    request = Send("POST", _path(request_id, "result"), json=body, trace_key=_about(request_id))
    response = yield from send(request, policy, idempotent=True)
    data = _json(response)
    if not isinstance(data, Mapping) or "execution" not in data:
        raise UnexpectedResponse("The result's answer has no execution.", data)
    return Execution.from_json(data["execution"])


def pending_compensations(run_id: str | None, policy: RetryPolicy) -> Flow[list[ApprovalRequest]]:
    """The compensations approved for this token's agent to run and not yet consumed (its runs being undone), by
    run and in undo order: `GET /api/approval-requests?compensations=pending[&run=...]`."""
    params = {"compensations": "pending", **({"run": run_id} if run_id is not None else {})}
    response = yield from send(Send("GET", PATH, params=params), policy, idempotent=True)
    data = _json(response)
    if not isinstance(data, list):
        raise UnexpectedResponse("The compensations' answer is not a list.", data)
    return [ApprovalRequest.from_json(item) for item in data]


def error_from_response(response: httpx.Response) -> ApiError:
    """The contract's `{error, detail}` as the exception for its status and code."""
    status = response.status_code
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if isinstance(body, Mapping) and isinstance(body.get("error"), str):
        code, detail = body["error"], body.get("detail", "")
    else:  # not the console's answer (a proxy's error page, say)
        code, detail = f"http_{status}", response.text[:500]
    kind: type[ApiError]
    if status == 409:
        if code == "already_consumed":
            return AlreadyConsumed(status, code, detail, execution=_execution_or_none(body))
        kind = _CONFLICTS.get(code, Conflict)
    elif status >= 500:
        kind = ServerError
    else:
        kind = _BY_STATUS.get(status, ApiError)
    return kind(status, code, detail)


_BY_STATUS: dict[int, type[ApiError]] = {
    400: Invalid,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    413: Invalid,
    422: Invalid,
    423: Locked,
    429: RateLimited,
}
_CONFLICTS: dict[str, type[Conflict]] = {
    "digest_mismatch": DigestMismatch,
    "not_approved": NotApproved,
    "not_consumed": NotConsumed,
}


def _execution_or_none(body: object) -> Execution | None:
    # The receipt is a courtesy of the 409's body; without a readable one the caller asks GET.
    if not isinstance(body, Mapping) or "execution" not in body:
        return None
    try:
        return Execution.from_json(body["execution"])
    except UnexpectedResponse:
        return None


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UnexpectedResponse(
            f"{response.request.method} {response.request.url.path} answered {response.status_code} without JSON.",
            response.text[:500],
        ) from None


def _path(request_id: str, *rest: str) -> str:
    return "/".join((PATH, quote(str(request_id), safe=""), *rest))


def _about(request_id: str) -> str:
    return f"id:{request_id}"
