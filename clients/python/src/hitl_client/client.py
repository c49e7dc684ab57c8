"""`Client` (blocking) and `AsyncClient` (asyncio): the same calls, the same rules (`_protocol`)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from types import TracebackType
from typing import Any, Literal, cast

import httpx

from hitl_client import _protocol, _tracing
from hitl_client._protocol import Call, Flow, RetryPolicy, Send, Sleep, T
from hitl_client.models import ApprovalRequest, Execution, Go

Risk = Literal["low", "medium", "high"]
OnExpiry = Literal["reject", "escalate"]
Approval = Literal["required", "never"]

try:
    _USER_AGENT = f"hitl-console-client/{version('hitl-console-client')}"
except PackageNotFoundError:  # run from a checkout without installing
    _USER_AGENT = "hitl-console-client"


def approval_request_body(
    channel: str,
    action: str,
    arguments: Mapping[str, Any],
    *,
    idempotency_key: str,
    rationale: str | Mapping[str, Any] | None = None,
    current: Mapping[str, Any] | None = None,
    risk: Risk | None = None,
    display: Mapping[str, str] | None = None,
    schema: Mapping[str, Any] | None = None,
    run: str | None = None,
    callback_url: str | None = None,
    expires_in: int | None = None,
    on_expiry: OnExpiry | None = None,
    approval: Approval | None = None,
) -> dict[str, Any]:
    """The body of `POST /api/approval-requests`. Fields left None are left out: the console's defaults apply."""
    if not isinstance(arguments, Mapping):
        raise TypeError(f"arguments must be a mapping (a JSON object), not {type(arguments).__name__}.")
    optional = {
        "rationale": rationale,
        "current": current,
        "risk": risk,
        "display": display,
        "schema": schema,
        "run": run,
        "callback_url": callback_url,
        "expires_in": expires_in,
        "on_expiry": on_expiry,
        "approval": approval,
    }
    body: dict[str, Any] = {
        "channel": channel,
        "action": action,
        "arguments": dict(arguments),
        "idempotency_key": idempotency_key,
    }
    body.update({name: value for name, value in optional.items() if value is not None})
    return body


def result_body(
    ok: bool, result: Any = None, error: str | None = None, compensation: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The body of `POST .../result`. `compensation` (a success only): what undoes the action, `{"action": name,
    "arguments": {...}}`, asked of the agent as an approval request if its run is undone."""
    if ok:
        if error:
            raise ValueError("A successful result has no error.")
        body: dict[str, Any] = {"ok": True, "result": result}
        if compensation is not None:
            body["compensation"] = compensation_body(compensation)
        return body
    if compensation is not None:
        raise ValueError("Only a successful result declares what undoes it.")
    if not error or not error.strip():
        raise ValueError("A failed result needs the error's text.")
    return {"ok": False, "error": error}


def compensation_body(compensation: Mapping[str, Any]) -> dict[str, Any]:
    """`{"action", "arguments"}`, checked for shape before anything is sent."""
    if not isinstance(compensation, Mapping) or set(compensation) != {"action", "arguments"}:
        raise ValueError('A compensation is {"action": name, "arguments": {...}}.')
    action, arguments = compensation["action"], compensation["arguments"]
    if not isinstance(action, str) or not action:
        raise ValueError("A compensation's action is a tool's name (1-100 of A-Z a-z 0-9 _ . : -).")
    if not isinstance(arguments, Mapping):
        raise TypeError(f"A compensation's arguments must be a mapping, not {type(arguments).__name__}.")
    return {"action": action, "arguments": dict(arguments)}


class _Base:
    def __init__(self, *, timeout: float, retries: int, backoff: float, max_backoff: float) -> None:
        self._timeout = timeout
        self._policy = RetryPolicy(retries=retries, backoff=backoff, max_backoff=max_backoff)
        self._traces = _tracing.Traces()

    def _headers(self, token: str) -> dict[str, str]:
        if not token:
            raise ValueError("An API token is required (manage.py create_api_token USER).")
        return {"Authorization": f"Bearer {token}", "Accept": "application/json", "User-Agent": _USER_AGENT}

    _http: httpx.Client | httpx.AsyncClient

    def card_url(self, card_id: str | int | None) -> str | None:
        """The address of a request's card in the console (`<console>/approvals/<card_id>/`), where a person
        decides it: what to show while waiting (a request's `url` is its API address, which only the agent's
        token may read). None for a request without a card (`approval: "never"`)."""
        if card_id is None:
            return None
        return str(self._http.base_url.join(f"approvals/{card_id}/"))

    def _request_kwargs(self, op: Send) -> dict[str, Any]:
        return {
            "params": op.params,
            "json": op.json,
            # Made per call (and per retry): each is a span of its own at the console, in the request's trace.
            "headers": self._traces.headers(op.trace_key),
            "timeout": httpx.Timeout(self._timeout, read=self._timeout + op.held_for),
        }


class Client(_Base):
    """A blocking client of the console's approval requests. One per process (it keeps connections open);
    close it, or use it as a context manager.

    `timeout`: seconds for each HTTP call (a long poll gets its wait on top). `transport`: an httpx transport
    (tests give an `httpx.MockTransport`). Calls that are safe to repeat are retried `retries` times after a
    transport error, a 429 or a 5xx, with exponential backoff from `backoff` seconds up to `max_backoff`."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
    ) -> None:
        super().__init__(timeout=timeout, retries=retries, backoff=backoff, max_backoff=max_backoff)
        self._http: httpx.Client = httpx.Client(base_url=base_url, headers=self._headers(token), transport=transport)

    def request_approval(
        self,
        channel: str,
        action: str,
        arguments: Mapping[str, Any],
        *,
        idempotency_key: str,
        rationale: str | Mapping[str, Any] | None = None,
        current: Mapping[str, Any] | None = None,
        risk: Risk | None = None,
        display: Mapping[str, str] | None = None,
        schema: Mapping[str, Any] | None = None,
        run: str | None = None,
        callback_url: str | None = None,
        expires_in: int | None = None,
        on_expiry: OnExpiry | None = None,
        approval: Approval | None = None,
    ) -> ApprovalRequest:
        """Asks for a person's sign-off on one action; the same `idempotency_key` gives back the same request
        (its decision and execution included), so asking again after a crash is safe. The key names the action
        and its arguments on the channel: asking again with another `current` or rationale is the same request
        (the first ask's description stands); other arguments under the same key are a `Conflict`."""
        body = approval_request_body(
            channel,
            action,
            arguments,
            idempotency_key=idempotency_key,
            rationale=rationale,
            current=current,
            risk=risk,
            display=display,
            schema=schema,
            run=run,
            callback_url=callback_url,
            expires_in=expires_in,
            on_expiry=on_expiry,
            approval=approval,
        )
        return self._run(_protocol.request_approval(body, self._policy))

    def get(self, id: str, wait: int = 0) -> ApprovalRequest:
        """The request now, or as soon as it is decided within `wait` seconds (0-60)."""
        return self._run(_protocol.get(id, wait, self._policy))

    def wait(self, id: str, timeout: float | None = None, poll: int = 25) -> ApprovalRequest:
        """Long-polls (`poll` seconds at a time) until the request is decided, expired or cancelled, and returns
        it; `WaitTimeout` after `timeout` seconds (None: as long as it takes; the request expires at the latest)."""
        return self._run(_protocol.wait(id, timeout, poll, self._policy))

    def consume(self, id: str, arguments_digest: str, nonce: str | None = None) -> Go:
        """The one "go" for the approved arguments whose digest this is (`arguments_digest(request.arguments)`).
        `nonce` names this consume (default: a new random one per call, reused by its retries): the console
        gives the same go again to the same nonce while nothing is reported, so a lost answer is asked again.
        On a shadow card the answer is `go=False, shadow=True`: do not run the action."""
        return self._run(_protocol.consume(id, arguments_digest, self._policy, nonce))

    def report(
        self,
        id: str,
        ok: bool,
        result: Any = None,
        error: str | None = None,
        compensation: Mapping[str, Any] | None = None,
    ) -> Execution:
        """Completes the receipt with the action's outcome: `ok=True, result=...` or `ok=False, error="..."`.
        `compensation` (a success only): what undoes it, `{"action", "arguments"}` (docs/external-agents.md,
        "Undo")."""
        return self._run(_protocol.report(id, result_body(ok, result, error, compensation), self._policy))

    def pending_compensations(self, run_id: str | None = None) -> list[ApprovalRequest]:
        """The compensations a person approved for this agent to run, not yet consumed (its runs being undone),
        by run and in undo order: run each as any approved request (`run_compensations` does)."""
        return self._run(_protocol.pending_compensations(run_id, self._policy))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _run(self, flow: Flow[T]) -> T:
        sent: Any = None
        raised: BaseException | None = None
        while True:
            try:
                op = flow.send(sent) if raised is None else flow.throw(raised)
            except StopIteration as done:
                return cast(T, done.value)
            sent, raised = None, None
            try:
                sent = self._do(op)
            except BaseException as exc:  # the flow decides; whatever it does not handle comes back out
                raised = exc

    def _do(self, op: Send | Sleep | Call) -> Any:
        if isinstance(op, Send):
            response = self._http.request(op.method, op.path, **self._request_kwargs(op))
            self._traces.answered(op.trace_key, response)
            return response
        if isinstance(op, Sleep):
            time.sleep(op.seconds)
            return None
        return op.function(**op.kwargs)


class AsyncClient(_Base):
    """`Client` for asyncio: the same calls, awaited."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
    ) -> None:
        super().__init__(timeout=timeout, retries=retries, backoff=backoff, max_backoff=max_backoff)
        self._http: httpx.AsyncClient = httpx.AsyncClient(
            base_url=base_url, headers=self._headers(token), transport=transport
        )

    async def request_approval(
        self,
        channel: str,
        action: str,
        arguments: Mapping[str, Any],
        *,
        idempotency_key: str,
        rationale: str | Mapping[str, Any] | None = None,
        current: Mapping[str, Any] | None = None,
        risk: Risk | None = None,
        display: Mapping[str, str] | None = None,
        schema: Mapping[str, Any] | None = None,
        run: str | None = None,
        callback_url: str | None = None,
        expires_in: int | None = None,
        on_expiry: OnExpiry | None = None,
        approval: Approval | None = None,
    ) -> ApprovalRequest:
        body = approval_request_body(
            channel,
            action,
            arguments,
            idempotency_key=idempotency_key,
            rationale=rationale,
            current=current,
            risk=risk,
            display=display,
            schema=schema,
            run=run,
            callback_url=callback_url,
            expires_in=expires_in,
            on_expiry=on_expiry,
            approval=approval,
        )
        return await self._run(_protocol.request_approval(body, self._policy))

    async def get(self, id: str, wait: int = 0) -> ApprovalRequest:
        return await self._run(_protocol.get(id, wait, self._policy))

    async def wait(self, id: str, timeout: float | None = None, poll: int = 25) -> ApprovalRequest:
        return await self._run(_protocol.wait(id, timeout, poll, self._policy))

    async def consume(self, id: str, arguments_digest: str, nonce: str | None = None) -> Go:
        return await self._run(_protocol.consume(id, arguments_digest, self._policy, nonce))

    async def report(
        self,
        id: str,
        ok: bool,
        result: Any = None,
        error: str | None = None,
        compensation: Mapping[str, Any] | None = None,
    ) -> Execution:
        return await self._run(_protocol.report(id, result_body(ok, result, error, compensation), self._policy))

    async def pending_compensations(self, run_id: str | None = None) -> list[ApprovalRequest]:
        return await self._run(_protocol.pending_compensations(run_id, self._policy))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _run(self, flow: Flow[T]) -> T:
        sent: Any = None
        raised: BaseException | None = None
        while True:
            try:
                op = flow.send(sent) if raised is None else flow.throw(raised)
            except StopIteration as done:
                return cast(T, done.value)
            sent, raised = None, None
            try:
                sent = await self._do(op)
            except BaseException as exc:  # cancellation included: the flow re-raises what it does not handle
                raised = exc

    async def _do(self, op: Send | Sleep | Call) -> Any:
        if isinstance(op, Send):
            response = await self._http.request(op.method, op.path, **self._request_kwargs(op))
            self._traces.answered(op.trace_key, response)
            return response
        if isinstance(op, Sleep):
            await asyncio.sleep(op.seconds)
            return None
        result = op.function(**op.kwargs)
        return await result if inspect.isawaitable(result) else result
