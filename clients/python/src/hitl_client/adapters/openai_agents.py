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
interruption, the same keys give back the same requests and decisions, and a call whose go was taken is not run
again: the model reads its recorded result, or that its outcome is unknown (consumed, never reported; a person
checks) when the process died between the two.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

from agents import Agent, FunctionTool, RunConfig, RunHooks, Runner, RunResult, RunState
from agents.exceptions import UserError
from agents.function_schema import FuncSchema, function_schema
from agents.items import ToolApprovalItem
from agents.run_config import DEFAULT_MAX_TURNS
from agents.tool_context import ToolContext

from hitl_client.adapters import _waiting
from hitl_client.adapters._waiting import OnWait
from hitl_client.client import AsyncClient, OnExpiry, Risk
from hitl_client.decorator import require_approval
from hitl_client.digest import arguments_digest
from hitl_client.errors import ActionFailed, Declined, HitlError, OutcomeUnknown
from hitl_client.models import ApprovalRequest, RequestStatus

__all__ = ["NoApprovalSession", "NotAnApprovalTool", "SessionFinished", "approval_tool", "run_with_approvals"]

F = TypeVar("F", bound=Callable[..., Any])
Describe = str | Mapping[str, Any] | Callable[..., Any] | None

# The run_with_approvals that is running the agent: the tools' invokers run inside it (the SDK's tasks inherit it).
_SESSION: ContextVar[_Session | None] = ContextVar("hitl_openai_agents_session", default=None)
_STATE_FORMAT = 1
# The idempotency key is `session:call_id`; the contract allows 200 characters, a model's call ids take ~40.
_MAX_SESSION = 120


class NoApprovalSession(HitlError):
    """An approval tool was invoked outside `run_with_approvals` (say, by `Runner.run` after `state.approve`):
    it runs only with the console's go, so it refused, and nothing ran."""


class NotAnApprovalTool(HitlError):
    """The run stopped for a tool that needs approval but is not an `approval_tool`: the console could approve
    it, but nothing would hold the SDK to run it once with what was approved."""


class SessionFinished(HitlError):
    """This session's run has ended before (its state file says so): it is not run again. `final_output` is
    what it ended with (as JSON, or its text)."""

    def __init__(self, session: str, final_output: Any) -> None:
        super().__init__(f"The session {session!r} has finished: {final_output!r}")
        self.session, self.final_output = session, final_output


@dataclass(frozen=True)
class _Approval:
    """What an approval tool asks the console, and how it calls its function with the approved arguments."""

    function: Callable[..., Any]
    schema: FuncSchema
    # The function's parameters the model fills (without a leading context parameter): what the person approves.
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

    def asked(self, raw: str | None) -> dict[str, Any]:
        """The model's arguments by name, defaults included (as `require_approval` binds them: the two must ask
        the same). ValueError when they do not fit the function, or are not JSON."""
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

    async def call(self, context: ToolContext[Any], arguments: Mapping[str, Any]) -> Any:
        """The function with the approved arguments, validated and converted as the SDK's own tools do."""
        parsed = self.schema.params_pydantic_model(**arguments)
        args, kwargs = self.schema.to_call_args(parsed)
        if self.schema.takes_context:
            args = [context, *args]
        if inspect.iscoroutinefunction(self.function):
            return await self.function(*args, **kwargs)
        return await asyncio.to_thread(self.function, *args, **kwargs)

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
    """The approval tool's `on_invoke_tool`: runs the call only through its session (the console's go)."""

    def __init__(self, approval: _Approval) -> None:
        self.approval = approval

    async def __call__(self, context: ToolContext[Any], raw: str) -> Any:
        session = _SESSION.get()
        if session is None:
            raise NoApprovalSession(
                f"{self.approval.action} runs only with the console's approval: run the agent with "
                "run_with_approvals (it did not run)."
            )
        return await session.execute(self.approval, context, raw)


@overload
def approval_tool(function: Callable[..., Any], /, *, channel: str, **options: Any) -> FunctionTool: ...


@overload
def approval_tool(*, channel: str, **options: Any) -> Callable[[Callable[..., Any]], FunctionTool]: ...


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
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """A function tool (as `agents.function_tool` makes it: name, description and parameters from the function)
    that needs a person's sign-off on `channel` for every call, and runs only under `run_with_approvals`.

    `rationale` and `current` (the target's state now, for the card's diff) may be callables of the call's
    arguments. `schema`: the JSON Schema reviewers' edits are checked against; by default the tool's parameters'
    (the schema the model fills), `False` for none (then a person may approve or reject, not edit). The function
    may take the SDK's context first, as function tools may."""

    def make(target: Callable[..., Any]) -> FunctionTool:
        parsed = function_schema(target, name_override=name, description_override=description)
        signature = parsed.signature
        parameters = list(signature.parameters.values())
        if parsed.takes_context:
            signature = signature.replace(parameters=parameters[1:])
        for parameter in signature.parameters.values():
            if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
                raise TypeError(
                    f"{parsed.name}: an approval tool's function is called with the approved arguments by name; "
                    f"its parameter {parameter} cannot be given by name."
                )
        approval = _Approval(
            function=target,
            schema=parsed,
            signature=signature,
            action=parsed.name,
            channel=channel,
            rationale=rationale,
            current=current,
            risk=risk,
            display=display,
            # The strict schema the model fills (every parameter required, no others): an edit must fit it too.
            edit_schema=parsed.params_json_schema if schema is None or schema is True else (schema or None),
            expires_in=expires_in,
            on_expiry=on_expiry,
        )
        tool = FunctionTool(
            name=parsed.name,
            description=parsed.description or "",
            params_json_schema=parsed.params_json_schema,
            on_invoke_tool=_Invoker(approval),
            strict_json_schema=True,
            needs_approval=True,
        )
        return tool

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
    on_wait: OnWait | None = None,
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
    keeper = _Session(client, session, Path(state_path) if state_path is not None else None, timeout, poll)
    keeper.on_wait = on_wait
    saved = keeper.load()
    next_input: str | list[Any] | RunState[Any] = input
    token = _SESSION.set(keeper)
    try:
        if saved is not None:
            override = context if isinstance(context, Mapping) else None
            state = await RunState.from_json(agent, saved, context_override=override)
            await keeper.decide(state, state.get_interruptions())
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
                keeper.finish(result.final_output)
                return result
            state = result.to_state()
            keeper.save(state)
            await keeper.decide(state, result.interruptions)
            next_input = state
    finally:
        _SESSION.reset(token)


class _Session:
    """One run of the agent: its key, its external run on the console, its state file."""

    def __init__(self, client: AsyncClient, name: str, path: Path | None, timeout: float | None, poll: int) -> None:
        if not name or len(name) > _MAX_SESSION:
            raise ValueError(f"session must be 1 to {_MAX_SESSION} characters.")
        self.client, self.name, self.path, self.timeout, self.poll = client, name, path, timeout, poll
        self.run_id: str | None = None
        self.on_wait: OnWait | None = None
        self._state: dict[str, Any] | None = None
        # The decisions this session read, by idempotency key: what the model is told of an edit (who, why).
        self._decided: dict[str, ApprovalRequest] = {}

    def key(self, call_id: str) -> str:
        return f"{self.name}:{call_id}"

    # --- the state file ---

    def load(self) -> dict[str, Any] | None:
        """The saved run's state, or None to start afresh."""
        if self.path is None or not self.path.exists():
            return None
        saved = json.loads(self.path.read_text(encoding="utf-8"))
        if not isinstance(saved, dict) or saved.get("format") != _STATE_FORMAT:
            raise ValueError(f"{self.path} is not a state file of run_with_approvals.")
        if saved.get("session") != self.name:
            raise ValueError(f"{self.path} is the state of session {saved.get('session')!r}, not {self.name!r}.")
        if saved.get("finished"):
            raise SessionFinished(self.name, saved.get("final_output"))
        self.run_id = saved.get("run_id")
        state = saved.get("state")
        self._state = state if isinstance(state, dict) else None
        return self._state

    def save(self, state: RunState[Any] | None = None, **extra: Any) -> None:
        if state is not None:
            self._state = state.to_json()
        if self.path is None:
            return
        content = {"format": _STATE_FORMAT, "session": self.name, "run_id": self.run_id, "state": self._state}
        _write_atomically(self.path, json.dumps({**content, **extra}))

    def finish(self, final_output: Any) -> None:
        self._state = None
        self.save(finished=True, final_output=_as_json(final_output))

    # --- asking and deciding ---

    async def decide(self, state: RunState[Any], interruptions: list[ToolApprovalItem]) -> None:
        """Asks the console about every interrupted call, waits for the decisions and records them on `state`."""
        asked: list[tuple[ToolApprovalItem, _Approval, ApprovalRequest]] = []
        for item in interruptions:
            approval = _approval_of(item)
            try:
                arguments = approval.asked(_raw_field(item, "arguments"))
            except ValueError as exc:
                # Nothing a person could approve: the model hears why, and may call again.
                state.reject(item, rejection_message=f"{approval.action} did not run: {exc}")
                continue
            request = await self.client.request_approval(
                approval.channel,
                approval.action,
                arguments,
                idempotency_key=self.key(_raw_field(item, "call_id")),
                run=self.run_id,
                **approval.describe(arguments),
            )
            if self.run_id is None and request.run_id is not None:
                # The session's first request opened its external run: the later ones join it.
                self.run_id = request.run_id
                self.save()
            asked.append((item, approval, request))
        undecided = [(item, request) for item, _, request in asked if not request.decided]
        if undecided and self.on_wait is not None:
            await _waiting.tell(
                self.on_wait, [_waiting.waiting(self.client, r, _raw_field(item, "call_id")) for item, r in undecided]
            )
        for item, approval, request in asked:
            decided = request if request.decided else await self.client.wait(request.id, self.timeout, self.poll)
            self._decided[self.key(_raw_field(item, "call_id"))] = decided
            if decided.status is RequestStatus.APPROVED:
                # The SDK may now invoke the tool; its invoker runs what the console approved, once.
                state.approve(item)
            else:
                state.reject(item, rejection_message=approval.declined(decided))

    async def execute(self, approval: _Approval, context: ToolContext[Any], raw: str) -> Any:
        """The approved call: the one go, the function with the approved arguments, the report (or what is
        recorded, when an earlier process took the go)."""
        try:
            asked = approval.asked(raw)
        except ValueError as exc:
            return f"{approval.action} did not run: {exc}"
        ran_with: dict[str, Any] = {}

        async def action(**approved: Any) -> Any:
            ran_with.update(approved)
            return await approval.call(context, approved)

        action.__signature__ = approval.signature  # type: ignore[attr-defined]
        action.__name__ = approval.action
        described = approval.describe(asked)
        key = self.key(context.tool_call_id)
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
        except (Declined, OutcomeUnknown, ActionFailed) as outcome:
            # Nothing runs: the model reads what happened (a person checks an unknown outcome).
            return str(outcome)
        except HitlError:
            raise  # the console's refusal or absence: the run stops, and resumes from its state later
        except Exception as exc:  # the tool itself failed: reported as failed, and told to the model
            return f"{approval.action} failed: {exc}"
        if not ran_with and _is_shadow(result):
            # A shadow card: the console recorded the effect as shadow; the function was not called.
            return (
                f"{approval.action} was not run by the agent: its channel is in shadow mode, and a person carries "
                f"it out by hand with {json.dumps(result['arguments'], sort_keys=True)}."
            )
        if ran_with and ran_with != asked:
            return (
                f"A person edited the arguments before approving: {approval.action} ran with "
                f"{json.dumps(ran_with, sort_keys=True)}.{_waiting.comment(self._decided.get(key))} "
                f"Its result: {_as_text(result)}"
            )
        return result


def _approval_of(item: ToolApprovalItem) -> _Approval:
    for tool in getattr(item.agent, "tools", []):
        if isinstance(tool, FunctionTool) and tool.name == item.tool_name and isinstance(tool.on_invoke_tool, _Invoker):
            return tool.on_invoke_tool.approval
    raise NotAnApprovalTool(
        f"The run stopped for {item.tool_name!r}, which needs approval but is not an approval_tool (or not a tool "
        f"of agent {item.agent.name!r}): make it with approval_tool, so that it runs once with what was approved."
    )


def _is_shadow(result: Any) -> bool:
    """require_approval's answer on a shadow card, in place of the function's result."""
    return (
        isinstance(result, dict)
        and result.get("shadow") is True
        and set(result)
        == {
            "shadow",
            "request_id",
            "action",
            "arguments",
        }
    )


def _raw_field(item: ToolApprovalItem, name: str) -> Any:
    raw = item.raw_item
    return raw.get(name) if isinstance(raw, Mapping) else getattr(raw, name, None)


def _as_json(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
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
