"""Approval requests over HTTP (docs/external-agents.md): an external agent asks a person to sign off one action,
waits for the decision (a long-poll), consumes the approval once and reports the outcome. The logic is in
external.asks, external.status and external.executions; this module maps it to JSON."""

from __future__ import annotations

import time
import uuid
from datetime import datetime
from typing import Any, ClassVar, Literal

from django.db import connection
from django.http import HttpRequest
from ninja import Field, Query, Router, Schema, Status
from pydantic import ConfigDict

from core import safe_input, tracing
from core.api import ERRORS, ErrorOut
from external import asks, executions, status, undo, waiters
from external.asks import MAX_EXPIRES_IN, MIN_EXPIRES_IN, Ask
from external.errors import RequestError

router = Router(tags=["approval requests"])

NOT_BLANK = r"\S"
ACTION = r"^[A-Za-z0-9_.:-]{1,100}$"
PATH = r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$"
MAX_WAIT = 60  # seconds a long-poll may hold the request (console/long_poll.py holds it)
IN_THREAD_POLL = 1.0  # seconds between two looks of a long-poll that waits in its view (no edge: get_request)


class Citation(Schema):
    title: str = Field(max_length=300)
    url: str = Field("", max_length=2000)


class Rationale(Schema):
    summary: str = Field(max_length=5000)
    rule_id: str = Field("", max_length=100)
    confidence: float | None = Field(None, ge=0, le=1)
    citations: list[Citation] = Field(default_factory=list, max_length=20)


class DisplayPaths(Schema):
    """Dotted paths into the arguments: the inbox's headline, and an amount in minor units with its currency."""

    headline: str | None = Field(None, pattern=PATH, max_length=200)
    amount_minor: str | None = Field(None, pattern=PATH, max_length=200)
    currency: str | None = Field(None, pattern=PATH, max_length=200)


class RequestIn(Schema):
    model_config = ConfigDict(populate_by_name=True)

    channel: str = Field(min_length=1, max_length=64)
    action: str = Field(pattern=ACTION, description="What the agent wants to do: a tool's name.")
    arguments: dict = Field(description="The action's arguments, as the agent would run them.")
    current: dict | None = Field(None, description="The target's state now: the card shows the diff.")
    rationale: str | Rationale | None = Field(
        None, description="Why: a text, or {summary, rule_id, confidence, citations}."
    )
    risk: Literal["low", "medium", "high"] = "medium"
    display: DisplayPaths | None = None
    schema_: dict | None = Field(
        None,
        alias="schema",
        description="A JSON Schema of the arguments: a reviewer's edit must fit it. Without one, the card is "
        "approved or rejected, not edited.",
    )
    run: uuid.UUID | None = Field(None, description="An external run of this token's user: one timeline per session.")
    idempotency_key: str = Field(min_length=1, max_length=200, pattern=NOT_BLANK)
    callback_url: str | None = Field(
        None,
        max_length=2000,
        pattern=r"^https?://",
        description="Where the decision is POSTed, signed with this token's callback secret. Refused (422) when "
        "its host resolves to loopback, link-local, multicast, private (unless the console allows it) or the "
        "console's own address; no redirect is followed.",
    )
    expires_in: int | None = Field(
        None,
        strict=True,
        ge=MIN_EXPIRES_IN,
        le=MAX_EXPIRES_IN,
        description="Seconds until it expires (default: the channel's SLA).",
    )
    on_expiry: Literal["reject", "escalate"] = Field(
        "reject", description="At expiry: rejected, or escalated once as the channel says and then rejected."
    )
    approval: Literal["required", "never"] = Field(
        "required",
        description="`never`: no card, executed once all the same; only with `act_unreviewed` on the channel.",
    )


class Execution(Schema):
    status: Literal["not_started", "pending", "succeeded", "failed"]
    consumed_at: datetime | None
    completed_at: datetime | None
    result: Any = None
    error: str
    recorded_by: str | None = Field(
        None, description="The person who recorded the outcome from the console (the agent never reported it)."
    )
    note: str = Field("", description="What that person said of a success (how they know).")


class RequestOut(Schema):
    id: uuid.UUID
    run_id: uuid.UUID
    card_id: int | None
    channel: str
    action: str
    status: Literal["pending", "approved", "rejected", "expired", "cancelled"]
    arguments: dict | None = Field(description="What to execute once approved: a reviewer's edit, else as asked.")
    arguments_digest: str | None = Field(description="SHA-256 hex of the arguments' canonical JSON.")
    edited: bool
    decided_by: str | None
    decided_at: datetime | None
    comment: str
    reason: str
    expires_at: datetime
    shadow: bool
    execution: Execution
    compensates: uuid.UUID | None = Field(
        None, description="A compensation (external.undo): the request whose execution it undoes."
    )
    undo_order: int | None = Field(None, description="A compensation's place in its run's undo: 0 runs first.")
    url: str


def _out(action_request, answer: dict | None = None) -> dict:
    return {**(answer or status.state(action_request)), "url": f"/api/approval-requests/{action_request.id}"}


class ConsumeIn(Schema):
    arguments_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    nonce: str = Field(
        "",
        max_length=100,
        pattern=r"^[A-Za-z0-9_\-]*$",
        description="The caller's name for this consume: the same nonce asking again while the execution is "
        "pending gets the same go (its first answer was lost); any other second consume is 409.",
    )


class Go(Schema):
    go: bool
    shadow: bool
    arguments: dict
    arguments_digest: str
    execution: Execution


class Completed(Schema):
    """A result's answer: the receipt it completed (as a consume's answer and a refusal carry it)."""

    execution: Execution


class CompensationIn(Schema):
    """What undoes a successful action (docs/external-agents.md, "Undo"): asked of the agent, as an approval
    request, if its run is undone."""

    action: str = Field(pattern=ACTION, description="The action that undoes it: a tool's name.")
    arguments: dict = Field(description="Its arguments, as the agent would run them.")


class ResultIn(Schema):
    # As report() takes it: a success's `error` is absent or null; a failure's is its text (null is no text).
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {"if": {"properties": {"ok": {"const": True}}}, "then": {"properties": {"error": {"type": "null"}}}},
                {
                    "if": {"properties": {"ok": {"const": False}}},
                    "then": {
                        "required": ["error"],
                        "properties": {"error": {"type": "string"}, "compensation": {"type": "null"}},
                    },
                },
            ]
        }
    )

    # What the parser takes as any valid JSON (console.api.FREE_JSON_FIELDS): the rest of the body keeps the rules.
    FREE_JSON: ClassVar[frozenset[str]] = frozenset({"result"})

    ok: bool = Field(strict=True)  # a boolean, as the document says: `1` or "true" is a 422
    result: Any = Field(
        None,
        description="What the action returned: any valid JSON, recorded exactly (integers of any size up to "
        f"{safe_input.MAX_FREE_DIGITS} digits, NUL characters, nesting to {safe_input.MAX_FREE_DEPTH} levels with "
        "the body); a number with a fraction is kept as the nearest double.",
        json_schema_extra={safe_input.ANY_JSON: True},
    )
    error: str | None = Field(None, min_length=1, max_length=5000)
    compensation: CompensationIn | None = Field(
        None,
        description="A success only: what undoes this action ({action, arguments}). Should the run be undone "
        "(cancel and undo, reject and undo), it is asked of the agent as an approval request.",
    )


class Refusal(ErrorOut):
    """A refused consume or result: `execution` says what is recorded (a second consume, another outcome)."""

    execution: Execution | None = None


# A consume's and a result's refusals: a conflict (and a stop) says what is recorded.
REFUSALS = {frozenset({400, 401, 403, 404, 413, 422, 429, 503}): ErrorOut, frozenset({409, 423}): Refusal}


def _refused(exc: RequestError) -> Status:
    return Status(exc.status, {"error": exc.error, "detail": exc.detail, **exc.extra})


@router.post(
    "/approval-requests",
    response={200: RequestOut, 202: RequestOut, **ERRORS},
    summary="Ask a person to sign off one action (202; the same idempotency key gives the same request, 200)",
)
def create_request(request: HttpRequest, body: RequestIn):
    with _traced(request, "/api/approval-requests"):
        return _create_request(request, body)


def _traced(request: HttpRequest, route: str):
    """The call as a server span continuing the agent's `traceparent` (core.tracing): the console's spans of its
    approval requests (the card's opening, the person's wait) join the agent's own trace."""
    return tracing.server_span(
        f"{request.method} {route}", request.headers, {"http.request.method": request.method, "http.route": route}
    )


def _create_request(request: HttpRequest, body: RequestIn):
    ask = Ask(
        channel=body.channel,
        action=body.action,
        arguments=body.arguments,
        idempotency_key=body.idempotency_key,
        current=body.current,
        rationale=body.rationale.model_dump() if isinstance(body.rationale, Rationale) else body.rationale,
        risk=body.risk,
        display=body.display.model_dump(exclude_none=True) if body.display else None,
        schema=body.schema_,
        run=str(body.run) if body.run else None,
        callback_url=body.callback_url,
        expires_in=body.expires_in,
        on_expiry=body.on_expiry,
        approval=body.approval,
    )
    try:
        action_request, created = asks.open_request(
            request.user, ask, console_host=request.get_host(), token=getattr(request, "api_token", None)
        )
    except RequestError as exc:
        return _refused(exc)
    return Status(202 if created else 200, _out(action_request))


@router.get(
    "/approval-requests",
    response={200: list[RequestOut], **ERRORS},
    summary="This token's compensations to run: approved, not yet consumed (`compensations=pending`), in undo order",
)
def list_requests(
    request: HttpRequest,
    compensations: Literal["pending"],
    run: uuid.UUID | None = None,
):
    # `compensations=pending`: the compensations approved to run (the only listing there is); `run`: only this
    # run's. The requests of this token's user, as GET /api/approval-requests/{id} shows each (external.undo).
    return [_out(found) for found in undo.pending_compensations(request.user, run)]


@router.get(
    "/approval-requests/{request_id}",
    response={200: RequestOut, **ERRORS},
    summary="The request: its decision and what to execute; `wait` long-polls until it is decided",
)
def get_request(request: HttpRequest, request_id: uuid.UUID, wait: int = Query(0, ge=0, le=MAX_WAIT)):
    # One look: the production server holds a long-poll at its edge (console/long_poll.py) and passes it through
    # here again each time the request may have changed, so that a waiting agent holds neither a thread nor a
    # database connection. Only without that edge (a plain WSGI server, runserver, Django's test client) does the
    # view wait itself, in its thread.
    with _traced(request, "/api/approval-requests/{request_id}"):
        return _get_request(request, request_id, wait)


def _get_request(request: HttpRequest, request_id: uuid.UUID, wait: int):
    try:
        answer = _out(status.for_user(request.user, request_id))
        if wait and not request.headers.get(waiters.EDGE_HEADER):
            answer = _wait_in_thread(request.user, request_id, answer, wait)
        return answer
    except RequestError as exc:
        return _refused(exc)


def _wait_in_thread(user, request_id, answer: dict, wait: int) -> dict:
    """The long-poll without the server's edge: a look every IN_THREAD_POLL seconds while the request is pending,
    holding this thread (not a database connection: it goes back between two looks)."""
    deadline = time.monotonic() + wait
    while answer["status"] == "pending" and (left := deadline - time.monotonic()) > 0:
        if not connection.in_atomic_block:  # (a test's transaction keeps its connection)
            connection.close()
        time.sleep(min(IN_THREAD_POLL, left))
        answer = _out(status.for_user(user, request_id))
    return answer


@router.post(
    "/approval-requests/{request_id}/consume",
    response={200: Go, **REFUSALS},
    summary="Go, once: for an approved request and the digest of its arguments (409 again, 423 while stopped)",
)
def consume(request: HttpRequest, request_id: uuid.UUID, body: ConsumeIn):
    with _traced(request, "/api/approval-requests/{request_id}/consume"):
        try:
            return executions.consume(request.user, request_id, body.arguments_digest, body.nonce)
        except RequestError as exc:
            return _refused(exc)


RESULT_URL_NAME = "approval_request_result"


@router.post(
    "/approval-requests/{request_id}/result",
    response={200: Completed, **REFUSALS},
    summary="The outcome of the execution the agent consumed: completes its receipt",
    url_name=RESULT_URL_NAME,
)
def report(request: HttpRequest, request_id: uuid.UUID, body: ResultIn):
    with _traced(request, "/api/approval-requests/{request_id}/result"):
        return _report(request, request_id, body)


def _report(request: HttpRequest, request_id: uuid.UUID, body: ResultIn):
    if body.ok == (body.error is not None):
        what = "a success carries `result`, not `error`" if body.ok else "a failure needs its `error`"
        return Status(422, {"error": "invalid", "detail": [{"loc": "error", "msg": what}]})
    if body.compensation is not None and not body.ok:
        what = "only a success declares what undoes it"
        return Status(422, {"error": "invalid", "detail": [{"loc": "compensation", "msg": what}]})
    try:
        execution = executions.report(
            request.user,
            request_id,
            ok=body.ok,
            result=body.result,
            error=body.error or "",
            compensation=body.compensation.model_dump() if body.compensation else None,
        )
    except RequestError as exc:
        return _refused(exc)
    return {"execution": execution}
