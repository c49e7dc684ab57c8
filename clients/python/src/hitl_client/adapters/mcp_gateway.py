"""An MCP gateway: an MCP server in front of another, whose risky tool calls a person signs off on the console.

    python -m hitl_client.adapters.mcp_gateway --upstream "python examples/mcp_refund_server.py" \\
        --channel payments --approve refund_order

The gateway lists the upstream server's tools as its own. A call the policy names (`--approve NAME`, or a
predicate on the tool's name and arguments) becomes a card on the console, with the tool's `inputSchema` as the
request's `schema` (so a reviewer may edit the arguments); the gateway waits for the decision and forwards only
an approved call upstream, once, with the arguments the person approved: it takes the console's one "go"
(`consume`, bound to the approved arguments' digest) before forwarding, and reports the upstream's answer after
(the client's `require_approval`, so the rules of exactly once live in one place). The call's result says what
was decided ("Approved by bob", "Edited by bob: amount_cents 4200 -> 2500", with the upstream's own content
after it); a rejection, an expiry or a cancel is an error result with the reviewer's comment, and nothing was
forwarded; its `_meta["hitl/decision"]` says the same as data, as for an approved call. Calls the policy does
not name pass through untouched.

The gateway fails closed on its own configuration: before it serves anything it lists the upstream's tools, and
a name in `--approve` that the upstream does not have (a typo, the wrong server) stops it (exit 2, one error
line) rather than guard nothing under that name; a gateway with no `--approve` at all starts only with
`--allow-unguarded`. An upstream that cannot be started or reached is one error line and exit 1.

MCP has no call id that outlives a connection, so a call's idempotency key is the client's, when it sends one
in the request's `_meta` under `hitl/idempotency-key` (1-200 characters, used as is), and otherwise
`mcp:<session>:<digest of tool and arguments>:<n>`, where n counts the identical calls (same tool, same
arguments) this gateway process has settled in its session. The session is `--session`, or by default one the
process makes for itself (`gw-<random>`): two gateway processes of one token never share a key unless they are
given the same session, as a gateway restarted to continue the calls of the one before is.

The same key is the same request: a call whose go was taken before is never forwarded again; it answers the
recorded result, or, when the gateway died between the go and the upstream's answer, that the outcome is
unknown (a person checks). docs/external-agents.md says exactly what this guarantees.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import logging
import os
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import mcp_types as types
from mcp import Client as McpClient
from mcp import StdioServerParameters
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

from hitl_client import _tracing
from hitl_client.adapters._session import Session
from hitl_client.client import AsyncClient, OnExpiry, Risk
from hitl_client.digest import arguments_digest
from hitl_client.errors import (
    ActionFailed,
    Conflict,
    Declined,
    HitlError,
    Locked,
    OutcomeUnknown,
    ReportFailed,
    WaitTimeout,
)
from hitl_client.models import ApprovalRequest, RequestStatus

__all__ = [
    "DECISION_META",
    "IDEMPOTENCY_KEY_META",
    "Gateway",
    "GatewayStartError",
    "UnknownTools",
    "decline_elicitation",
    "main",
    "serve",
]

if sys.version_info < (3, 11):  # pragma: no cover - anyio brings the backport there
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger("hitl_client.mcp_gateway")

# The `_meta` key under which a client names its call (stable across its retries and the gateway's restarts).
IDEMPOTENCY_KEY_META = "hitl/idempotency-key"
# The `_meta` key of an approved call's result: what the console decided, for clients that read it as data.
DECISION_META = "hitl/decision"
# The contract's limit on an idempotency key; a session name leaves room for the digest and the counter.
_MAX_KEY = 200
_MAX_SESSION = 100
# Upstream failures after which the tool may or may not have run: the connection went, or the answer never came.
_ANSWER_LOST = frozenset({types.CONNECTION_CLOSED, types.REQUEST_TIMEOUT})

NeedsApproval = Collection[str] | Callable[[str, Mapping[str, Any]], bool]
Describe = Callable[[str, Mapping[str, Any]], Any]


class GatewayStartError(Exception):
    """The gateway cannot serve: its upstream could not be started or reached, or its options do not fit (a
    policy that names tools the upstream does not have). Nothing was served, nothing was forwarded. The message
    is one line, for the operator; `exit_code` the command's (2: the options, 1: the upstream)."""

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class UnknownTools(GatewayStartError, ValueError):
    """The policy names tools the upstream server does not have (a typo, or the wrong server): a gateway that
    started anyway would guard nothing under those names, and forward the real tool's calls without a card."""

    def __init__(self, unknown: Collection[str], available: Collection[str]) -> None:
        self.unknown, self.available = sorted(unknown), sorted(available)
        names = []
        for name in self.unknown:
            close = difflib.get_close_matches(name, self.available, n=1, cutoff=0.5)
            names.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
        super().__init__(
            f"the upstream server has no tool named {', '.join(names)}; its tools: "
            f"{', '.join(self.available) or 'none'}. The gateway does not start: a name that matches no tool "
            "would guard nothing.",
            exit_code=2,
        )


class _UpstreamToolError(Exception):
    """The upstream tool ran and answered an error result (`isError`): recorded as the action's failure."""

    def __init__(self, result: types.CallToolResult) -> None:
        super().__init__(_text_of(result) or "the upstream tool answered an error")
        self.result = result


class _UpstreamRefused(Exception):
    """The upstream answered the forwarded call with a JSON-RPC error instead of a result (it refused it, or the
    tool failed in a way it did not turn into an error result): recorded as the action's failure, with a text
    that says which, and told to the client as an error result (not a raw protocol error)."""

    def __init__(self, cause: MCPError) -> None:
        said = f"the JSON-RPC error {cause.code}: {(cause.message or '').rstrip('.')}"
        if "elicitation" in (cause.message or "").lower():
            text = (
                "the upstream asked for input (elicitation/create) during the call, and input is not relayed for an "
                "approved call (a person approved these arguments, not what is asked on top of them); it ended "
                f"with {said}"
            )
        else:
            text = f"the upstream answered {said}"
        super().__init__(text)
        self.cause = cause


class _UpstreamAnswerLost(BaseException):
    """The call was forwarded and its answer never came back: the tool may or may not have run. A BaseException
    on purpose: `require_approval` reports an Exception as the action's failure, and this is no failure it
    knows of, so the receipt stays "consumed, outcome unknown" for a person to check."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class _Outcome:
    result: types.CallToolResult
    # The call is done with (it ran, was declined, or its go was used before): an identical call after it is a
    # new call. A call stopped before that (a kill switch, a wait that timed out, the console out of reach)
    # is not: the same call again continues it, under the same key.
    settled: bool


@dataclass
class _Counters:
    """Per session: how many identical calls (by tool and arguments) have settled, and who is running which key."""

    settled: dict[str, int] = field(default_factory=dict)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)


class Gateway:
    """An MCP server (`self.server`, the SDK's low-level `Server`) in front of `upstream` (an entered `mcp.Client`
    or anything with its `list_tools(cursor=)` and `call_tool(name, arguments, meta=)`).

    `needs_approval`: the names of the tools whose every call needs a person's sign-off, or a predicate of a
    call's tool name and arguments (one that raises is taken as a yes: fail closed). Every name must be a tool
    of the upstream: the gateway lists the upstream's tools before it serves anything (`verify()`, which
    `serve_stdio` and the first request run) and refuses to serve, `UnknownTools`, when one is missing. An empty
    collection guards nothing and is refused unless `allow_unguarded=True` says that is meant. Those calls are
    asked on `channel` through `console`. `session` names this gateway's calls in their idempotency keys; by
    default each Gateway (each gateway process) makes its own, so two conversations never share a key (name one
    to let a restarted gateway continue the calls of the one before: see the module's docstring). `rationale`
    and `current` may be callables of the tool's name and arguments; `edits=False` sends no schema (a person may
    then approve or reject, not edit). `timeout`: seconds to wait for a decision (None: until the request expires)."""

    def __init__(
        self,
        upstream: Any,
        console: AsyncClient,
        *,
        channel: str,
        needs_approval: NeedsApproval,
        session: str | None = None,
        allow_unguarded: bool = False,
        name: str = "hitl-mcp-gateway",
        instructions: str | None = None,
        rationale: str | Mapping[str, Any] | Describe | None = None,
        current: Describe | None = None,
        risk: Risk | None = None,
        display: Mapping[str, str] | None = None,
        edits: bool = True,
        expires_in: int | None = None,
        on_expiry: OnExpiry | None = None,
        timeout: float | None = None,
        poll: int = 25,
    ) -> None:
        if not isinstance(console, AsyncClient):
            raise TypeError("The gateway needs an AsyncClient (it serves MCP on asyncio).")
        if session is None:
            session = f"gw-{uuid.uuid4().hex}"  # this gateway's own: no other process makes its keys
        # Its requests on the console: their run (one timeline of the session's cards), asking, the guarded forward.
        self._session = Session(console, session, timeout=timeout, poll=poll, max_name=_MAX_SESSION)
        if isinstance(needs_approval, str):
            raise TypeError("needs_approval is a collection of tool names (or a predicate), not one string.")
        if not callable(needs_approval):
            needs_approval = frozenset(needs_approval)
            if not needs_approval and not allow_unguarded:
                raise ValueError(
                    "needs_approval names no tool: this gateway would guard nothing. Name the tools whose calls "
                    "need approval, or pass allow_unguarded=True if passing every call through is meant."
                )
        self.upstream, self.console, self.channel, self.session = upstream, console, channel, session
        self.needs_approval = needs_approval
        self.rationale, self.current, self.risk, self.display = rationale, current, risk, display
        self.edits, self.expires_in, self.on_expiry = edits, expires_in, on_expiry
        self.timeout, self.poll = timeout, poll
        self._tools: dict[str, types.Tool] = {}
        self._counters = _Counters()
        # Whether the policy's names were checked against the upstream's tools (None: not yet), and why not.
        self._verified: bool | None = None
        self._refusal: GatewayStartError | None = None
        self.server: Server[Any] = Server(
            name, instructions=instructions, on_list_tools=self._list_tools, on_call_tool=self._call_tool
        )

    @property
    def run_id(self) -> str | None:
        """The session's external run on the console (its first request opens it), once known."""
        return self._session.run_id

    async def verify(self) -> list[types.Tool]:
        """Lists every upstream tool, and checks that each name the policy gives is one of them (`UnknownTools`
        otherwise: the gateway then refuses every request). Returns the tools."""
        tools: list[types.Tool] = []
        cursor: str | None = None
        while True:
            listing = await self.upstream.list_tools(cursor=cursor)
            tools.extend(listing.tools)
            cursor = listing.next_cursor
            if not cursor:
                break
        self._tools.update({tool.name: tool for tool in tools})
        if not callable(self.needs_approval):
            unknown = set(self.needs_approval) - {tool.name for tool in tools}
            if unknown:
                self._verified, self._refusal = False, UnknownTools(unknown, [tool.name for tool in tools])
                raise self._refusal
        self._verified = True
        return tools

    async def _serving(self) -> None:
        """Before the first request is served: the policy checked against the upstream (once)."""
        if self._verified is None:
            try:
                await self.verify()
            except UnknownTools as exc:
                logger.error("Refusing to serve: %s", exc)
        if self._refusal is not None:
            raise MCPError(types.INTERNAL_ERROR, f"The HITL gateway refuses to serve: {self._refusal}")

    async def serve_stdio(self) -> None:
        """Serves one MCP client over this process's stdin and stdout until it disconnects, once `verify()` passed
        (it raises `UnknownTools` before serving anything otherwise)."""
        if not self._verified:
            await self.verify()
        async with stdio_server() as (read_stream, write_stream):
            await self.server.run(read_stream, write_stream, self.server.create_initialization_options())

    # --- tools/list ---

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        await self._serving()
        listing = await self.upstream.list_tools(cursor=params.cursor if params else None)
        self._tools.update({tool.name: tool for tool in listing.tools})
        return types.ListToolsResult(tools=listing.tools, next_cursor=listing.next_cursor)

    async def _tool(self, name: str) -> types.Tool | None:
        """The upstream's tool of that name (its inputSchema is the card's schema), listed again if unknown."""
        if name not in self._tools:
            cursor: str | None = None
            while True:
                listing = await self.upstream.list_tools(cursor=cursor)
                self._tools.update({tool.name: tool for tool in listing.tools})
                cursor = listing.next_cursor
                if name in self._tools or not cursor:
                    break
        return self._tools.get(name)

    # --- tools/call ---

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        await self._serving()
        name, arguments = params.name, dict(params.arguments or {})
        meta: Mapping[str, Any] = params.meta or {}
        if not self._asks(name, arguments):
            # Not the gateway's business: forwarded as the client sent it, answered as the upstream answered.
            forwarded = {key: value for key, value in meta.items() if not _reserved(key)}
            return _without_reserved_meta(await self.upstream.call_tool(name, arguments, meta=forwarded or None))
        tool = await self._tool(name)
        if tool is None:
            # As the upstream would answer: nothing to ask a person about.
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {name}")
        try:
            key, counted = self._key(name, arguments, meta)
        except ValueError as exc:
            return _error(f"{name} was not run: {exc} Nothing was asked or forwarded.")
        lock = self._counters.locks.setdefault(key, asyncio.Lock())
        # An identical call that arrives while this key is being asked or run waits for it, then gets its
        # recorded outcome: two calls never race for one go (the loser would read "outcome unknown").
        async with lock:
            # The span of the gated call (without OpenTelemetry, nothing): the ask, the wait, the go, the forward
            # and the report inside it, in its trace.
            with _tracing.gate(name, self.channel) as gate:
                outcome = await self._ask_and_forward(ctx, tool, arguments, key, gate)
        if outcome.settled and counted is not None:
            base, n = counted
            self._counters.settled[base] = max(self._counters.settled.get(base, 0), n)
        return outcome.result

    def _asks(self, name: str, arguments: Mapping[str, Any]) -> bool:
        if callable(self.needs_approval):
            try:
                return bool(self.needs_approval(name, arguments))
            except Exception:
                logger.exception("The approval policy failed on %s: asking a person (fail closed).", name)
                return True
        return name in self.needs_approval

    def _key(
        self, name: str, arguments: Mapping[str, Any], meta: Mapping[str, Any]
    ) -> tuple[str, tuple[str, int] | None]:
        """The call's idempotency key, and (for a key the gateway made) the count it was made with."""
        given = meta.get(IDEMPOTENCY_KEY_META)
        if given is not None:
            if not isinstance(given, str) or not 1 <= len(given) <= _MAX_KEY:
                raise ValueError(f"_meta[{IDEMPOTENCY_KEY_META!r}] must be a string of 1 to {_MAX_KEY} characters.")
            return given, None
        try:
            digest = arguments_digest({"tool": name, "arguments": arguments})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"its arguments are not JSON ({exc}).") from None
        base = f"mcp:{self.session}:{digest}"
        n = self._counters.settled.get(base, 0) + 1
        return f"{base}:{n}", (base, n)

    async def _ask_and_forward(
        self,
        ctx: ServerRequestContext[Any],
        tool: types.Tool,
        arguments: dict[str, Any],
        key: str,
        gate: _tracing.Gate,
    ) -> _Outcome:
        name = tool.name
        described = self._describe(ctx, tool, arguments)
        forwarded: dict[str, Any] = {}
        called = False

        async def forward(**approved: Any) -> Any:
            nonlocal called
            called = True
            forwarded.update(approved)
            try:
                result = await self.upstream.call_tool(name, approved)
            except MCPError as exc:
                if exc.code in _ANSWER_LOST:
                    raise _UpstreamAnswerLost(exc) from exc
                # The upstream answered with an error: it refused the call, or could not finish it (recorded as
                # failed: it answered, so it is not running any more).
                raise _UpstreamRefused(exc) from exc
            except Exception as exc:
                raise _UpstreamAnswerLost(exc) from exc
            if result.is_error:
                raise _UpstreamToolError(result)
            return _recordable(result)

        guarded = self._session.guard(self.channel, name, key, described, forward)
        try:
            request = await self._session.ask(
                self.channel, name, arguments, key, {**described, "schema": described["schema"] or None}
            )
            gate.saw(request)
            decided = request if request.decided else await self._wait(ctx, request)
            gate.saw(decided)
            value = await guarded(**arguments)
        except Declined as exc:
            declined = _error(_declined(name, exc.request))
            return _Outcome(_with_decision(declined, exc.request, None), settled=True)
        except (OutcomeUnknown, ActionFailed) as exc:
            return _Outcome(_error(f"Not forwarded again: {exc}"), settled=True)
        except _UpstreamToolError as exc:
            note = f"{_decision(name, arguments, decided, forwarded)} The upstream answered an error."
            return _Outcome(_with_note(exc.result, note, decided, forwarded), settled=True)
        except _UpstreamRefused as exc:
            note = (
                f"{_decision(name, arguments, decided, forwarded)} The upstream did not answer with a result: {exc}. "
                "Recorded as failed; it is not forwarded again."
            )
            return _Outcome(_with_note(_error(""), note, decided, forwarded, keep=False), settled=True)
        except _UpstreamAnswerLost as exc:
            logger.error("%s was forwarded (request %s) and its answer was lost: %r", name, decided.id, exc.cause)
            return _Outcome(
                _error(
                    f"{name} was approved and forwarded (request {decided.id}), and the upstream's answer was lost "
                    f"({exc}): it may or may not have run. It is not forwarded again; a person checks."
                ),
                settled=True,
            )
        except ReportFailed as exc:
            logger.error("%s ran (request %s) but the console did not take its result.", name, decided.id)
            note = (
                f"{_decision(name, arguments, decided, forwarded)} (The console did not record the result: "
                "its card says the outcome is unknown.)"
            )
            return _Outcome(_with_note(_replayed(exc.result), note, decided, forwarded), settled=True)
        except Locked:
            return _Outcome(
                _error(
                    f"{name} was not run: a kill switch stops the {self.channel!r} channel. Nothing was forwarded; "
                    "call again once it is released (the same call continues this request)."
                ),
                settled=False,
            )
        except WaitTimeout as exc:
            return _Outcome(_error(f"{name} was not run: {exc} Call again to keep waiting."), settled=False)
        except Conflict as exc:
            return _Outcome(_error(f"{name} was not run: the console refused the request ({exc})."), settled=False)
        except HitlError as exc:
            logger.warning("%s: the console could not be asked: %r", name, exc)
            return _Outcome(
                _error(f"{name} was not run: the approval console could not be asked ({exc}). Nothing was forwarded."),
                settled=False,
            )
        if not called:
            if isinstance(value, dict) and value.get("shadow") is True and "request_id" in value:
                text = (
                    f"{name} was not forwarded: its channel is in shadow mode, and a person carries it out by hand "
                    f"with {json.dumps(value.get('arguments'), sort_keys=True)}."
                )
                # An error result: the tool's output (and any structured content its outputSchema promises) is not
                # there, because the tool did not run.
                return _Outcome(_error(text), settled=True)
            note = f"{name} was done before (request {decided.id}); it is not forwarded again. Its recorded result:"
            return _Outcome(_with_note(_replayed(value), note, decided, None), settled=True)
        note = _decision(name, arguments, decided, forwarded)
        return _Outcome(_with_note(_replayed(value), note, decided, forwarded), settled=True)

    def _describe(
        self, ctx: ServerRequestContext[Any], tool: types.Tool, arguments: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The request's fields besides its arguments (also what require_approval sends again)."""
        rationale = self.rationale(tool.name, arguments) if callable(self.rationale) else self.rationale
        if rationale is None:
            who = _client_name(ctx)
            rationale = f"{who} called the MCP tool {tool.name} through the gateway (session {self.session})."
            if tool.description:
                rationale += f" The tool: {tool.description.strip()}"
        return {
            "rationale": rationale,
            "current": self.current(tool.name, arguments) if self.current else None,
            "risk": self.risk,
            "display": self.display,
            "schema": tool.input_schema if self.edits else False,
            "expires_in": self.expires_in,
            "on_expiry": self.on_expiry,
        }

    async def _wait(self, ctx: ServerRequestContext[Any], request: ApprovalRequest) -> ApprovalRequest:
        """Long-polls until the request is decided, telling the client (when it asked for progress) that it waits
        for a person: clients that reset their timeout on progress keep the call open."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        polls = 0
        while True:
            where = self.console.card_url(request.card_id)
            message = (
                f"Waiting for a person's decision on the console: {where} (card {request.card_id}, request "
                f"{request.id})."
            )
            try:
                await ctx.session.report_progress(polls, None, message)
            except Exception:  # the client went away, or takes no progress: the wait goes on regardless
                logger.debug("Progress could not be reported.", exc_info=True)
            seconds = self.poll if deadline is None else max(0, min(self.poll, int(deadline - time.monotonic()) + 1))
            request = await self.console.get(request.id, wait=seconds)
            if request.decided:
                return request
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(request, self.timeout or 0)
            polls += 1


# --- what the client reads ---


def _decision(name: str, asked: Mapping[str, Any], decided: ApprovalRequest, ran_with: Mapping[str, Any]) -> str:
    who = decided.decided_by or "a reviewer"
    said = f" Their comment: {decided.comment}" if decided.comment else ""
    changes = _changes(asked, ran_with)
    if changes:
        return f"Edited by {who}: {changes}. {name} was forwarded once, with the edited arguments.{said}"
    return f"Approved by {who}. {name} was forwarded once.{said}"


def _changes(asked: Mapping[str, Any], approved: Mapping[str, Any]) -> str:
    parts = []
    for name in sorted(set(asked) | set(approved)):
        if name not in approved:
            parts.append(f"{name} removed")
        elif name not in asked:
            parts.append(f"{name} {_json(approved[name])} added")
        elif asked[name] != approved[name]:
            parts.append(f"{name} {_json(asked[name])} -> {_json(approved[name])}")
    return ", ".join(parts)


def _declined(name: str, request: ApprovalRequest) -> str:
    if request.status is RequestStatus.REJECTED:
        who = request.decided_by or "a reviewer"
        why = f" (reason: {request.reason})" if request.reason else ""
        said = f" Their comment: {request.comment}" if request.comment else ""
        return f"Rejected by {who}{why}: {name} was not run, nothing was forwarded.{said}"
    if request.status is RequestStatus.EXPIRED:
        return f"Nobody approved {name} in time (the request expired): it was not run, nothing was forwarded."
    return f"The request to run {name} was cancelled: it was not run, nothing was forwarded. {request.reason}".rstrip()


def _with_note(
    result: types.CallToolResult,
    note: str,
    decided: ApprovalRequest,
    ran_with: Mapping[str, Any] | None,
    *,
    keep: bool = True,
) -> types.CallToolResult:
    """The upstream's result with the decision first: a text part, and the same as data in `_meta` (`keep=False`:
    the note alone, `result` has no content of the upstream's)."""
    noted = types.CallToolResult(
        content=[types.TextContent(text=note), *(result.content if keep else [])],
        structured_content=result.structured_content,
        is_error=result.is_error,
        _meta=result.meta,
    )
    return _with_decision(noted, decided, ran_with, arguments=dict(ran_with) if ran_with is not None else _UNSET)


_UNSET: Any = object()


def _with_decision(
    result: types.CallToolResult,
    decided: ApprovalRequest,
    ran_with: Mapping[str, Any] | None,
    *,
    arguments: Any = _UNSET,
) -> types.CallToolResult:
    """`result` with what the console decided as data, in `_meta["hitl/decision"]`: for an approved call and a
    declined one alike (`forwarded` says whether the upstream got it; `arguments`, what it got, or what was
    approved when it ran before; None when nothing was approved)."""
    decision = {
        "request_id": decided.id,
        "status": decided.status.value,
        "decided_by": decided.decided_by,
        "edited": decided.edited,
        "comment": decided.comment,
        "reason": decided.reason,
        "forwarded": ran_with is not None,
        "arguments": decided.arguments if arguments is _UNSET else arguments,
    }
    return result.model_copy(update={"meta": {**(result.meta or {}), DECISION_META: decision}})


async def decline_elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
    """The gateway's answer to an upstream that asks its client for input (MCP elicitation) during a call:
    declined. The gateway relays no elicitation: for an approved call a person approved its arguments, and input
    asked for on top of them (an amount, a confirmation, a URL to visit) is not what they saw; for the calls that
    pass through it has no way to tell whose call asks. The upstream hears "decline" and ends the call its own
    way; for an approved call, whatever it answers then is recorded as the call's outcome (an error result or a
    JSON-RPC error as its failure). Pass it as `elicitation_callback` to the upstream's `mcp.Client` (`serve`
    does)."""
    logger.warning("The upstream asked for input, declined (the gateway relays no elicitation): %s", params.message)
    return types.ElicitResult(action="decline")


def _recordable(result: types.CallToolResult) -> dict[str, Any]:
    """The upstream's result as the console records it (and gives back to a retried call)."""
    return _without_reserved_meta(result).model_dump(mode="json", by_alias=True, exclude_none=True)


def _replayed(recorded: Any) -> types.CallToolResult:
    try:
        return types.CallToolResult.model_validate(recorded, by_alias=True)
    except Exception:  # recorded by something else than this gateway: shown as its JSON, not as the tool's output
        return _error(f"The recorded result is not an MCP tool result: {_json(recorded)}")


def _without_reserved_meta(result: types.CallToolResult) -> types.CallToolResult:
    """The upstream's protocol-level `_meta` (its serverInfo, say) is about its connection, not this one."""
    if not result.meta:
        return result
    kept = {key: value for key, value in result.meta.items() if not _reserved(key)}
    return result.model_copy(update={"meta": kept or None})


def _reserved(key: str) -> bool:
    """A `_meta` key the protocol reserves (`io.modelcontextprotocol/...`, `...mcp/...`), or the SDK's own."""
    prefix, slash, _ = key.partition("/")
    labels = prefix.split(".") if slash else []
    return "modelcontextprotocol" in labels or "mcp" in labels or key == "progress_token" or key == "progressToken"


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def _text_of(result: types.CallToolResult) -> str:
    return " ".join(part.text for part in result.content if isinstance(part, types.TextContent))


def _client_name(ctx: ServerRequestContext[Any]) -> str:
    try:
        params = ctx.session.client_params
        if params is not None and params.client_info.name:
            return f"The MCP client {params.client_info.name!r}"
    except Exception:
        pass
    return "An MCP client"


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


# --- the command ---


async def serve(
    upstream: str,
    console: AsyncClient,
    *,
    upstream_env: Mapping[str, str] | None = None,
    **options: Any,
) -> None:
    """Starts the upstream server (a command to run over stdio, or an http(s) URL of a streamable-HTTP server),
    checks the policy against its tools, and serves the gateway in front of it over stdio. `options` are the
    Gateway's. `GatewayStartError` (`UnknownTools` among them) when it cannot start: nothing was served."""
    target: StdioServerParameters | str
    if upstream.startswith(("http://", "https://")):
        target = upstream
    else:
        try:
            command = shlex.split(upstream)
        except ValueError as exc:
            raise GatewayStartError(f"--upstream {upstream!r} is not a command line: {exc}.", exit_code=2) from None
        if not command:
            raise GatewayStartError(
                "--upstream is empty: give the command that starts the upstream MCP server.", exit_code=2
            )
        target = StdioServerParameters(command=command[0], args=command[1:], env=dict(upstream_env or {}))
    async with AsyncExitStack() as stack:
        try:
            connected = await stack.enter_async_context(McpClient(target, elicitation_callback=decline_elicitation))
        except Exception as exc:  # an ExceptionGroup of the SDK's task groups, as often as not
            raise GatewayStartError(
                f"the upstream server {upstream!r} could not be started or reached: {_leaf_text(exc)}."
            ) from exc
        options.setdefault("instructions", connected.instructions)
        gateway = Gateway(connected, console, **options)
        try:
            await gateway.verify()
        except GatewayStartError:
            raise
        except Exception as exc:
            raise GatewayStartError(
                f"the upstream server {upstream!r} did not list its tools: {_leaf_text(exc)}."
            ) from exc
        logger.info(
            "MCP gateway (pid %d) in front of %s: calls of %s need approval on %r (session %s).",
            os.getpid(),
            upstream,
            sorted(gateway.needs_approval) if not callable(gateway.needs_approval) else "a policy",
            gateway.channel,
            gateway.session,
        )
        await gateway.serve_stdio()


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; the exception itself when it is none."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _leaf_text(exc: BaseException) -> str:
    leaf = _leaves(exc)[0]
    text = str(leaf).strip() or "(no message)"
    return f"{type(leaf).__name__}: {text}" if not isinstance(leaf, MCPError) else text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hitl_client.adapters.mcp_gateway",
        description="An MCP server over stdio in front of another MCP server: the calls of the tools named with "
        "--approve wait for a person's sign-off on the HITL console (HITL_URL, HITL_TOKEN) and are forwarded once.",
    )
    parser.add_argument(
        "--upstream",
        required=True,
        help="the command that starts the upstream MCP server over stdio, or its http(s) URL",
    )
    parser.add_argument("--channel", required=True, help="the console channel the approval requests are asked on")
    parser.add_argument(
        "--approve",
        action="append",
        default=[],
        metavar="TOOL",
        help="a tool whose calls need approval (repeat); each must be a tool of the upstream, or the gateway does "
        "not start",
    )
    parser.add_argument(
        "--allow-unguarded",
        action="store_true",
        help="start with no --approve at all, every call passing through (refused otherwise)",
    )
    parser.add_argument(
        "--session",
        help="names this gateway's calls in their idempotency keys (default: a new one for each process); give "
        "the same one to a restarted gateway that must continue the calls of the one before",
    )
    parser.add_argument("--name", default="hitl-mcp-gateway", help="the gateway's server name")
    parser.add_argument("--rationale", help="what the cards say about why (default: which client called which tool)")
    parser.add_argument("--risk", choices=["low", "medium", "high"])
    parser.add_argument(
        "--display",
        action="append",
        default=[],
        metavar="FIELD=PATH",
        help="the card's display, e.g. amount_minor=amount_cents (repeat)",
    )
    parser.add_argument(
        "--no-edits", action="store_true", help="send no schema: reviewers may approve or reject, not edit"
    )
    parser.add_argument("--expires-in", type=int, help="seconds before an undecided request expires")
    parser.add_argument("--on-expiry", choices=["reject", "escalate"])
    parser.add_argument("--timeout", type=float, help="seconds to wait for a decision (default: until it expires)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command: 0 when the client disconnected; 2 (after one `error:` line on stderr) when the options do not
    fit the upstream (a name `--approve` gives that it does not have) or are missing; 1 when the upstream could not
    be started or reached, or the gateway failed."""
    parser = _parser()
    args = parser.parse_args(argv)
    url, token = os.environ.get("HITL_URL"), os.environ.get("HITL_TOKEN")
    if not url or not token:
        parser.error("HITL_URL and HITL_TOKEN must be set (the console and an API token that may ask on the channel).")
    if args.approve and args.allow_unguarded:
        parser.error("--allow-unguarded is for a gateway with no --approve: give one or the other.")
    if not args.approve and not args.allow_unguarded:
        parser.error(
            "name at least one tool with --approve (the others pass through); a gateway that guards nothing starts "
            "only with --allow-unguarded."
        )
    display = {}
    for item in args.display:
        field_name, equals, path = item.partition("=")
        if not equals or not field_name or not path:
            parser.error(f"--display takes FIELD=PATH, not {item!r}.")
        display[field_name] = path
    # Logs go to stderr: stdout is the MCP connection.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The upstream server gets this environment without the console's token: it has no business with the console.
    upstream_env = {key: value for key, value in os.environ.items() if key != "HITL_TOKEN"}

    async def run() -> None:
        async with AsyncClient(url, token) as console:
            await serve(
                args.upstream,
                console,
                upstream_env=upstream_env,
                channel=args.channel,
                needs_approval=frozenset(args.approve),
                allow_unguarded=args.allow_unguarded,
                session=args.session,
                name=args.name,
                rationale=args.rationale,
                risk=args.risk,
                display=display or None,
                edits=not args.no_edits,
                expires_in=args.expires_in,
                on_expiry=args.on_expiry,
                timeout=args.timeout,
            )

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # ExceptionGroups of the SDK's task groups included: one line, not a nest of them
        leaves = _leaves(exc)
        start = next((leaf for leaf in leaves if isinstance(leaf, GatewayStartError)), None)
        if start is not None:
            print(f"{parser.prog}: error: {start}", file=sys.stderr)
            return start.exit_code
        if isinstance(leaves[0], ValueError):  # the Gateway's own refusal of its options
            print(f"{parser.prog}: error: {leaves[0]}", file=sys.stderr)
            return 2
        logger.debug("The gateway failed.", exc_info=exc)
        print(f"{parser.prog}: error: the gateway stopped: {_leaf_text(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
