"""The OpenAI Agents SDK (`openai-agents`): a tool that needs a person's sign-off asks for it on the console, and
runs at most once, with the arguments the person approved (their edit included).

    @approval_tool(channel="payments")
    def refund_order(order_id: str, amount_cents: int) -> dict: ...

    agent = Agent(name="refunds", tools=[refund_order], ...)
    result = await run_with_approvals(agent, "Refund order 42", client=client, session="ticket-42",
                                      state_path="ticket-42.json")

How it fits the SDK. `approval_tool` makes a `FunctionTool` with `needs_approval=True`, so the SDK stops the run
with one interruption per call of it (`result.interruptions`). `run_with_approvals` saves the run (`RunState`),
turns each interruption into an approval request (a card; its idempotency key is the session and the call's id),
waits for the decisions, records them on the state (`approve`, or `reject` with a message that carries the
reviewer's comment, which is what the model reads as the call's output) and resumes the run, until it ends.

The SDK approves a call as the model made it: it has no "approve with edits" (openai-agents-js#1097 declined it),
and rewriting the pending call's arguments inside the saved state would mean editing private fields of the state
and a transcript in which the model asked for what the reviewer chose. So the SDK's approval only lets the call
reach the tool, and the tool's invoker does not trust it: it takes the console's one "go" (`consume`) for the
arguments the console approved, runs the function with those, and reports the outcome (the client's
`require_approval`, so the rules of exactly once are the client's, in one place). The model gets the result, and
is told when a person changed the arguments. A state file someone edited to approve a call cannot run it either:
without the console's go nothing runs.

A process that dies anywhere restarts with the same `session` and `state_path`: the run resumes from the last
interruption, and the session core (`_session`) does the rest as for every adapter: the same keys give back the
same requests and decisions, and a call whose go was taken is not run again (the model reads what was recorded).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, overload

from agents import Agent, FunctionTool, RunConfig, RunHooks, Runner, RunResult, RunState
from agents.exceptions import UserError
from agents.function_schema import FuncSchema, function_schema
from agents.items import ToolApprovalItem
from agents.run_config import DEFAULT_MAX_TURNS
from agents.tool_context import ToolContext

from hitl_client.adapters import _session
from hitl_client.client import AsyncClient
from hitl_client.errors import HitlError
from hitl_client.models import RequestStatus

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["NoApprovalSession", "NotAnApprovalTool", "SessionFinished", "approval_tool", "run_with_approvals"]

# The run_with_approvals that is running the agent: the tools' invokers run inside it (the SDK's tasks inherit it).
_SESSION: ContextVar[_session.ToolSession | None] = ContextVar("hitl_openai_agents_session", default=None)


class NoApprovalSession(_session.NoApprovalSession):
    """An approval tool was invoked outside `run_with_approvals` (say, by `Runner.run` after `state.approve`):
    it runs only with the console's go, so it refused, and nothing ran."""


class NotAnApprovalTool(_session.NotAnApprovalTool):
    """The run stopped for a tool that needs approval but is not an `approval_tool`: the console could approve
    it, but nothing would hold the SDK to run it once with what was approved."""


class SessionFinished(_session.SessionFinished):
    """This session's run has ended before (its state file says so): it is not run again. `final_output` is
    what it ended with (as JSON, or its text)."""

    @property
    def final_output(self) -> Any:
        return self.output


_FILE = _session.SessionFile(kind="state", output_key="final_output", finished=SessionFinished)


class _Invoker:
    """The approval tool's `on_invoke_tool`: runs the call only through its session (the console's go)."""

    def __init__(self, approval: _session.ApprovalTool) -> None:
        self.approval = approval

    async def __call__(self, context: ToolContext[Any], raw: str) -> Any:
        session = _SESSION.get()
        if session is None:
            raise NoApprovalSession(
                f"{self.approval.action} runs only with the console's approval: run the agent with "
                "run_with_approvals (it did not run)."
            )
        try:
            asked = self.approval.asked(raw)
        except ValueError as exc:
            return f"{self.approval.action} did not run: {exc}"
        try:
            return await session.execute(self.approval, context.tool_call_id, asked, context)
        except _session.ToolFailure as failure:  # the model reads it as the call's output
            return str(failure)


def _caller(function: Callable[..., Any], schema: FuncSchema) -> Callable[[Any, Mapping[str, Any]], Awaitable[Any]]:
    """The function with the approved arguments, validated and converted as the SDK's own tools do."""

    async def call(context: ToolContext[Any], arguments: Mapping[str, Any]) -> Any:
        parsed = schema.params_pydantic_model(**arguments)
        args, kwargs = schema.to_call_args(parsed)
        if schema.takes_context:
            args = [context, *args]
        if inspect.iscoroutinefunction(function):
            return await function(*args, **kwargs)
        return await asyncio.to_thread(function, *args, **kwargs)

    return call


@overload
def approval_tool(
    function: Callable[..., Any], /, *, channel: str, **options: Unpack[_session.ApprovalOptions]
) -> FunctionTool: ...


@overload
def approval_tool(
    *, channel: str, **options: Unpack[_session.ApprovalOptions]
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def approval_tool(
    function: Callable[..., Any] | None = None, /, *, channel: str, **options: Unpack[_session.ApprovalOptions]
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """A function tool (as `agents.function_tool` makes it: name, description and parameters from the function)
    that needs a person's sign-off on `channel` for every call, and runs only under `run_with_approvals`.

    `options`: `name`, `description`, `rationale`, `current`, `risk`, `display`, `schema`, `expires_in`,
    `on_expiry` (`hitl_client.adapters._session.ApprovalOptions` says what each is). The function may take the
    SDK's context first, as function tools may."""

    def make(target: Callable[..., Any]) -> FunctionTool:
        parsed = function_schema(
            target, name_override=options.get("name"), description_override=options.get("description")
        )
        approval = _session.ApprovalTool.of(
            action=parsed.name,
            channel=channel,
            signature=parsed.signature,
            takes_context=parsed.takes_context,
            call=_caller(target, parsed),
            # The strict schema the model fills (every parameter required, no others): an edit must fit it too.
            parameters_schema=parsed.params_json_schema,
            options=options,
        )
        return FunctionTool(
            name=parsed.name,
            description=parsed.description or "",
            params_json_schema=parsed.params_json_schema,
            on_invoke_tool=_Invoker(approval),
            strict_json_schema=True,
            needs_approval=True,
        )

    return make(function) if function is not None else make


async def run_with_approvals(
    agent: Agent[Any],
    input: str | list[Any],
    *,
    client: AsyncClient,
    session: str,
    state_path: str | os.PathLike[str] | None = None,
    context: Any = None,
    max_turns: int = DEFAULT_MAX_TURNS,
    hooks: RunHooks[Any] | None = None,
    run_config: RunConfig | None = None,
    timeout: float | None = None,
    poll: int = 25,
    on_wait: _session.OnWait | None = None,
) -> RunResult:
    """Runs `agent` on `input` until it ends, asking the console whenever it calls an approval tool, and returns
    the SDK's result.

    `session` names this run of the agent (a ticket, a conversation): the requests' idempotency keys are
    `session:call_id`, and every request of the session is a step of one external run on the console.
    `state_path`: a file where the paused run is kept (the SDK's `RunState` as JSON, written atomically at each
    interruption): run again with the same session and file after a crash, and it resumes where it stopped
    without running anything twice. Without it, a restarted process starts the run over. Once the run has
    ended the file says so, and running the session again raises `SessionFinished`.
    `timeout`: seconds to wait for each decision (`WaitTimeout`; run again to go on waiting).
    `on_wait(requests)` is called (and awaited, if it returns an awaitable) before each wait with what the run
    waits for, as LangGraph's `invoke_with_approvals` calls it: each undecided request's `request_id`, `url` (its
    API address), `card_id`, `card_url` (the card in the console, for a person), `action` and `tool_call_id`.
    A tool's `Locked` (kill switch), a console that cannot be reached and the like stop the run (raised); run
    again later. A person's rejection, an unknown outcome or the tool's own failure are the call's output, for
    the model to read."""
    if not isinstance(client, AsyncClient):
        raise TypeError("run_with_approvals needs an AsyncClient (the SDK runs on asyncio).")
    keeper = _session.ToolSession(client, session, state_path, _FILE, timeout=timeout, poll=poll, on_wait=on_wait)
    saved = keeper.load()
    next_input: str | list[Any] | RunState[Any] = input
    token = _SESSION.set(keeper)
    try:
        if saved is not None and isinstance(saved.get("state"), dict):
            override = context if isinstance(context, Mapping) else None
            state = await RunState.from_json(agent, saved["state"], context_override=override)
            await _decide(keeper, state, state.get_interruptions())
            next_input = state
        while True:
            try:
                result = await Runner.run(
                    agent,
                    next_input,
                    context=None if isinstance(next_input, RunState) else context,
                    max_turns=max_turns,
                    hooks=hooks,
                    run_config=run_config,
                )
            except UserError as exc:
                # The SDK wraps what a tool raises; the console's refusal (a kill switch, say) is the error.
                error = exc.__cause__
                if isinstance(error, HitlError):
                    raise error from error.__cause__  # with its own cause (the HTTP error, say)
                raise
            if not result.interruptions:
                keeper.finish(result.final_output, state=None)
                return result
            state = result.to_state()
            keeper.save(state=state.to_json())
            await _decide(keeper, state, result.interruptions)
            next_input = state
    finally:
        _SESSION.reset(token)


async def _decide(keeper: _session.ToolSession, state: RunState[Any], interruptions: list[ToolApprovalItem]) -> None:
    """Asks the console about every interrupted call, waits for the decisions and records them on `state`: an
    approval lets the SDK invoke the tool (whose invoker runs what the console approved, once); anything else is
    a rejection whose message the model reads."""
    calls = [
        _session.PendingCall(_raw_field(item, "call_id"), _approval_of(item), _raw_field(item, "arguments"))
        for item in interruptions
    ]
    for item, call, decided in zip(interruptions, calls, await keeper.decide(calls), strict=True):
        if isinstance(decided, str):
            state.reject(item, rejection_message=decided)
        elif decided.status is RequestStatus.APPROVED:
            state.approve(item)
        else:
            state.reject(item, rejection_message=call.tool.declined(decided))


def _approval_of(item: ToolApprovalItem) -> _session.ApprovalTool:
    for tool in getattr(item.agent, "tools", []):
        if isinstance(tool, FunctionTool) and tool.name == item.tool_name and isinstance(tool.on_invoke_tool, _Invoker):
            return tool.on_invoke_tool.approval
    raise NotAnApprovalTool(
        f"The run stopped for {item.tool_name!r}, which needs approval but is not an approval_tool (or not a tool "
        f"of agent {item.agent.name!r}): make it with approval_tool, so that it runs once with what was approved."
    )


def _raw_field(item: ToolApprovalItem, name: str) -> Any:
    raw = item.raw_item
    return raw.get(name) if isinstance(raw, Mapping) else getattr(raw, name, None)
