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

A process that dies anywhere restarts with the same `session` and `history_path`: the run continues from the last
deferred calls, the same keys give back the same requests and decisions, and a call whose go was taken is not run
again: the model reads its recorded result, or that its outcome is unknown (consumed, never reported; a person
checks) when the process died between the two.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

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
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ToolCallPart
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset
from pydantic_core import PydanticSerializationError, to_jsonable_python

from hitl_client.adapters import _waiting
from hitl_client.adapters._waiting import OnWait
from hitl_client.client import AsyncClient, OnExpiry, Risk
from hitl_client.decorator import require_approval
from hitl_client.digest import arguments_digest
from hitl_client.errors import ActionFailed, Declined, HitlError, OutcomeUnknown
from hitl_client.models import ApprovalRequest, RequestStatus

__all__ = ["NoApprovalSession", "NotAnApprovalTool", "SessionFinished", "approval_tool", "run_with_approvals"]

Describe = str | Mapping[str, Any] | Callable[..., Any] | None

# The run_with_approvals that is running the agent: the tools run inside it (Pydantic AI's tasks inherit it).
_SESSION: ContextVar[_Session | None] = ContextVar("hitl_pydantic_ai_session", default=None)
_HISTORY_FORMAT = 1
# The idempotency key is `session:tool_call_id`; the contract allows 200 characters, a model's call ids take ~40.
_MAX_SESSION = 120
_PENDING = pydantic.TypeAdapter(DeferredToolRequests)
# What the caller may not pass on to Agent.run: run_with_approvals owns the history and the deferred results.
_OWN_RUN_OPTIONS = ("user_prompt", "message_history", "deferred_tool_results", "conversation")


class NoApprovalSession(HitlError):
    """An approval tool was called for a call that `run_with_approvals` did not ask the console about (say, by
    `agent.run` with a hand-made `DeferredToolResults`): it runs only with the console's go, so it refused, and
    nothing ran."""


class NotAnApprovalTool(HitlError):
    """The run ended on a deferred call that is not an `approval_tool`'s (a `requires_approval` tool of its own,
    or one executed externally): the console could approve it, but nothing would hold Pydantic AI to run it once
    with what was approved. Nothing was asked."""


class SessionFinished(HitlError):
    """This session's run has ended before (its history file says so): it is not run again. `output` is what it
    ended with (as JSON, or its text)."""

    def __init__(self, session: str, output: Any) -> None:
        super().__init__(f"The session {session!r} has finished: {output!r}")
        self.session, self.output = session, output


@dataclass(frozen=True)
class _Approval:
    """What an approval tool asks the console, and how it calls its function with the approved arguments."""

    # The user's function as Pydantic AI reads it (validator, context, sync or async): what runs, once.
    schema: Any
    # The function's parameters the model fills (without a leading RunContext): what the person approves.
    signature: inspect.Signature
    action: str
    channel: str
    rationale: Describe
    current: Describe
    risk: Risk | None
    display: Mapping[str, str] | None
    edit_schema: Mapping[str, Any] | None
    expires_in: int | None
    on_expiry: OnExpiry | None

    def asked(self, raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
        """The model's arguments by name, defaults included (as `require_approval` binds them: the two must ask
        the same). ValueError when they do not fit the function, or are not JSON."""
        if isinstance(raw, Mapping):
            value: Any = dict(raw)
        else:
            try:
                value = json.loads(raw or "{}")
            except ValueError:
                raise ValueError(f"its arguments are not JSON: {raw!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"its arguments are not a JSON object: {raw!r}")
        try:
            bound = self.signature.bind(**value)
        except TypeError as exc:
            raise ValueError(f"its arguments do not fit {self.action}(): {exc}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for parameter in self.signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(parameter.name, {}))
        try:
            arguments_digest(arguments)
        except (TypeError, ValueError) as exc:  # a default that is not JSON
            raise ValueError(f"its arguments are not JSON: {exc}") from None
        return arguments

    def describe(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The request's fields besides its arguments (rationale and current may be callables of them)."""
        return {
            "rationale": self.rationale(**arguments) if callable(self.rationale) else self.rationale,
            "current": self.current(**arguments) if callable(self.current) else self.current,
            "risk": self.risk,
            "display": self.display,
            "schema": self.edit_schema,
            "expires_in": self.expires_in,
            "on_expiry": self.on_expiry,
        }

    async def call(self, context: RunContext[Any], arguments: Mapping[str, Any]) -> Any:
        """The function with the approved arguments, validated and converted as Pydantic AI's own tools are."""
        validated = self.schema.validator.validate_python(dict(arguments), context=context.validation_context)
        return await self.schema.call(validated, context)

    def declined(self, request: ApprovalRequest) -> str:
        """What the model reads as the output of a call that a person did not approve."""
        if request.status is RequestStatus.REJECTED:
            said = f" Their comment: {request.comment}" if request.comment else ""
            why = f" (reason: {request.reason})" if request.reason else ""
            who = request.decided_by or "a reviewer"
            return f"{who} rejected this call of {self.action}{why}; it did not run.{said}"
        if request.status is RequestStatus.EXPIRED:
            return f"Nobody approved this call of {self.action} in time (the request expired); it did not run."
        return f"The request to run {self.action} was cancelled; it did not run. {request.reason}".rstrip()


class _Invoker:
    """The approval tool's function, as Pydantic AI calls it: it ignores the arguments the framework approved and
    runs the call only through its session (the console's go, for the console's arguments)."""

    def __init__(self, approval: _Approval) -> None:
        self.approval = approval
        self.__name__ = approval.action

    async def __call__(self, ctx: RunContext[Any], *args: Any, **kwargs: Any) -> Any:
        session = _SESSION.get()
        if session is None:
            raise NoApprovalSession(
                f"{self.approval.action} runs only with the console's approval: run the agent with "
                "run_with_approvals (it did not run)."
            )
        return await session.execute(self.approval, ctx)


@overload
def approval_tool(function: Callable[..., Any], /, *, channel: str, **options: Any) -> Tool[Any]: ...


@overload
def approval_tool(*, channel: str, **options: Any) -> Callable[[Callable[..., Any]], Tool[Any]]: ...


def approval_tool(
    function: Callable[..., Any] | None = None,
    /,
    *,
    channel: str,
    name: str | None = None,
    description: str | None = None,
    rationale: Describe = None,
    current: Describe = None,
    risk: Risk | None = None,
    display: Mapping[str, str] | None = None,
    schema: Mapping[str, Any] | bool | None = None,
    expires_in: int | None = None,
    on_expiry: OnExpiry | None = None,
    max_retries: int | None = None,
) -> Tool[Any] | Callable[[Callable[..., Any]], Tool[Any]]:
    """A `Tool` (name, description and parameters from the function, as `Tool(function)` reads them) that needs a
    person's sign-off on `channel` for every call, and runs only under `run_with_approvals`.

    `rationale` and `current` (the target's state now, for the card's diff) may be callables of the call's
    arguments. `schema`: the JSON Schema reviewers' edits are checked against; by default the tool's parameters'
    (the schema the model fills), `False` for none (then a person may approve or reject, not edit). The function
    may take the `RunContext` first, as tools may, and be sync or async."""

    def make(target: Callable[..., Any]) -> Tool[Any]:
        plain = Tool(target, name=name, description=description)
        parsed = plain.function_schema
        signature = inspect.signature(target)
        parameters = list(signature.parameters.values())
        if parsed.takes_ctx:
            signature = signature.replace(parameters=parameters[1:])
        for parameter in signature.parameters.values():
            if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
                raise TypeError(
                    f"{plain.name}: an approval tool's function is called with the approved arguments by name; "
                    f"its parameter {parameter} cannot be given by name."
                )
        approval = _Approval(
            schema=parsed,
            signature=signature,
            action=plain.name,
            channel=channel,
            rationale=rationale,
            current=current,
            risk=risk,
            display=display,
            edit_schema=parsed.json_schema if schema is None or schema is True else (schema or None),
            expires_in=expires_in,
            on_expiry=on_expiry,
        )
        invoker = _Invoker(approval)
        # The model sees the function's own parameters and Pydantic AI validates its arguments against them (a bad
        # call is sent back to the model, and never becomes a card); what it calls is the invoker.
        return Tool(
            invoker,
            name=plain.name,
            description=plain.description,
            max_retries=max_retries,
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
    on_wait: OnWait | None = None,
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
    keeper = _Session(client, session, Path(history_path) if history_path is not None else None, timeout, poll)
    keeper.on_wait = on_wait
    tools = _approval_tools([*agent.toolsets, *(run_options.get("toolsets") or [])])
    outputs = _with_deferred(agent.output_type if output_type is None else output_type)
    saved = keeper.load()
    token = _SESSION.set(keeper)
    try:
        if saved is None:
            result = await agent.run(prompt, output_type=outputs, **run_options)
        else:
            messages, pending = saved
            answers = await keeper.decide(tools, pending)
            result = await agent.run(
                None, message_history=messages, deferred_tool_results=answers, output_type=outputs, **run_options
            )
        while isinstance(result.output, DeferredToolRequests):
            messages = result.all_messages()
            keeper.save(messages, result.output)
            answers = await keeper.decide(tools, result.output)
            result = await agent.run(
                None, message_history=messages, deferred_tool_results=answers, output_type=outputs, **run_options
            )
        keeper.finish(result)
        return result
    finally:
        _SESSION.reset(token)


class _Session:
    """One run of the agent: its key, its external run on the console, its history file."""

    def __init__(self, client: AsyncClient, name: str, path: Path | None, timeout: float | None, poll: int) -> None:
        if not name or len(name) > _MAX_SESSION:
            raise ValueError(f"session must be 1 to {_MAX_SESSION} characters.")
        self.client, self.name, self.path, self.timeout, self.poll = client, name, path, timeout, poll
        self.run_id: str | None = None
        self.on_wait: OnWait | None = None
        # The decisions this session read, by tool_call_id: what the model is told of an edit (who, why).
        self._decided: dict[str, ApprovalRequest] = {}
        self._messages: Any = None
        self._pending: Any = None
        # The calls this session asked the console about, by tool_call_id: the model's arguments, which the tool
        # asks again under the same key (other arguments under that key would be another action).
        self._asked: dict[str, dict[str, Any]] = {}

    def key(self, tool_call_id: str) -> str:
        return f"{self.name}:{tool_call_id}"

    # --- the history file ---

    def load(self) -> tuple[list[ModelMessage], DeferredToolRequests] | None:
        """The saved history and the calls it stopped on, or None to start afresh."""
        if self.path is None or not self.path.exists():
            return None
        saved = json.loads(self.path.read_text(encoding="utf-8"))
        if not isinstance(saved, dict) or saved.get("format") != _HISTORY_FORMAT:
            raise ValueError(f"{self.path} is not a history file of run_with_approvals.")
        if saved.get("session") != self.name:
            raise ValueError(f"{self.path} is the history of session {saved.get('session')!r}, not {self.name!r}.")
        if saved.get("finished"):
            raise SessionFinished(self.name, saved.get("output"))
        self.run_id = saved.get("run_id")
        self._messages, self._pending = saved.get("messages"), saved.get("pending")
        if self._messages is None or self._pending is None:
            return None  # it stopped before its first approvals were saved: nothing ran yet
        return ModelMessagesTypeAdapter.validate_python(self._messages), _PENDING.validate_python(self._pending)

    def save(self, messages: list[ModelMessage] | None = None, pending: DeferredToolRequests | None = None) -> None:
        if messages is not None:
            self._messages = ModelMessagesTypeAdapter.dump_python(messages, mode="json")
        if pending is not None:
            self._pending = _PENDING.dump_python(pending, mode="json")
        self._write({"messages": self._messages, "pending": self._pending})

    def finish(self, result: AgentRunResult[Any]) -> None:
        messages = ModelMessagesTypeAdapter.dump_python(result.all_messages(), mode="json")
        self._write({"finished": True, "output": _as_json(result.output), "messages": messages})

    def _write(self, content: dict[str, Any]) -> None:
        if self.path is not None:
            head = {"format": _HISTORY_FORMAT, "session": self.name, "run_id": self.run_id}
            _write_atomically(self.path, json.dumps({**head, **content}))

    # --- asking and deciding ---

    async def decide(self, tools: Mapping[str, _Approval], pending: DeferredToolRequests) -> DeferredToolResults:
        """Asks the console about every deferred call, waits for the decisions and returns them as the results
        the run continues with."""
        if pending.calls:
            names = sorted({call.tool_name for call in pending.calls})
            raise NotAnApprovalTool(
                f"The run stopped for calls executed externally ({', '.join(names)}): run_with_approvals answers "
                "approval tools only."
            )
        calls = [(call, _approval_of(tools, call)) for call in pending.approvals]
        answers = DeferredToolResults()
        asked: list[tuple[ToolCallPart, _Approval, ApprovalRequest]] = []
        for call, approval in calls:
            try:
                arguments = approval.asked(call.args)
            except ValueError as exc:
                # Nothing a person could approve: the model hears why, and may call again.
                answers.approvals[call.tool_call_id] = ToolDenied(f"{approval.action} did not run: {exc}")
                continue
            request = await self.client.request_approval(
                approval.channel,
                approval.action,
                arguments,
                idempotency_key=self.key(call.tool_call_id),
                run=self.run_id,
                **approval.describe(arguments),
            )
            self._asked[call.tool_call_id] = arguments
            if self.run_id is None and request.run_id is not None:
                # The session's first request opened its external run: the later ones join it.
                self.run_id = request.run_id
                self.save()
            asked.append((call, approval, request))
        undecided = [(call, request) for call, _, request in asked if not request.decided]
        if undecided and self.on_wait is not None:
            await _waiting.tell(
                self.on_wait, [_waiting.waiting(self.client, r, call.tool_call_id) for call, r in undecided]
            )
        for call, approval, request in asked:
            decided = request if request.decided else await self.client.wait(request.id, self.timeout, self.poll)
            self._decided[call.tool_call_id] = decided
            if decided.status is RequestStatus.APPROVED and decided.arguments is not None:
                # Pydantic AI may now call the tool, with what the person approved; the tool itself runs what
                # the console gives its go for, once.
                answers.approvals[call.tool_call_id] = ToolApproved(override_args=dict(decided.arguments))
            else:
                answers.approvals[call.tool_call_id] = ToolDenied(approval.declined(decided))
        return answers

    async def execute(self, approval: _Approval, context: RunContext[Any]) -> Any:
        """The approved call: the one go, the function with the approved arguments, the report (or what is
        recorded, when an earlier process took the go)."""
        call_id = context.tool_call_id
        asked = self._asked.get(call_id) if call_id is not None else None
        if call_id is None or asked is None:
            raise NoApprovalSession(
                f"{approval.action} was called for {call_id!r}, which this session did not ask the console about "
                "(approved outside run_with_approvals): it did not run."
            )
        ran_with: dict[str, Any] = {}

        async def action(**approved: Any) -> Any:
            ran_with.update(approved)
            return await approval.call(context, approved)

        action.__signature__ = approval.signature  # type: ignore[attr-defined]
        action.__name__ = approval.action
        described = approval.describe(asked)
        key = self.key(call_id)
        guarded = require_approval(
            self.client,
            channel=approval.channel,
            action=approval.action,
            rationale=described["rationale"],
            current=described["current"],
            schema=approval.edit_schema or False,
            risk=approval.risk,
            display=approval.display,
            key=lambda *_, **__: key,
            run=self.run_id,
            expires_in=approval.expires_in,
            on_expiry=approval.on_expiry,
            timeout=self.timeout,
            poll=self.poll,
        )(action)
        try:
            result = await guarded(**asked)
        except (Declined, OutcomeUnknown) as outcome:
            # Nothing runs: the model reads what happened (a person checks an unknown outcome).
            return str(outcome)
        except ActionFailed as failed:
            raise ToolFailed(str(failed)) from failed
        except HitlError:
            raise  # the console's refusal or absence: the run stops, and continues from its history later
        except Exception as exc:  # the function itself failed: reported as failed, and told to the model
            raise ToolFailed(f"{approval.action} failed: {exc}") from exc
        if not ran_with and _is_shadow(result):
            # A shadow card: the console recorded the effect as shadow; the function was not called.
            return (
                f"{approval.action} was not run by the agent: its channel is in shadow mode, and a person carries "
                f"it out by hand with {json.dumps(result['arguments'], sort_keys=True)}."
            )
        if ran_with and ran_with != asked:
            return (
                f"A person edited the arguments before approving: {approval.action} ran with "
                f"{json.dumps(ran_with, sort_keys=True)}.{_waiting.comment(self._decided.get(call_id))} "
                f"Its result: {_as_text(result)}"
            )
        return result


def _approval_tools(toolsets: Sequence[AbstractToolset[Any]]) -> dict[str, _Approval]:
    """The agent's approval tools by name (those of its function toolsets, wherever they are nested)."""
    found: dict[str, _Approval] = {}

    def visit(toolset: AbstractToolset[Any]) -> None:
        if isinstance(toolset, FunctionToolset):
            for name, tool in toolset.tools.items():
                if isinstance(tool.function, _Invoker):
                    found[name] = tool.function.approval

    for toolset in toolsets:
        toolset.apply(visit)
    return found


def _approval_of(tools: Mapping[str, _Approval], call: ToolCallPart) -> _Approval:
    approval = tools.get(call.tool_name)
    if approval is None:
        raise NotAnApprovalTool(
            f"The run stopped for {call.tool_name!r}, which needs approval but is not an approval_tool of this "
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


def _is_shadow(result: Any) -> bool:
    """require_approval's answer on a shadow card, in place of the function's result."""
    return isinstance(result, dict) and result.get("shadow") is True and set(result) == _SHADOW_KEYS


_SHADOW_KEYS = {"shadow", "request_id", "action", "arguments"}


def _as_json(value: Any) -> Any:
    try:
        return json.loads(json.dumps(to_jsonable_python(value)))
    except (TypeError, ValueError, PydanticSerializationError):
        return str(value)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(_as_json(value))


def _write_atomically(path: Path, text: str) -> None:
    """The whole file or the previous one, never half of it: a crash while saving must not lose the run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
