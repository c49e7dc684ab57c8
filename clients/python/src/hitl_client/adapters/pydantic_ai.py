"""Pydantic AI (`pydantic-ai-slim`): a tool that needs a person's sign-off asks for it on the console, and runs
at most once, with the arguments the person approved (their edit included).

    @approval_tool(channel="payments")
    def refund_order(order_id: str, amount_cents: int) -> dict: ...

    agent = Agent(model, tools=[refund_order])
    result = await run_with_approvals(agent, "Refund order 42", client=client, session="ticket-42",
                                      history_path="ticket-42.json")

How it fits Pydantic AI. `approval_tool` makes a `Tool` with `requires_approval=True`, so a run in which the model
calls it ends with `DeferredToolRequests` (one entry per call). `run_with_approvals` keeps the run's message
history, turns each deferred call into an approval request (a card; its idempotency key is the session and the
call's id), waits for the decisions, and continues the run with `message_history` and `DeferredToolResults`:
`ToolApproved(override_args=<the arguments the console approved>)`, or `ToolDenied(<who rejected it, and their
comment>)`, which is what the model reads as the call's output. Until the run ends.

Pydantic AI then calls the tool with the approved arguments, but its approval is only a message in a list the
caller builds: the tool does not trust it. Its function takes the console's one "go" (`consume`) for the
arguments the console approved, runs the user's function with those, and reports the outcome (the client's
`require_approval`, so the rules of exactly once are the client's, in one place). So a tool body that the
framework runs twice, or a restarted process runs again, or a hand-made `DeferredToolResults` approves, runs the
action at most once and only with a person's approval. The model gets the result, and is told when a person
changed the arguments (its own call stays in the history as it made it).

Restarted after a crash with the same `session` and `history_path`, the run continues from the last deferred
calls; what the console recorded of them (their requests, decisions and receipts, found again by their keys) is
read back as for every adapter (`_session`), so nothing whose go was taken runs twice.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, overload

import pydantic
from pydantic_ai import (
    Agent,
    AgentRunResult,
    DeferredToolRequests,
    DeferredToolResults,
    RunContext,
    Tool,
    ToolApproved,
    ToolDenied,
)
from pydantic_ai.exceptions import ToolFailed
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_ai.tools import DeferredToolApprovalResult
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset
from pydantic_core import to_jsonable_python

from hitl_client.adapters import _session
from hitl_client.client import AsyncClient
from hitl_client.models import RequestStatus

if TYPE_CHECKING:
    from pydantic_ai._function_schema import FunctionSchema
    from typing_extensions import Unpack

__all__ = ["NoApprovalSession", "NotAnApprovalTool", "SessionFinished", "approval_tool", "run_with_approvals"]

# The run_with_approvals that is running the agent: the tools run inside it (Pydantic AI's tasks inherit it).
_SESSION: ContextVar[_session.ToolSession | None] = ContextVar("hitl_pydantic_ai_session", default=None)
_PENDING = pydantic.TypeAdapter(DeferredToolRequests)
# What the caller may not pass on to Agent.run: run_with_approvals owns the history and the deferred results.
_OWN_RUN_OPTIONS = ("user_prompt", "message_history", "deferred_tool_results", "conversation")


class NoApprovalSession(_session.NoApprovalSession):
    """An approval tool was called for a call that `run_with_approvals` did not ask the console about (say, by
    `agent.run` with a hand-made `DeferredToolResults`): it runs only with the console's go, so it refused, and
    nothing ran."""


class NotAnApprovalTool(_session.NotAnApprovalTool):
    """The run ended on a deferred call that is not an `approval_tool`'s (a `requires_approval` tool of its own,
    or one executed externally): the console could approve it, but nothing would hold Pydantic AI to run it once
    with what was approved. Nothing was asked."""


class SessionFinished(_session.SessionFinished):
    """This session's run has ended before (its history file says so): it is not run again. `output` is what it
    ended with (as JSON, or its text)."""


_FILE = _session.SessionFile(kind="history", output_key="output", finished=SessionFinished)


class _Invoker:
    """The approval tool's function, as Pydantic AI calls it: it ignores the arguments the framework approved and
    runs the call only through its session (the console's go, for the console's arguments)."""

    def __init__(self, approval: _session.ApprovalTool) -> None:
        self.approval = approval
        self.__name__ = approval.action

    async def __call__(self, ctx: RunContext[Any], *args: Any, **kwargs: Any) -> Any:
        session = _SESSION.get()
        if session is None:
            raise NoApprovalSession(
                f"{self.approval.action} runs only with the console's approval: run the agent with "
                "run_with_approvals (it did not run)."
            )
        call_id = ctx.tool_call_id
        asked = session.asked.get(call_id) if call_id is not None else None
        if call_id is None or asked is None:
            raise NoApprovalSession(
                f"{self.approval.action} was called for {call_id!r}, which this session did not ask the console "
                "about (approved outside run_with_approvals): it did not run."
            )
        try:
            return await session.execute(self.approval, call_id, asked, ctx)
        except _session.ToolFailure as failure:  # the action failed: Pydantic AI tells the model so
            raise ToolFailed(str(failure)) from failure.__cause__


def _caller(schema: FunctionSchema) -> Callable[[Any, Mapping[str, Any]], Awaitable[Any]]:
    """The function with the approved arguments, validated and converted as Pydantic AI's own tools are."""

    async def call(context: RunContext[Any], arguments: Mapping[str, Any]) -> Any:
        validated = schema.validator.validate_python(dict(arguments), context=context.validation_context)
        return await schema.call(validated, context)

    return call


class _Options(_session.ApprovalOptions, total=False):
    # How often Pydantic AI sends a call with bad arguments back to the model (Tool's max_retries).
    max_retries: int | None


@overload
def approval_tool(function: Callable[..., Any], /, *, channel: str, **options: Unpack[_Options]) -> Tool[Any]: ...


@overload
def approval_tool(*, channel: str, **options: Unpack[_Options]) -> Callable[[Callable[..., Any]], Tool[Any]]: ...


def approval_tool(
    function: Callable[..., Any] | None = None, /, *, channel: str, **options: Unpack[_Options]
) -> Tool[Any] | Callable[[Callable[..., Any]], Tool[Any]]:
    """A `Tool` (name, description and parameters from the function, as `Tool(function)` reads them) that needs a
    person's sign-off on `channel` for every call, and runs only under `run_with_approvals`.

    `options`: `name`, `description`, `rationale`, `current`, `risk`, `display`, `schema`, `expires_in`,
    `on_expiry` (`hitl_client.adapters._session.ApprovalOptions` says what each is) and `max_retries` (Tool's).
    The function may take the `RunContext` first, as tools may, and be sync or async."""

    def make(target: Callable[..., Any]) -> Tool[Any]:
        plain = Tool(target, name=options.get("name"), description=options.get("description"))
        parsed = plain.function_schema
        approval = _session.ApprovalTool.of(
            action=plain.name,
            channel=channel,
            signature=inspect.signature(target),
            takes_context=parsed.takes_ctx,
            call=_caller(parsed),
            parameters_schema=parsed.json_schema,
            options=options,
        )
        invoker = _Invoker(approval)
        # The model sees the function's own parameters and Pydantic AI validates its arguments against them (a bad
        # call is sent back to the model, and never becomes a card); what it calls is the invoker.
        return Tool(
            invoker,
            name=plain.name,
            description=plain.description,
            max_retries=options.get("max_retries"),
            requires_approval=True,
            function_schema=dataclasses.replace(parsed, function=invoker, takes_ctx=True, is_async=True),
        )

    return make(function) if function is not None else make


async def run_with_approvals(
    agent: Agent[Any, Any],
    prompt: str | Sequence[Any] | None,
    *,
    client: AsyncClient,
    session: str,
    history_path: str | os.PathLike[str] | None = None,
    output_type: Any = None,
    timeout: float | None = None,
    poll: int = 25,
    on_wait: _session.OnWait | None = None,
    **run_options: Any,
) -> AgentRunResult[Any]:
    """Runs `agent` on `prompt` until it ends, asking the console whenever the model calls an approval tool, and
    returns Pydantic AI's result of the last run (`result.output`, `result.all_messages()`).

    `session` names this run of the agent (a ticket, a conversation): the requests' idempotency keys are
    `session:tool_call_id`, and every request of the session is a step of one external run on the console.
    `history_path`: a JSON file where the message history and the pending calls are kept (written atomically
    each time the run stops for approvals): run again with the same session and file after a crash, and it goes
    on where it stopped without running anything twice (the prompt is then not sent again). Without it, a
    restarted process starts the run over. Once the run has ended the file says so, and running the session
    again raises `SessionFinished`.
    `output_type`: the run's output type (default the agent's); `DeferredToolRequests` is added to it.
    `timeout`: seconds to wait for each decision (`WaitTimeout`; run again to go on waiting).
    `on_wait(requests)` is called (and awaited, if it returns an awaitable) before each wait with what the run
    waits for, as LangGraph's `invoke_with_approvals` calls it: each undecided request's `request_id`, `url` (its
    API address), `card_id`, `card_url` (the card in the console, for a person), `action` and `tool_call_id`.
    `run_options` go to every `agent.run` (`deps`, `model_settings`, `usage_limits`, ...).
    A tool's `Locked` (kill switch), a console that cannot be reached and the like stop the run (raised); run
    again later. A person's rejection, an unknown outcome or the tool's own failure are the call's output, for
    the model to read."""
    if not isinstance(client, AsyncClient):
        raise TypeError("run_with_approvals needs an AsyncClient (Pydantic AI runs on asyncio).")
    owned = sorted(set(run_options) & set(_OWN_RUN_OPTIONS))
    if owned:
        raise TypeError(f"run_with_approvals keeps the history itself: it takes no {', '.join(owned)}.")
    keeper = _session.ToolSession(
        client, session, history_path, _FILE, timeout=timeout, poll=poll, on_wait=on_wait, jsonable=to_jsonable_python
    )
    tools = _approval_tools([*agent.toolsets, *(run_options.get("toolsets") or [])])
    outputs = _with_deferred(agent.output_type if output_type is None else output_type)
    saved = keeper.load() or {}
    token = _SESSION.set(keeper)
    try:
        if saved.get("messages") is None or saved.get("pending") is None:
            # A new run, or one that stopped before its first approvals were saved: nothing ran yet.
            result = await agent.run(prompt, output_type=outputs, **run_options)
        else:
            messages = ModelMessagesTypeAdapter.validate_python(saved["messages"])
            answers = await _decide(keeper, tools, _PENDING.validate_python(saved["pending"]))
            result = await agent.run(
                None, message_history=messages, deferred_tool_results=answers, output_type=outputs, **run_options
            )
        while isinstance(result.output, DeferredToolRequests):
            messages = result.all_messages()
            keeper.save(messages=_dump(messages), pending=_PENDING.dump_python(result.output, mode="json"))
            answers = await _decide(keeper, tools, result.output)
            result = await agent.run(
                None, message_history=messages, deferred_tool_results=answers, output_type=outputs, **run_options
            )
        keeper.finish(result.output, messages=_dump(result.all_messages()))
        return result
    finally:
        _SESSION.reset(token)


async def _decide(
    keeper: _session.ToolSession, tools: Mapping[str, _session.ApprovalTool], pending: DeferredToolRequests
) -> DeferredToolResults:
    """Asks the console about every deferred call, waits for the decisions and returns them as the results the
    run continues with: an approval with the arguments the person approved (Pydantic AI may now call the tool,
    which itself runs what the console gives its go for, once), or a denial whose message the model reads."""
    if pending.calls:
        names = sorted({call.tool_name for call in pending.calls})
        raise NotAnApprovalTool(
            f"The run stopped for calls executed externally ({', '.join(names)}): run_with_approvals answers "
            "approval tools only."
        )
    calls = [
        _session.PendingCall(call.tool_call_id, _approval_of(tools, call.tool_name), call.args)
        for call in pending.approvals
    ]
    answers = DeferredToolResults()
    for call, decided in zip(calls, await keeper.decide(calls), strict=True):
        answer: DeferredToolApprovalResult
        if isinstance(decided, str):
            answer = ToolDenied(decided)
        elif decided.status is RequestStatus.APPROVED and decided.arguments is not None:
            answer = ToolApproved(override_args=dict(decided.arguments))
        else:
            answer = ToolDenied(call.tool.declined(decided))
        answers.approvals[call.call_id] = answer
    return answers


def _dump(messages: list[ModelMessage]) -> Any:
    return ModelMessagesTypeAdapter.dump_python(messages, mode="json")


def _approval_tools(toolsets: Sequence[AbstractToolset[Any]]) -> dict[str, _session.ApprovalTool]:
    """The agent's approval tools by name (those of its function toolsets, wherever they are nested)."""
    found: dict[str, _session.ApprovalTool] = {}

    def visit(toolset: AbstractToolset[Any]) -> None:
        if isinstance(toolset, FunctionToolset):
            for name, tool in toolset.tools.items():
                if isinstance(tool.function, _Invoker):
                    found[name] = tool.function.approval

    for toolset in toolsets:
        toolset.apply(visit)
    return found


def _approval_of(tools: Mapping[str, _session.ApprovalTool], name: str) -> _session.ApprovalTool:
    approval = tools.get(name)
    if approval is None:
        raise NotAnApprovalTool(
            f"The run stopped for {name!r}, which needs approval but is not an approval_tool of this "
            "agent (or is renamed by a wrapping toolset): make it with approval_tool, so that it runs once with "
            "what was approved."
        )
    return approval


def _with_deferred(output_type: Any) -> Any:
    """The run's output types, and DeferredToolRequests: a run that stops for approvals ends with it."""
    types = list(output_type) if isinstance(output_type, Sequence) and not isinstance(output_type, str) else []
    if not types:
        types = [output_type]
    return types if DeferredToolRequests in types else [*types, DeferredToolRequests]
