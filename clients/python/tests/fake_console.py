"""An in-memory console that speaks the approval-request contract (docs/external-agents.md), for the client's
tests through `httpx.MockTransport`: the key -> request map, the statuses, the digest check, one consume (given
again to its own nonce while nothing is reported), shadow cards, an idempotent result. It computes the digest
itself (not with the client's function), as the server does.

As the server (external/asks.py): a key names the channel, action and arguments (a repeat's `current`,
rationale and other context may differ; the first ask's stand); POST answers with the request's whole state plus
its `url`; a result may be any JSON value.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx

ACTION = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
PREFIX = "/api/approval-requests"


class ProcessDied(BaseException):
    """The agent's process stops right here (not an Exception: nothing in the client may catch it)."""


def digest_of(arguments: dict[str, Any], *, ensure_ascii: bool = False) -> str:
    text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=ensure_ascii)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class FakeRequest:
    id: str
    user: str
    key: str
    channel: str
    action: str
    asked: dict[str, Any]
    body: dict[str, Any]
    run_id: str
    card_id: int | None
    expires_at: datetime
    status: str = "pending"
    arguments: dict[str, Any] | None = None
    edited: bool = False
    decided_by: str | None = None
    decided_at: datetime | None = None
    comment: str = ""
    reason: str = ""
    execution: str = "not_started"
    consumed_at: datetime | None = None
    completed_at: datetime | None = None
    result: Any = None
    error: str = ""
    reported: dict[str, Any] | None = None
    shadow: bool = False
    consume_nonce: str = ""
    # A compensation (the run is undone, FakeConsole.undo): the request it undoes and its place in the undo.
    compensates: str | None = None
    undo_order: int | None = None

    def execution_json(self) -> dict[str, Any]:
        return {
            "status": self.execution,
            "consumed_at": _iso(self.consumed_at),
            "completed_at": _iso(self.completed_at),
            "result": self.result,
            "error": self.error,
        }


@dataclass
class Fault:
    method: str
    path_end: str
    # drop_request: the connection breaks before the console sees it; drop_answer: the console does it and the
    # answer is lost; die: the agent's process dies as it sends; or an HTTP status answered instead.
    how: str | int
    times: int = 1


@dataclass
class FakeConsole:
    tokens: dict[str, str] = field(default_factory=lambda: {"tok-alice": "alice", "tok-dave": "dave"})
    # channel -> the users holding request_channel on it
    channels: dict[str, set[str]] = field(default_factory=lambda: {"payments": {"alice"}, "email": set()})
    unreviewed_channels: set[str] = field(default_factory=set)
    # Channels in shadow mode: their cards are shadow cards, whose consume answers no go.
    shadow_channels: set[str] = field(default_factory=set)
    locked_channels: set[str] = field(default_factory=set)
    requests: dict[str, FakeRequest] = field(default_factory=dict)
    # Called when a client long-polls a pending request: the reviewer decides "while it waits".
    reviewer: Callable[[FakeRequest], None] | None = None
    faults: list[Fault] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)
    # The headers of every call, in the order of `seen` (the trace context each carried).
    seen_headers: list[httpx.Headers] = field(default_factory=list)
    # A console that hashed the arguments another way (\u escapes) than the contract says.
    ensure_ascii: bool = False
    # A console whose go carries other arguments than the approved ones.
    go_arguments: dict[str, Any] | None = None
    # Called as a consume arrives, before the console looks at the request (a twin's consume, an expiry).
    before_consume: Callable[[FakeRequest], None] | None = None
    consumed_digests: list[str] = field(default_factory=list)
    # The nonce of every consume that reached the console, in order.
    nonces: list[str] = field(default_factory=list)

    # -- what the people at the console do ------------------------------------------------------------------

    def approve(
        self, request_id: str, *, by: str = "bob", edit: dict[str, Any] | None = None, comment: str = ""
    ) -> None:
        request = self.requests[request_id]
        assert request.status == "pending"
        request.status, request.decided_by, request.decided_at = "approved", by, _now()
        request.comment = comment
        if edit is not None:
            request.arguments, request.edited = edit, True

    def reject(self, request_id: str, *, comment: str, reason: str = "policy", by: str = "bob") -> None:
        request = self.requests[request_id]
        request.status, request.decided_by, request.decided_at = "rejected", by, _now()
        request.comment, request.reason = comment, reason
        request.arguments = None

    def expire(self, request_id: str) -> None:
        request = self.requests[request_id]
        request.status, request.reason, request.arguments = "expired", "expired", None

    def cancel(self, request_id: str) -> None:
        request = self.requests[request_id]
        request.status, request.reason, request.arguments = "cancelled", "run cancelled", None

    def undo(self, run_id: str) -> list[FakeRequest]:
        """A person cancels and undoes the run: a compensation request (pending, a card) per succeeded request whose
        result declared one, in the reverse order of the executions, as the server's external.undo opens them."""
        executed = [
            r
            for r in sorted(self.requests.values(), key=lambda r: r.completed_at or _now())
            if r.run_id == run_id and r.execution == "succeeded" and (r.reported or {}).get("compensation")
        ]
        opened = []
        for order, original in enumerate(reversed(executed)):
            declared = (original.reported or {})["compensation"]
            request = FakeRequest(
                id=str(uuid.uuid4()),
                user=original.user,
                key=f"undo:{original.id}",
                channel=original.channel,
                action=declared["action"],
                asked=declared["arguments"],
                body={},
                run_id=run_id,
                card_id=len(self.requests) + 1,
                expires_at=_now() + timedelta(hours=1),
                arguments=declared["arguments"],
                compensates=original.id,
                undo_order=order,
            )
            self.requests[request.id] = request
            opened.append(request)
        return opened

    def approves_while_waiting(self, *, edit: dict[str, Any] | None = None, by: str = "bob", comment: str = "") -> None:
        self.reviewer = lambda request: self.approve(request.id, edit=edit, by=by, comment=comment)

    def rejects_while_waiting(self, *, comment: str, reason: str = "policy", by: str = "bob") -> None:
        self.reviewer = lambda request: self.reject(request.id, comment=comment, reason=reason, by=by)

    def consumed_by_another(self, request: FakeRequest) -> None:
        """Another process with the same key took the go (it runs the action now, or died doing it)."""
        request.execution, request.consumed_at, request.consume_nonce = "pending", _now(), "another-process"

    def fail(self, method: str, path_end: str, how: str | int, times: int = 1) -> None:
        self.faults.append(Fault(method, path_end, how, times))

    def only(self) -> FakeRequest:
        (request,) = self.requests.values()
        return request

    def calls(self, method: str, path_end: str = "") -> int:
        return sum(1 for m, path in self.seen if m == method and path.endswith(path_end))

    # -- the HTTP side -------------------------------------------------------------------------------------

    def handler(self, http: httpx.Request) -> httpx.Response:
        self.seen.append((http.method, http.url.path))
        self.seen_headers.append(http.headers)
        fault = self._fault_for(http)
        if fault == "drop_request":
            raise httpx.ConnectError("connection refused", request=http)
        if fault == "die":
            raise ProcessDied
        if isinstance(fault, int):
            response = _error(fault, {429: "too_many_requests", 503: "database_unavailable"}.get(fault, "error"), "")
            if fault in (429, 503):
                response.headers["Retry-After"] = "1"
            return response
        response = self._answer(http)
        if fault == "drop_answer":
            raise httpx.ReadError("connection reset by peer", request=http)
        return response

    def _fault_for(self, http: httpx.Request) -> str | int | None:
        for fault in self.faults:
            if fault.times and fault.method == http.method and http.url.path.endswith(fault.path_end):
                fault.times -= 1
                return fault.how
        return None

    def _answer(self, http: httpx.Request) -> httpx.Response:
        user = self.tokens.get(http.headers.get("Authorization", "").removeprefix("Bearer "))
        if user is None:
            return _error(401, "unauthorized", "A valid 'Authorization: Bearer <token>' header is required.")
        path = http.url.path
        if path == PREFIX and http.method == "POST":
            return self._create(user, _body(http))
        if path == PREFIX and http.method == "GET":
            return self._pending_compensations(user, http.url.params)
        match = re.fullmatch(rf"{PREFIX}/([^/]+)(/consume|/result)?", path)
        request = self.requests.get(match.group(1)) if match else None
        if request is None or request.user != user:
            return _error(404, "not_found", "No such approval request.")
        if match.group(2) is None and http.method == "GET":
            return self._get(request, http.url.params.get("wait", "0"))
        if match.group(2) == "/consume" and http.method == "POST":
            return self._consume(request, _body(http))
        if match.group(2) == "/result" and http.method == "POST":
            return self._result(request, _body(http))
        return _error(405, "method_not_allowed", "")

    def _create(self, user: str, body: Any) -> httpx.Response:
        errors = _create_errors(body)
        if errors:
            return _error(422, "invalid", errors)
        channel = body["channel"]
        if channel not in self.channels:
            return _error(404, "not_found", f"No channel {channel!r}.")
        if user not in self.channels[channel]:
            return _error(403, "forbidden", f"You may not request approvals on {channel!r}.")
        never = body.get("approval") == "never"
        if never and channel not in self.unreviewed_channels:
            return _error(422, "invalid", [{"loc": ["approval"], "msg": "This channel reviews every action."}])
        existing = next((r for r in self.requests.values() if (r.user, r.key) == (user, body["idempotency_key"])), None)
        if existing is not None:
            if (existing.channel, existing.action, existing.asked) != (channel, body["action"], body["arguments"]):
                return _error(409, "conflict", "This idempotency key was used for another request.")
            return httpx.Response(200, json=self.representation(existing))
        request = FakeRequest(
            id=str(uuid.uuid4()),
            user=user,
            key=body["idempotency_key"],
            channel=channel,
            action=body["action"],
            asked=body["arguments"],
            body=body,
            run_id=body.get("run") or str(uuid.uuid4()),
            card_id=None if never else len(self.requests) + 1,
            expires_at=_now() + timedelta(seconds=body.get("expires_in") or 3600),
            arguments=body["arguments"],
            shadow=not never and channel in self.shadow_channels,
        )
        if never:
            request.status, request.decided_at = "approved", _now()
        self.requests[request.id] = request
        return httpx.Response(202, json=self.representation(request))

    def _pending_compensations(self, user: str, params: httpx.QueryParams) -> httpx.Response:
        if params.get("compensations") != "pending":
            return _error(422, "invalid", [{"loc": "compensations", "msg": "pending"}])
        found = [
            r
            for r in self.requests.values()
            if r.user == user
            and r.compensates is not None
            and r.status == "approved"
            and r.execution == "not_started"
            and params.get("run") in (None, r.run_id)
        ]
        found.sort(key=lambda r: (r.run_id, r.undo_order or 0))
        return httpx.Response(200, json=[self.representation(r) for r in found])

    def _get(self, request: FakeRequest, wait: str) -> httpx.Response:
        if not wait.isdigit() or not 0 <= int(wait) <= 60:
            return _error(422, "invalid", [{"loc": ["query", "wait"], "msg": "0 to 60 seconds"}])
        if request.status == "pending" and int(wait) > 0 and self.reviewer is not None:
            self.reviewer(request)
        return httpx.Response(200, json=self.representation(request))

    def representation(self, request: FakeRequest) -> dict[str, Any]:
        arguments = request.arguments if request.status == "approved" else None
        return {
            "id": request.id,
            "run_id": request.run_id,
            "card_id": request.card_id,
            "channel": request.channel,
            "action": request.action,
            "status": request.status,
            "arguments": arguments,
            "arguments_digest": None if arguments is None else digest_of(arguments, ensure_ascii=self.ensure_ascii),
            "edited": request.edited,
            "decided_by": request.decided_by,
            "decided_at": _iso(request.decided_at),
            "comment": request.comment,
            "reason": request.reason,
            "expires_at": _iso(request.expires_at),
            "shadow": request.shadow,
            "execution": request.execution_json(),
            "compensates": request.compensates,
            "undo_order": request.undo_order,
            "url": f"{PREFIX}/{request.id}",
        }

    def _consume(self, request: FakeRequest, body: Any) -> httpx.Response:
        if self.before_consume is not None:
            self.before_consume(request)
        digest = body.get("arguments_digest") if isinstance(body, dict) else None
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            return _error(422, "invalid", [{"loc": ["arguments_digest"], "msg": "64 lowercase hex digits"}])
        nonce = body.get("nonce", "")
        if not isinstance(nonce, str) or not re.fullmatch(r"[A-Za-z0-9_\-]{0,100}", nonce):
            return _error(422, "invalid", [{"loc": ["nonce"], "msg": "up to 100 letters, digits, _ and -"}])
        self.nonces.append(nonce)
        # In the server's order: what is recorded first (a lost answer asked again), then the decision.
        if request.execution != "not_started":
            if nonce and nonce == request.consume_nonce and request.execution == "pending":
                return httpx.Response(200, json=self._go(request))
            return httpx.Response(
                409,
                json={"error": "already_consumed", "detail": "Consumed before.", "execution": request.execution_json()},
            )
        if request.status != "approved":
            return _error(409, "not_approved", f"The request is {request.status}.")
        assert request.arguments is not None
        if digest != digest_of(request.arguments, ensure_ascii=self.ensure_ascii):
            return _error(409, "digest_mismatch", "The digest is not the approved arguments'.")
        if request.channel in self.locked_channels:
            return _error(423, "locked", f"The kill switch of {request.channel!r} is engaged.")
        request.execution, request.consumed_at, request.consume_nonce = "pending", _now(), nonce
        self.consumed_digests.append(digest)
        if request.shadow:
            # Recorded as shadow, as the server's receipt: done, its response the shadow's.
            outcome = {"ok": True, "result": {"shadow": True, "id": f"shadow:external:{request.id}"}}
            request.execution, request.result, request.completed_at = "succeeded", outcome["result"], _now()
            request.reported = outcome
        return httpx.Response(200, json=self._go(request))

    def _go(self, request: FakeRequest) -> dict[str, Any]:
        assert request.arguments is not None
        arguments = self.go_arguments if self.go_arguments is not None else request.arguments
        return {
            "go": not request.shadow,
            "shadow": request.shadow,
            "arguments": arguments,
            "arguments_digest": digest_of(request.arguments, ensure_ascii=self.ensure_ascii),
            "execution": request.execution_json(),
        }

    def _result(self, request: FakeRequest, body: Any) -> httpx.Response:
        if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
            return _error(422, "invalid", [{"loc": ["ok"], "msg": "true or false"}])
        if not body["ok"] and not (isinstance(body.get("error"), str) and body["error"].strip()):
            return _error(422, "invalid", [{"loc": ["error"], "msg": "A failure needs its text."}])
        if "compensation" in body and (not body["ok"] or request.compensates is not None):
            return _error(422, "invalid", [{"loc": "compensation", "msg": "a success's, not a compensation's"}])
        if request.execution == "not_started":
            return _error(409, "not_consumed", "The request was not consumed.")
        if request.reported is not None:
            if request.reported != body:
                return _error(409, "conflict", "Another result was reported.")
            return httpx.Response(200, json={"execution": request.execution_json()})
        request.reported, request.completed_at = body, _now()
        if body["ok"]:
            request.execution, request.result = "succeeded", body.get("result")
        else:
            request.execution, request.error = "failed", body["error"]
        return httpx.Response(200, json={"execution": request.execution_json()})


def _create_errors(body: Any) -> list[dict[str, Any]]:
    if not isinstance(body, dict):
        return [{"loc": [], "msg": "A JSON object is required."}]
    checks = {
        "channel": isinstance(body.get("channel"), str),
        "action": isinstance(body.get("action"), str) and ACTION.fullmatch(body["action"]) is not None,
        "arguments": isinstance(body.get("arguments"), dict),
        "idempotency_key": isinstance(body.get("idempotency_key"), str) and 1 <= len(body["idempotency_key"]) <= 200,
        "current": body.get("current") is None or isinstance(body["current"], dict),
        "rationale": body.get("rationale") is None or isinstance(body["rationale"], (str, dict)),
        "risk": body.get("risk") in (None, "low", "medium", "high"),
        "display": body.get("display") is None or isinstance(body["display"], dict),
        "schema": body.get("schema") is None or isinstance(body["schema"], dict),
        "run": body.get("run") is None or isinstance(body["run"], str),
        "callback_url": body.get("callback_url") is None
        or (isinstance(body["callback_url"], str) and body["callback_url"].startswith(("http://", "https://"))),
        "expires_in": body.get("expires_in") is None
        or (type(body["expires_in"]) is int and 60 <= body["expires_in"] <= 604800),
        "on_expiry": body.get("on_expiry") in (None, "reject", "escalate"),
        "approval": body.get("approval") in (None, "required", "never"),
    }
    return [{"loc": [name], "msg": "invalid"} for name, ok in checks.items() if not ok]


def _body(http: httpx.Request) -> Any:
    try:
        return json.loads(http.content)
    except ValueError:
        return None


def _error(status: int, code: str, detail: Any) -> httpx.Response:
    return httpx.Response(status, json={"error": code, "detail": detail})


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _iso(moment: datetime | None) -> str | None:
    # As Django writes it: milliseconds and a "Z".
    return None if moment is None else moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
