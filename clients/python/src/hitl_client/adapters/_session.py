"""What every adapter does with the console, once, whatever the framework: ask for each tool call under a key
that names it across restarts (so asking again after a crash finds the same request, decision and receipt), join
the session's external run, say where a person decides while the agent waits, wait, and run an approved call
through `require_approval` (the one "go", the function with the approved arguments, the report: the client's
rules of exactly once), then tell the model what happened. The adapters only translate to their framework: what a
tool call is, how a decision is handed back, what the model reads. No framework is imported here.

- `Session`: a conversation's requests: their keys, the external run they share, asking, the guarded run
  (the MCP gateway, which makes its own keys, uses it as it is).
- `ToolSession`: a `Session` with a state file, for the runs that stop for approvals (the OpenAI Agents SDK's and
  Pydantic AI's `run_with_approvals`): decide every pending call, then execute the approved ones.
- `ApprovalTool`: what an approval tool asks the console, from `approval_tool`'s options.

LangGraph's `ApprovalToolNode` keeps its requests in the graph's checkpoint under keys of its own, with a blocking
or an async client: it runs the same exactly-once tail as `require_approval` (`hitl_client.decorator.run_approved`)
on the client's own driver, and no session.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from hitl_client.client import AsyncClient, OnExpiry, Risk
from hitl_client.decorator import require_approval
from hitl_client.digest import arguments_digest
from hitl_client.errors import ActionFailed, Declined, HitlError, OutcomeUnknown
from hitl_client.models import ApprovalRequest, RequestStatus

Describe = str | Mapping[str, Any] | Callable[..., Any] | None
# `on_wait(requests)`: told what the agent waits for before each wait; may return an awaitable (awaited).
OnWait = Callable[[list[dict[str, Any]]], "None | Awaitable[None]"]
_STATE_FORMAT = 1
# The idempotency key is `session:call_id`; the contract allows 200 characters, a model's call ids take ~40.
MAX_SESSION = 120


class ApprovalOptions(TypedDict, total=False):
    """What `approval_tool` takes besides the function and its channel: the tool's `name` and `description` (by
    default the function's); `rationale` and `current` (the target's state now, for the card's diff), which may be
    callables of the call's arguments; `schema`, the JSON Schema reviewers' edits are checked against (by default
    the tool's parameters', the schema the model fills; `False` for none: then a person may approve or reject, not
    edit); `risk`, `display`, `expires_in` and `on_expiry`, the request's (docs/external-agents.md)."""

    name: str | None
    description: str | None
    rationale: Describe
    current: Describe
    risk: Risk | None
    display: Mapping[str, str] | None
    schema: Mapping[str, Any] | bool | None
    expires_in: int | None
    on_expiry: OnExpiry | None


class NoApprovalSession(HitlError):
    """An approval tool was called outside `run_with_approvals`, or for a call it did not ask the console about:
    it runs only with the console's go, so it refused, and nothing ran."""


class NotAnApprovalTool(HitlError):
    """The run stopped for a tool that needs approval but is not an `approval_tool`: the console could approve
    it, but nothing would hold the framework to run it once with what was approved. Nothing was asked."""


class SessionFinished(HitlError):
    """This session's run has ended before (its file says so): it is not run again. `output` is what it ended
    with (as JSON, or its text)."""

    def __init__(self, session: str, output: Any) -> None:
        super().__init__(f"The session {session!r} has finished: {output!r}")
        self.session, self.output = session, output


class ToolFailure(Exception):
    """The approved action failed (now, or when it ran before): the text the model reads, which the adapter
    hands to its framework as the tool's failure or its output."""


@dataclass(frozen=True)
class ApprovalTool:
    """What an approval tool asks the console, and how its function is called with the approved arguments."""

    action: str
    channel: str
    # The function's parameters the model fills (without a leading context parameter): what the person approves.
    signature: inspect.Signature
    # call(context, approved arguments): the function, as the framework calls its own tools.
    call: Callable[[Any, Mapping[str, Any]], Awaitable[Any]]
    rationale: Describe
    current: Describe
    risk: Risk | None
    display: Mapping[str, str] | None
    edit_schema: Mapping[str, Any] | None
    expires_in: int | None
    on_expiry: OnExpiry | None

    @classmethod
    def of(
        cls,
        *,
        action: str,
        channel: str,
        signature: inspect.Signature,
        takes_context: bool,
        call: Callable[[Any, Mapping[str, Any]], Awaitable[Any]],
        parameters_schema: Mapping[str, Any],
        options: ApprovalOptions,
    ) -> ApprovalTool:
        """`signature`: the function's own (its first parameter dropped when it `takes_context`);
        `parameters_schema`: what the model fills, the default schema of an edit."""
        if takes_context:
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        for parameter in signature.parameters.values():
            if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
                raise TypeError(
                    f"{action}: an approval tool's function is called with the approved arguments by name; "
                    f"its parameter {parameter} cannot be given by name."
                )
        schema = options.get("schema")
        return cls(
            action=action,
            channel=channel,
            signature=signature,
            call=call,
            rationale=options.get("rationale"),
            current=options.get("current"),
            risk=options.get("risk"),
            display=options.get("display"),
            edit_schema=parameters_schema if schema is None or schema is True else (schema or None),
            expires_in=options.get("expires_in"),
            on_expiry=options.get("on_expiry"),
        )

    def asked(self, raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
        """The model's arguments (JSON text, or already parsed) by name, defaults included (as `require_approval`
        binds them: the two must ask the same). ValueError when they do not fit the function, or are not JSON."""
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

    def declined(self, request: ApprovalRequest) -> str:
        """What the model reads as the output of a call that a person did not approve."""
        if request.status is RequestStatus.REJECTED:
            why = f" (reason: {request.reason})" if request.reason else ""
            who = request.decided_by or "a reviewer"
            return f"{who} rejected this call of {self.action}{why}; it did not run.{comment(request)}"
        if request.status is RequestStatus.EXPIRED:
            return f"Nobody approved this call of {self.action} in time (the request expired); it did not run."
        return f"The request to run {self.action} was cancelled; it did not run. {request.reason}".rstrip()


@dataclass(frozen=True)
class PendingCall:
    """A tool call the framework stopped on: its id, its approval tool, and its arguments as the model gave them."""

    call_id: str
    tool: ApprovalTool
    raw: str | Mapping[str, Any] | None


def comment(decided: ApprovalRequest | None) -> str:
    """The reviewer's comment on a decision, as the model reads it."""
    return f" Their comment: {decided.comment}" if decided is not None and decided.comment else ""


def waiting(client: AsyncClient, request: ApprovalRequest, call_id: str) -> dict[str, Any]:
    """What `on_wait` is told of a request the agent waits for."""
    return {
        "request_id": request.id,
        "url": request.url,
        "card_id": request.card_id,
        "card_url": client.card_url(request.card_id),
        "action": request.action,
        "tool_call_id": call_id,
    }


def is_shadow(result: Any) -> bool:
    """require_approval's answer on a shadow card, in place of the function's result."""
    return isinstance(result, dict) and result.get("shadow") is True and set(result) == _SHADOW_KEYS


_SHADOW_KEYS = {"shadow", "request_id", "action", "arguments"}


class Session:
    """One conversation of an agent with the console: its name in the requests' keys, its external run (the
    first request opens it; the later ones join it), and how long to wait for a decision."""

    def __init__(
        self,
        client: AsyncClient,
        name: str,
        *,
        timeout: float | None = None,
        poll: int = 25,
        max_name: int = MAX_SESSION,
    ) -> None:
        if not name or len(name) > max_name:
            raise ValueError(f"session must be 1 to {max_name} characters.")
        self.client, self.name, self.timeout, self.poll = client, name, timeout, poll
        self.run_id: str | None = None

    def key(self, call_id: str) -> str:
        return f"{self.name}:{call_id}"

    async def ask(
        self, channel: str, action: str, arguments: Mapping[str, Any], key: str, described: Mapping[str, Any]
    ) -> ApprovalRequest:
        """The request for one call (the same one again for the same key: after a crash, it is found again with
        its decision and receipt), in the session's run."""
        request = await self.client.request_approval(
            channel, action, arguments, idempotency_key=key, run=self.run_id, **described
        )
        if self.run_id is None and request.run_id is not None:
            # The session's first request opened its external run: the later ones join it.
            self.run_id = request.run_id
            self.joined()
        return request

    def joined(self) -> None:
        """The session has just learnt its run's id (a `ToolSession` writes it down)."""

    def guard(
        self,
        channel: str,
        action: str,
        key: str,
        described: Mapping[str, Any],
        function: Callable[..., Awaitable[Any]],
    ) -> Callable[..., Awaitable[Any]]:
        """`function` behind `require_approval` under `key`, in the session's run: asked (the same request again),
        waited for, its one go taken for the approved arguments, run with them and its outcome reported; or, when
        an earlier process took the go, the outcome it recorded (`ActionFailed`, `OutcomeUnknown`), never a
        second run."""
        fields = dict(described)
        return require_approval(
            self.client,
            channel=channel,
            action=action,
            rationale=fields.pop("rationale"),
            schema=fields.pop("schema") or False,
            key=lambda *_, **__: key,
            run=self.run_id,
            timeout=self.timeout,
            poll=self.poll,
            **fields,
        )(function)


@dataclass(frozen=True)
class SessionFile:
    """How an adapter's `run_with_approvals` file is named in errors (`kind`: "state", "history"), the name its
    output is kept under once the run has ended, and the adapter's `SessionFinished`."""

    kind: str
    output_key: str
    finished: type[SessionFinished]


class ToolSession(Session):
    """A run of an agent that stops for approvals (`run_with_approvals`), kept in a JSON file (`path`, or none)
    written atomically each time: `{"format", "session", "run_id", ...what the adapter keeps}`, and once the run
    has ended `"finished": true` with its output. `jsonable`: how the framework makes its values JSON (its tools'
    results, the run's output), if it has a way."""

    def __init__(
        self,
        client: AsyncClient,
        name: str,
        path: str | os.PathLike[str] | None,
        file: SessionFile,
        *,
        timeout: float | None,
        poll: int,
        on_wait: OnWait | None,
        jsonable: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(client, name, timeout=timeout, poll=poll)
        self.path = Path(path) if path is not None else None
        self.file, self.on_wait, self.jsonable = file, on_wait, jsonable
        self._content: dict[str, Any] = {}
        # The calls this session asked the console about, by call id: the model's arguments (a tool asks them
        # again under the same key: other arguments under that key would be another action), and the decisions
        # it read (what the model is told of an edit: who, why).
        self.asked: dict[str, dict[str, Any]] = {}
        self.decided: dict[str, ApprovalRequest] = {}

    # --- the file ---

    def load(self) -> dict[str, Any] | None:
        """What the adapter saved of the run, or None to start afresh. `SessionFinished` once it has ended."""
        if self.path is None or not self.path.exists():
            return None
        saved = json.loads(self.path.read_text(encoding="utf-8"))
        if not isinstance(saved, dict) or saved.get("format") != _STATE_FORMAT:
            raise ValueError(f"{self.path} is not a {self.file.kind} file of run_with_approvals.")
        if saved.get("session") != self.name:
            raise ValueError(
                f"{self.path} is the {self.file.kind} of session {saved.get('session')!r}, not {self.name!r}."
            )
        if saved.get("finished"):
            raise self.file.finished(self.name, saved.get(self.file.output_key))
        self.run_id = saved.get("run_id")
        self._content = {name: value for name, value in saved.items() if name not in ("format", "session", "run_id")}
        return self._content

    def save(self, **content: Any) -> None:
        """Keeps `content` (with what was kept before under other names) and writes the file."""
        self._content.update(content)
        self._write(self._content)

    def finish(self, output: Any, **content: Any) -> None:
        self._write({"finished": True, self.file.output_key: as_json(output, self.jsonable), **content})

    def joined(self) -> None:
        self.save()

    def _write(self, content: Mapping[str, Any]) -> None:
        if self.path is not None:
            head = {"format": _STATE_FORMAT, "session": self.name, "run_id": self.run_id}
            _write_atomically(self.path, json.dumps({**head, **content}))

    # --- asking and deciding ---

    async def decide(self, calls: Sequence[PendingCall]) -> list[ApprovalRequest | str]:
        """Asks the console about every call, tells `on_wait` what is undecided, and waits for each decision.
        For each call, in order: its decided request, or why nothing could be asked (the model reads it)."""
        answers: list[ApprovalRequest | str] = []
        asked: list[tuple[int, PendingCall, ApprovalRequest]] = []
        for call in calls:
            try:
                arguments = call.tool.asked(call.raw)
            except ValueError as exc:
                # Nothing a person could approve: the model hears why, and may call again.
                answers.append(f"{call.tool.action} did not run: {exc}")
                continue
            described = call.tool.describe(arguments)
            request = await self.ask(call.tool.channel, call.tool.action, arguments, self.key(call.call_id), described)
            self.asked[call.call_id] = arguments
            asked.append((len(answers), call, request))
            answers.append(request)
        undecided = [waiting(self.client, request, call.call_id) for _, call, request in asked if not request.decided]
        if undecided and self.on_wait is not None:
            told = self.on_wait(undecided)
            if inspect.isawaitable(told):
                await told
        for n, call, request in asked:
            decided = request if request.decided else await self.client.wait(request.id, self.timeout, self.poll)
            self.decided[call.call_id] = answers[n] = decided
        return answers

    async def execute(self, tool: ApprovalTool, call_id: str, asked: dict[str, Any], context: Any) -> Any:
        """The approved call: the one go, the function with the approved arguments, the report (or what is
        recorded, when an earlier process took the go). Returns what the model reads; raises `ToolFailure` when
        the action failed (now or before), and the console's refusal or absence (a `HitlError`: the run stops,
        and goes on from its file later)."""
        ran_with: dict[str, Any] = {}

        async def action(**approved: Any) -> Any:
            ran_with.update(approved)
            return await tool.call(context, approved)

        action.__signature__ = tool.signature  # type: ignore[attr-defined]
        action.__name__ = tool.action
        guarded = self.guard(tool.channel, tool.action, self.key(call_id), tool.describe(asked), action)
        try:
            result = await guarded(**asked)
        except (Declined, OutcomeUnknown) as outcome:
            # Nothing runs: the model reads what happened (a person checks an unknown outcome).
            return str(outcome)
        except ActionFailed as failed:
            raise ToolFailure(str(failed)) from failed
        except HitlError:
            raise
        except Exception as exc:  # the function itself failed: reported as failed, and told to the model
            raise ToolFailure(f"{tool.action} failed: {exc}") from exc
        if not ran_with and is_shadow(result):
            # A shadow card: the console recorded the effect as shadow; the function was not called.
            return (
                f"{tool.action} was not run by the agent: its channel is in shadow mode, and a person carries "
                f"it out by hand with {json.dumps(result['arguments'], sort_keys=True)}."
            )
        if ran_with and ran_with != asked:
            return (
                f"A person edited the arguments before approving: {tool.action} ran with "
                f"{json.dumps(ran_with, sort_keys=True)}.{comment(self.decided.get(call_id))} "
                f"Its result: {as_text(result, self.jsonable)}"
            )
        return result


def as_json(value: Any, jsonable: Callable[[Any], Any] | None = None) -> Any:
    """`value` as JSON (first made JSON-able by the framework's `jsonable`, when it has one), or its text."""
    try:
        return json.loads(json.dumps(jsonable(value) if jsonable is not None else value))
    except (TypeError, ValueError):  # pydantic's serialization errors are ValueErrors
        return str(value)


def as_text(value: Any, jsonable: Callable[[Any], Any] | None = None) -> str:
    return value if isinstance(value, str) else json.dumps(as_json(value, jsonable))


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
