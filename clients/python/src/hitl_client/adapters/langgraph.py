"""LangGraph: tool calls that run only with a person's sign-off, once, across restarts of the agent's process.

    from hitl_client.adapters.langgraph import ApprovalToolNode, invoke_with_approvals

    builder.add_node("tools", ApprovalToolNode(tools, client=client, channel="payments",
                                               needs_approval={"refund_order"}))  # in place of ToolNode
    builder.add_conditional_edges("agent", tools_condition)
    graph = builder.compile(checkpointer=PostgresSaver(conn))  # the wait survives a restart
    invoke_with_approvals(graph, {"messages": [...]}, {"configurable": {"thread_id": "t-42"}}, client=client)

How: `ApprovalToolNode` is a `ToolNode` that first asks the console about each call that needs approval (the
idempotency key is the thread's id and the call's id, both in the checkpoint, so asking again after a restart is
the same request) and stops the graph with `interrupt()` while any is undecided. Whoever resumes it with
`Command(resume=...)` (`invoke_with_approvals` does, once the console has the decisions; so may a callback
handler) only wakes it: the node reads the decisions from the console, never from the resume value. Then each
call runs as `ToolNode` runs it: an approved call with the arguments the reviewer approved (an edit included),
after the console's one "go" (consume) for exactly those arguments, its outcome reported; a rejected, expired or
cancelled call runs nothing and its `ToolMessage` tells the model why (the reviewer's comment). A call consumed
before (the process died after the go) is never run again: the model is told what the console recorded, the
result or "outcome unknown".
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from langchain_core.messages import ToolCall, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.errors import GraphBubbleUp
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.runtime import Runtime
from langgraph.types import Command, Interrupt, StateSnapshot, interrupt
from pydantic import BaseModel

from hitl_client import _protocol, _tracing
from hitl_client._protocol import Call, Flow
from hitl_client.adapters._session import is_shadow
from hitl_client.client import AsyncClient, Client, OnExpiry, Risk, approval_request_body
from hitl_client.decorator import run_approved
from hitl_client.errors import ActionFailed, Declined, HitlError, OutcomeUnknown, ReportFailed
from hitl_client.models import ApprovalRequest, ExecutionStatus, RequestStatus

__all__ = [
    "INTERRUPT_KEY",
    "ApprovalToolNode",
    "ainvoke_with_approvals",
    "approval_interrupts",
    "invoke_with_approvals",
]

logger = logging.getLogger("hitl_client")
T = TypeVar("T")

# The interrupt's value is `{INTERRUPT_KEY: [{"request_id", "url", "card_id", "action", "tool_call_id"}, ...]}`:
# what a resumer waits for. Any resume value wakes the node; the decisions are read from the console.
INTERRUPT_KEY = "hitl_approvals"
_MAX_KEY = 200  # the contract's longest idempotency key
_MAX_ERROR = 4000  # an error's text on the receipt: its start

ToolMessageOrCommand = ToolMessage | Command[Any]
Execute = Callable[[ToolCallRequest], Any]


@dataclass
class _NodeRun:
    """One run of the node: the decisions of its calls, by tool call id, and the console's errors met while running
    them. The tool wrapper reads it in ToolNode's worker threads (they copy this context) or tasks."""

    decided: Mapping[str, ApprovalRequest]
    errors: list[HitlError] = field(default_factory=list)


_current_run: contextvars.ContextVar[_NodeRun | None] = contextvars.ContextVar("hitl_node_run", default=None)


class ApprovalToolNode(ToolNode):
    """A `ToolNode` whose calls that need approval run only once a person approved them, with the arguments they
    approved, at most once per call, even when the process dies and the thread is resumed. The graph needs a
    checkpointer and a `thread_id` (the approval waits in the thread's checkpoint).

    `needs_approval`: the names of the tools that need it, or a predicate of the tool call (default: every
    call). `schema_for(call)`: the JSON Schema a reviewer's edit must fit, or None for no edits (default: the
    tool's own argument schema). `rationale`: text, the contract's rationale object, or `rationale(call,
    state)`. `current(call)`: the target's state now, for the card's diff. `risk`, `display`, `expires_in` and
    `on_expiry` are the request's (docs/external-agents.md). A `Client` serves `invoke`/`stream`, an
    `AsyncClient` `ainvoke`/`astream` (a `Client` there runs in a thread).

    The console's errors are raised out of the graph, not told to the model as the tool's (`Locked`: a kill
    switch is engaged; `ConnectionFailed`: the console is unreachable): nothing ran that needs approval, and the
    thread stays at this node: run it again later (`invoke_with_approvals` again) and it asks the same requests.
    A tool's own exception is reported as the call's failure, then handled as ToolNode's `handle_tool_errors`
    says. Tools that need no approval run as ToolNode runs them, after every decision is in."""

    def __init__(
        self,
        tools: Sequence[BaseTool | Callable[..., Any]],
        *,
        client: Client | AsyncClient,
        channel: str,
        needs_approval: Collection[str] | Callable[[ToolCall], bool] | None = None,
        schema_for: Callable[[ToolCall], Mapping[str, Any] | None] | None = None,
        rationale: str | Mapping[str, Any] | Callable[[ToolCall, Any], str | Mapping[str, Any] | None] | None = None,
        current: Callable[[ToolCall], Mapping[str, Any] | None] | None = None,
        risk: Risk | None = None,
        display: Mapping[str, str] | None = None,
        expires_in: int | None = None,
        on_expiry: OnExpiry | None = None,
        name: str = "tools",
        tags: list[str] | None = None,
        messages_key: str = "messages",
        **tool_node_options: Any,
    ) -> None:
        if not isinstance(client, (Client, AsyncClient)):
            raise TypeError(f"client must be a hitl_client Client or AsyncClient, not {type(client).__name__}.")
        if {"wrap_tool_call", "awrap_tool_call"} & tool_node_options.keys():
            # A wrapper may call the tool several times (retries): the approval is for one run.
            raise TypeError("ApprovalToolNode wraps the tool calls itself: it takes no wrap_tool_call.")
        super().__init__(
            tools,
            name=name,
            tags=tags,
            messages_key=messages_key,
            **tool_node_options,  # handle_tool_errors, as ToolNode takes it
            wrap_tool_call=self._run_call,
            awrap_tool_call=self._arun_call,
        )
        self._client = client
        self._channel = channel
        if needs_approval is None:
            self._needs_approval: Callable[[ToolCall], bool] = lambda call: True
        elif callable(needs_approval):
            self._needs_approval = needs_approval
        else:
            names = frozenset(needs_approval)
            unknown = names - self.tools_by_name.keys()
            if unknown:
                raise ValueError(f"needs_approval names tools this node does not have: {sorted(unknown)}.")
            self._needs_approval = lambda call: call["name"] in names
        self._schema_for = schema_for or self._tool_schema
        self._rationale = rationale
        self._current = current
        self._fields = {"risk": risk, "display": display, "expires_in": expires_in, "on_expiry": on_expiry}

    # The node: ask, wait (interrupt), then run as ToolNode does, each call through _run_call.

    def _func(self, input: Any, config: RunnableConfig, runtime: Runtime) -> Any:
        if isinstance(self._client, AsyncClient):
            raise TypeError("This ApprovalToolNode has an AsyncClient: run the graph with ainvoke or astream.")
        run = _NodeRun(self._client._run(self._ask_and_wait(input, config)))
        token = _current_run.set(run)
        try:
            output = super()._func(input, config, runtime)
        finally:
            _current_run.reset(token)
        return _unless_failed(run, output)

    async def _afunc(self, input: Any, config: RunnableConfig, runtime: Runtime) -> Any:
        run = _NodeRun(await self._arun(self._ask_and_wait(input, config)))
        token = _current_run.set(run)
        try:
            output = await super()._afunc(input, config, runtime)
        finally:
            _current_run.reset(token)
        return _unless_failed(run, output)

    def _ask_and_wait(self, input: Any, config: RunnableConfig) -> Flow[dict[str, ApprovalRequest]]:
        """The console's request for each call that needs approval, once every one of them is decided."""
        calls, _ = self._parse_input(input)
        thread_id = (config.get("configurable") or {}).get("thread_id")
        if thread_id is None:
            raise ValueError(
                "ApprovalToolNode needs a checkpointer and a thread_id in the config: the approval waits in the "
                "thread's checkpoint, and the thread names the request."
            )
        policy = self._client._policy
        requests: dict[str, ApprovalRequest] = {}
        urls: dict[str, str | None] = {}
        for call in calls:
            # A call of a tool this node does not have is answered by ToolNode (the model is told): nothing to ask.
            if call["name"] not in self.tools_by_name or not self._needs_approval(call):
                continue
            call_id = call.get("id")
            if not call_id:
                raise ValueError(f"The model's call of {call['name']} has no id: its approval could not be named.")
            body = approval_request_body(
                self._channel, call["name"], call["args"], **self._request_fields(call, input, str(thread_id))
            )
            request = yield from _protocol.request_approval(body, policy)
            requests[call_id], urls[call_id] = request, request.url
        while undecided := {call_id: r for call_id, r in requests.items() if not r.decided}:
            # The first time, this stops the graph (the checkpoint keeps the value: the requests' ids). Resumed,
            # the node runs again from its start, asks again (the same requests) and gets here with the resume
            # value, which only wakes it: the console says whether everything is decided now.
            interrupt({INTERRUPT_KEY: [_describe(call_id, r, urls[call_id]) for call_id, r in undecided.items()]})
            for call_id, request in undecided.items():
                requests[call_id] = yield from _protocol.get(request.id, 0, policy)
        return requests

    def _request_fields(self, call: ToolCall, state: Any, thread_id: str) -> dict[str, Any]:
        rationale = self._rationale(call, state) if callable(self._rationale) else self._rationale
        fields = {
            "idempotency_key": _key(thread_id, call["id"] or ""),
            "rationale": rationale,
            "current": self._current(call) if self._current else None,
            "schema": self._schema_for(call),
            **self._fields,
        }
        return {name: value for name, value in fields.items() if value is not None}

    def _tool_schema(self, call: ToolCall) -> Mapping[str, Any] | None:
        """The tool's argument schema as the model sees it (injected arguments left out): what an edit must fit."""
        schema = self.tools_by_name[call["name"]].tool_call_schema
        if isinstance(schema, Mapping):
            return schema
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            return schema.model_json_schema()
        return None  # an old pydantic v1 schema: approve or reject only

    # Each call, in ToolNode's worker thread (or task).

    def _run_call(self, request: ToolCallRequest, execute: Execute) -> ToolMessageOrCommand:
        run = _current_run.get()
        approval = run.decided.get(request.tool_call["id"] or "") if run else None
        if run is None or approval is None:  # needs no approval
            return cast(ToolMessageOrCommand, execute(request))
        assert isinstance(self._client, Client)  # _func refused an AsyncClient
        try:
            with _tracing.gate(approval.action, self._channel) as gate:
                return self._client._run(self._run_approved(approval, request, execute, gate))
        except HitlError as exc:
            return _failed(run, exc, request.tool_call)

    async def _arun_call(
        self, request: ToolCallRequest, execute: Callable[[ToolCallRequest], Awaitable[Any]]
    ) -> ToolMessageOrCommand:
        run = _current_run.get()
        approval = run.decided.get(request.tool_call["id"] or "") if run else None
        if run is None or approval is None:
            return cast(ToolMessageOrCommand, await execute(request))
        if not isinstance(self._client, AsyncClient):
            # The flow runs in a thread (_arun): the tool, a coroutine of this loop, is run back on it.
            loop = asyncio.get_running_loop()
            run_async = execute

            async def awaited(request: ToolCallRequest) -> Any:
                return await run_async(request)

            def execute(request: ToolCallRequest) -> Any:
                return asyncio.run_coroutine_threadsafe(awaited(request), loop).result()

        try:
            with _tracing.gate(approval.action, self._channel) as gate:
                return await self._arun(self._run_approved(approval, request, execute, gate))
        except HitlError as exc:
            return _failed(run, exc, request.tool_call)

    def _run_approved(
        self, approval: ApprovalRequest, request: ToolCallRequest, execute: Execute, gate: _tracing.Gate
    ) -> Flow[ToolMessageOrCommand]:
        """The decided call, as the client's `run_approved` runs an action (once, with the approved arguments,
        its outcome reported), told to the model as ToolNode tells it: the tool's message, or what the console
        decided or recorded. `gate`: the call's span, told the request and its decision."""
        call = request.tool_call
        gate.saw(approval)

        def run_tool(**approved: Any) -> Any:
            # As ToolNode runs it (argument validation, injected arguments, handle_tool_errors), with what ran.
            return execute(request.override(tool_call={**call, "args": approved}))

        try:
            outcome = yield from run_approved(
                approval,
                run_tool,
                self._client._policy,
                report_of=_outcome,
                # An interrupt inside the tool: it may have half happened, so the receipt stays "outcome unknown"
                # (a tool behind approval must not interrupt itself).
                unreported=(GraphBubbleUp,),
            )
        except Declined as declined:
            gate.saw(declined.request)
            return _declined(declined.request, call)
        except (ActionFailed, OutcomeUnknown) as before:
            # The go was given before (this thread's earlier process, or its own answer lost): never a second run.
            return _recorded(before.request, call)
        except ReportFailed as unreported:
            # The action ran: the model must hear its result all the same. The receipt stays "outcome unknown"
            # for a person (the card shows it), and this thread never runs the call again.
            logger.exception("The outcome of %s (request %s) could not be reported.", approval.action, approval.id)
            return cast(ToolMessageOrCommand, _with_edit_noted(unreported.result, approval))
        if outcome.source == "ran":
            return cast(ToolMessageOrCommand, _with_edit_noted(outcome.value, approval))
        if outcome.source == "shadow" or is_shadow(outcome.value):
            # A shadow card: the reviewer does the action by hand; the agent must not.
            return _message(call, f"{call['name']} is in shadow mode: a person does it by hand; it did not run here.")
        # The result the console recorded when the call ran before: it is not run again.
        result = outcome.value
        return _message(call, result if isinstance(result, str) else _json(result), error=False)

    async def _arun(self, flow: Flow[T]) -> T:
        """A flow of the client's calls, awaited (a blocking `Client` runs it in a thread)."""
        if isinstance(self._client, AsyncClient):
            return await self._client._run(flow)
        return await asyncio.to_thread(functools.partial(self._client._run, flow))


def _failed(run: _NodeRun, error: HitlError, call: ToolCall) -> ToolMessage:
    # ToolNode would hand the console's refusal (a kill switch, the console unreachable) to the model as the
    # tool's error, and the approval would be lost for this thread. Raised out of the node instead (below): the
    # thread stays at this node, and running it again later asks the same requests again.
    run.errors.append(error)
    return _message(call, f"{call['name']} did not run: {error}")


def _unless_failed(run: _NodeRun, output: T) -> T:
    if run.errors:
        raise run.errors[0]
    return output


def invoke_with_approvals(
    graph: Any,
    input: Any,
    config: RunnableConfig,
    *,
    client: Client,
    timeout: float | None = None,
    poll: int = 25,
    on_wait: Callable[[list[dict[str, Any]]], None] | None = None,
) -> Any:
    """Runs the graph on `config`'s thread to its end, as `graph.invoke` does: each time it stops for approvals,
    waits for the decisions (long-polls the console) and resumes it with `Command(resume=...)`.

    A thread already under way (its process died while it waited for a decision, or in the middle of a node)
    continues where its checkpoint stopped, and `input` is not sent again; a thread that had ended starts a new
    turn with `input`. Steps are checkpointed before the next one starts (`durability="sync"`): the model's tool
    calls, and so the requests' keys, are never lost to a crash. `WaitTimeout` after `timeout` seconds without
    every decision: the thread stays stopped, and calling this again picks it up. `on_wait(requests)` is called
    before each wait with what the graph waits for (each request's `request_id`, `url`, `card_id`, `action`,
    `tool_call_id`). An interrupt of another kind is returned as `graph.invoke` returns it (`__interrupt__`), for
    the caller to answer. Each request `on_wait` is told of has `card_url` too: the card's address in the console,
    where a person decides it (`url` is the request's API address, which only the agent's token may read)."""
    return client._run(_invoking(graph, input, config, client, timeout, poll, on_wait, asynchronous=False))


async def ainvoke_with_approvals(
    graph: Any,
    input: Any,
    config: RunnableConfig,
    *,
    client: AsyncClient,
    timeout: float | None = None,
    poll: int = 25,
    on_wait: Callable[[list[dict[str, Any]]], None] | None = None,
) -> Any:
    """`invoke_with_approvals` for asyncio: `graph.ainvoke`, an `AsyncClient`."""
    return await client._run(_invoking(graph, input, config, client, timeout, poll, on_wait, asynchronous=True))


def _invoking(
    graph: Any,
    input: Any,
    config: RunnableConfig,
    client: Client | AsyncClient,
    timeout: float | None,
    poll: int,
    on_wait: Callable[[list[dict[str, Any]]], None] | None,
    *,
    asynchronous: bool,
) -> Flow[Any]:
    """invoke_with_approvals as a flow of the client's (the graph's own calls are its `Call`s), which the client
    runs: blocking, or awaited (`asynchronous`: the graph's async methods)."""
    get_state, invoke = (graph.aget_state, graph.ainvoke) if asynchronous else (graph.get_state, graph.invoke)
    deadline = None if timeout is None else time.monotonic() + timeout
    snapshot = yield Call(functools.partial(get_state, config), {})
    payload: Any = None if snapshot.next else input
    while True:
        if payload is None and (waiting := approval_interrupts(snapshot)):
            if on_wait:
                on_wait([_for_person(client, request) for i in waiting for request in i.value[INTERRUPT_KEY]])
            decided: dict[str, dict[str, str]] = {}
            for pending in waiting:
                decided[pending.id] = {}
                for asked in pending.value[INTERRUPT_KEY]:
                    request = yield from _protocol.wait(asked["request_id"], _left(deadline), poll, client._policy)
                    decided[pending.id][request.id] = request.status.value
            payload = Command(resume=decided)
        result = yield Call(functools.partial(invoke, payload, config, durability="sync"), {})
        snapshot = yield Call(functools.partial(get_state, config), {})
        if not approval_interrupts(snapshot):
            return result
        payload = None


def approval_interrupts(snapshot: StateSnapshot) -> list[Interrupt]:
    """The thread's interrupts that wait for the console's decisions (an ApprovalToolNode's)."""
    return [i for i in snapshot.interrupts if isinstance(i.value, Mapping) and INTERRUPT_KEY in i.value]


def _for_person(client: Client | AsyncClient, request: Mapping[str, Any]) -> dict[str, Any]:
    """An interrupt's request as `on_wait` is told of it: with the card's address in the console."""
    return {**request, "card_url": client.card_url(request.get("card_id"))}


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _key(thread_id: str, call_id: str) -> str:
    key = f"langgraph:{thread_id}:{call_id}"
    if len(key) <= _MAX_KEY:
        return key
    return "langgraph:" + hashlib.sha256(f"{thread_id}\0{call_id}".encode()).hexdigest()


def _describe(call_id: str, request: ApprovalRequest, url: str | None) -> dict[str, Any]:
    return {
        "request_id": request.id,
        "url": url,
        "card_id": request.card_id,
        "action": request.action,
        "tool_call_id": call_id,
    }


def _message(call: ToolCall, content: str, *, error: bool = True) -> ToolMessage:
    return ToolMessage(
        content=content, name=call["name"], tool_call_id=call["id"] or "", status="error" if error else "success"
    )


def _declined(request: ApprovalRequest, call: ToolCall) -> ToolMessage:
    """What the model hears of a call nobody approved: it did not run, and the reviewer's words why."""
    name = call["name"]
    if request.status is RequestStatus.REJECTED:
        said = f" Their comment: {request.comment}" if request.comment else ""
        reason = f" (reason: {request.reason})" if request.reason else ""
        who = request.decided_by or "A reviewer"
        return _message(call, f"{who} rejected this call of {name}{reason}; it did not run.{said}")
    if request.status is RequestStatus.EXPIRED:
        return _message(call, f"Nobody approved this call of {name} in time; it did not run.")
    if request.status is RequestStatus.CANCELLED:
        why = f" ({request.reason or request.comment})" if request.reason or request.comment else ""
        return _message(call, f"This call of {name} was cancelled{why}; it did not run.")
    return _message(call, f"This call of {name} is {request.status.value}; it did not run.")


def _recorded(request: ApprovalRequest, call: ToolCall) -> ToolMessage:
    """What the console recorded of a call that was given its go before and did not succeed: never run again."""
    execution = request.execution
    name = call["name"]
    if execution.status is ExecutionStatus.FAILED:
        return _message(call, f"{name} ran before and failed: {execution.error}. It was not run again.")
    started = execution.consumed_at.isoformat(timespec="seconds") if execution.consumed_at else "some time"
    return _message(
        call,
        f"{name} was started at {started} and its outcome was never reported (outcome unknown): "
        "it may or may not have happened. It was not run again; a person must check it.",
    )


def _outcome(output: Any) -> dict[str, Any]:
    """The report of a tool's output: a ToolMessage's content, as the model sees it; an error message (ToolNode
    turned the tool's exception into one) as a failure."""
    if isinstance(output, ToolMessage):
        content = output.content
        if output.status == "error":
            text = content if isinstance(content, str) else _json(content)
            return {"ok": False, "error": (text or "the tool failed")[:_MAX_ERROR]}
        return {"ok": True, "result": content}
    return {"ok": True, "result": repr(output)[:_MAX_ERROR]}  # a Command: what it did, as text


def _with_edit_noted(output: Any, request: ApprovalRequest) -> Any:
    """An edited call's result says so: the model asked for other arguments than those that ran."""
    if not (request.edited and isinstance(output, ToolMessage) and isinstance(output.content, str)):
        return output
    said = f" Their comment: {request.comment}" if request.comment else ""
    note = f"\n\n(A reviewer edited the arguments before it ran: it ran with {_json(request.arguments)}.{said})"
    return output.model_copy(update={"content": output.content + note})


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=repr)
