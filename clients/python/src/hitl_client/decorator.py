"""`@require_approval`: a function that runs only with a person's sign-off, exactly once per idempotency key."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar, cast

from hitl_client import _protocol, _tracing
from hitl_client._protocol import Call, Flow, RetryPolicy
from hitl_client.client import Approval, AsyncClient, Client, OnExpiry, Risk, approval_request_body, result_body
from hitl_client.digest import arguments_digest
from hitl_client.errors import (
    ActionFailed,
    AlreadyConsumed,
    Cancelled,
    Expired,
    HitlError,
    NotApproved,
    OutcomeUnknown,
    Rejected,
    ReportFailed,
    UnexpectedResponse,
)
from hitl_client.models import ApprovalRequest, ExecutionStatus, RequestStatus

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger("hitl_client")
# An exception's repr can be anything (a whole response body): the receipt keeps its start.
_MAX_ERROR = 4000


def require_approval(
    client: Client | AsyncClient,
    *,
    channel: str,
    rationale: str | Mapping[str, Any] | Callable[..., str | Mapping[str, Any]],
    action: str | None = None,
    current: Mapping[str, Any] | Callable[..., Mapping[str, Any] | None] | None = None,
    schema: Mapping[str, Any] | bool | None = None,
    risk: Risk | None = None,
    display: Mapping[str, str] | None = None,
    key: Callable[..., str] | None = None,
    run: str | Callable[..., str | None] | None = None,
    callback_url: str | None = None,
    expires_in: int | None = None,
    on_expiry: OnExpiry | None = None,
    approval: Approval | None = None,
    timeout: float | None = None,
    poll: int = 25,
    compensate: Callable[..., Mapping[str, Any] | None] | None = None,
) -> Callable[[F], F]:
    """Each call asks for a person's sign-off, waits for it, takes the one "go" (consume), runs the function
    once with the approved arguments (a reviewer's edit included) as keyword arguments, reports the outcome and
    returns the function's result. Raises `Rejected`, `Expired` or `Cancelled` without running it, and `Locked`
    while a kill switch stops the channel (nothing ran; the same call after the release runs it once). On a
    shadow card the function is not called: the call returns `{"shadow": True, "request_id", "action",
    "arguments"}` (the approved arguments, which a person carries out by hand).

    The same call again (same idempotency key) never runs the action twice: an outcome already reported is
    returned (or `ActionFailed` raised) without calling the function; a consume whose outcome was never reported
    raises `OutcomeUnknown`. The key is `key(*args, **kwargs)`, by default the action's name and the digest of
    the call's arguments: two identical calls are one action (give a `key` that tells them apart otherwise).

    `rationale`, `current` and `run` may be callables taking the function's arguments. `schema` (a JSON Schema of
    the arguments, against which the console checks a reviewer's edit) is derived from the type hints when
    pydantic is installed; `schema=False` sends none (then reviewers may approve or reject, not edit).
    A sync function needs a `Client`, a coroutine function an `AsyncClient`. `timeout`: seconds to wait for the
    decision (`WaitTimeout`; calling again picks the same request up).

    `compensate(result, **arguments)`: what undoes a call that ran, `{"action": name, "arguments": {...}}` (or
    None: nothing), declared with its result (docs/external-agents.md, "Undo"). Should the run be undone, a person
    approves each compensation and `run_compensations` runs it, once, with the handler given for its action. A
    `compensate` that raises is logged and the success is reported without it: what ran is recorded first."""

    def decorate(function: F) -> F:
        is_async = inspect.iscoroutinefunction(function)
        if is_async and not isinstance(client, AsyncClient):
            raise TypeError(f"{function.__name__} is a coroutine function: require_approval needs an AsyncClient.")
        if not is_async and not isinstance(client, Client):
            raise TypeError(f"{function.__name__} is not a coroutine function: require_approval needs a Client.")
        spec = _Spec(
            function=function,
            signature=_keyword_signature(function),
            action=action or function.__name__,
            channel=channel,
            rationale=rationale,
            current=current,
            schema=schema,
            risk=risk,
            display=display,
            key=key,
            run=run,
            callback_url=callback_url,
            expires_in=expires_in,
            on_expiry=on_expiry,
            approval=approval,
            timeout=timeout,
            poll=poll,
            compensate=compensate,
        )
        policy = client._policy

        if is_async:
            assert isinstance(client, AsyncClient)

            @functools.wraps(function)
            async def asks_first_async(*args: Any, **kwargs: Any) -> Any:
                with _tracing.gate(spec.action, spec.channel) as gate:
                    return await client._run(_approved_call(spec, policy, args, kwargs, gate))

            return asks_first_async  # type: ignore[return-value]

        assert isinstance(client, Client)

        @functools.wraps(function)
        def asks_first(*args: Any, **kwargs: Any) -> Any:
            with _tracing.gate(spec.action, spec.channel) as gate:
                return client._run(_approved_call(spec, policy, args, kwargs, gate))

        return asks_first  # type: ignore[return-value]

    return decorate


@dataclass
class _Spec:
    function: Callable[..., Any]
    signature: inspect.Signature
    action: str
    channel: str
    rationale: Any
    current: Any
    schema: Any
    risk: Risk | None
    display: Mapping[str, str] | None
    key: Any
    run: Any
    callback_url: str | None
    expires_in: int | None
    on_expiry: OnExpiry | None
    approval: Approval | None
    timeout: float | None
    poll: int
    compensate: Callable[..., Mapping[str, Any] | None] | None = None

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, defaults included: what the person approves and what is hashed."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for parameter in self.signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(parameter.name, {}))
        return arguments

    def body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        arguments = self.arguments(args, kwargs)
        # Computed first: arguments that are not JSON fail here, before anything is sent.
        digest = arguments_digest(arguments)
        return approval_request_body(
            self.channel,
            self.action,
            arguments,
            idempotency_key=self.key(*args, **kwargs) if self.key else f"{self.action}:{digest}",
            rationale=self.rationale(*args, **kwargs) if callable(self.rationale) else self.rationale,
            current=self.current(*args, **kwargs) if callable(self.current) else self.current,
            risk=self.risk,
            display=self.display,
            schema=self.json_schema(),
            run=self.run(*args, **kwargs) if callable(self.run) else self.run,
            callback_url=self.callback_url,
            expires_in=self.expires_in,
            on_expiry=self.on_expiry,
            approval=self.approval,
        )

    def json_schema(self) -> Mapping[str, Any] | None:
        if self.schema is False:
            return None
        if self.schema is None:  # from the type hints, once per function
            self.schema = _schema_from_hints(self.function) or False
            return self.json_schema()
        if not isinstance(self.schema, Mapping):
            raise TypeError("schema must be a JSON Schema (a mapping), None (from the type hints) or False (none).")
        return self.schema


def _approved_call(
    spec: _Spec, policy: RetryPolicy, args: tuple[Any, ...], kwargs: dict[str, Any], gate: _tracing.Gate
) -> Flow[Any]:
    request = yield from _protocol.request_approval(spec.body(args, kwargs), policy)
    gate.saw(request)
    # A request already consumed (an earlier run of this call got its go) is never executed again.
    if request.execution.status is not ExecutionStatus.NOT_STARTED:
        return _recorded_outcome(request)
    if not request.decided:
        request = yield from _protocol.wait(request.id, spec.timeout, spec.poll, policy)
        gate.saw(request)

    def fits(arguments: dict[str, Any]) -> None:
        try:
            spec.signature.bind(**arguments)
        except TypeError as exc:
            raise TypeError(
                f"The approved arguments do not fit {spec.action}(): {exc} (nothing was consumed)."
            ) from exc

    outcome = yield from run_approved(request, spec.function, policy, check=fits, report_of=_reporter(spec, request))
    return outcome.value


def _reporter(spec: _Spec, request: ApprovalRequest) -> Callable[[Any], dict[str, Any]]:
    """The success's report: with what undoes it when the decorator was given `compensate`."""
    compensate = spec.compensate
    if compensate is None:
        return _success

    def with_compensation(result: Any) -> dict[str, Any]:
        try:
            declared = compensate(result, **(request.arguments or {}))
            return result_body(True, _as_json(result), compensation=declared)
        except Exception:
            logger.exception(
                "What undoes %s (request %s) could not be declared: its success is reported without it.",
                request.action,
                request.id,
            )
            return _success(result)

    return with_compensation


class Outcome(NamedTuple):
    """What `run_approved` came to: `value` is the function's result when it `ran` now; the result recorded
    before when an earlier run took the go (`recorded`); the shadow answer (`_shadow_result`) on a shadow card,
    where nothing runs (`shadow`)."""

    value: Any
    source: Literal["ran", "recorded", "shadow"]


def _success(result: Any) -> dict[str, Any]:
    return result_body(True, _as_json(result))


def run_approved(
    request: ApprovalRequest,
    function: Callable[..., Any],
    policy: RetryPolicy,
    *,
    check: Callable[[dict[str, Any]], None] | None = None,
    report_of: Callable[[Any], dict[str, Any]] = _success,
    unreported: tuple[type[BaseException], ...] = (),
) -> Flow[Outcome]:
    """A decided request's action, at most once: the one go (consume) for the approved arguments, `function`
    called with them (as keyword arguments), its outcome reported (`report_of(result)`: the report's body; by
    default success with the result as JSON). The rules of exactly once, for `require_approval` and the adapters
    whose frameworks run the tool themselves.

    Raises `Rejected`, `Expired` or `Cancelled` when it was not approved (nothing runs); `ActionFailed` or
    `OutcomeUnknown` when an earlier run took the go and failed, or never reported (it is not run again); what
    `function` raised, once its failure is reported (but `unreported` exceptions, after which the action may have
    half happened, go through unreported: the receipt stays "outcome unknown"); `ReportFailed` when the result
    could not be reported. `check(arguments)` may refuse the approved arguments before the go is taken."""
    if request.execution.status is not ExecutionStatus.NOT_STARTED:
        return Outcome(_recorded_outcome(request), "recorded")
    arguments = _approved_arguments(request)
    if check is not None:
        # Checked before consuming: arguments the function cannot take must not use up the go.
        check(arguments)
    digest = arguments_digest(arguments)

    try:
        # One nonce for this consume, made here and reused by its retries: a go whose answer was lost is given
        # again to it; a re-run of the call (another process, after a crash) makes its own and is refused.
        go = yield from _protocol.consume(request.id, digest, policy)
    except AlreadyConsumed as exc:
        execution = exc.execution or (yield from _protocol.get(request.id, 0, policy)).execution
        return Outcome(_recorded_outcome(dataclasses.replace(request, execution=execution)), "recorded")
    except NotApproved:
        # Decided otherwise since we read it (expired, cancelled): say how, rather than "not approved".
        _raise_unless_approved((yield from _protocol.get(request.id, 0, policy)))
        raise
    if go.shadow:
        # A shadow card: the console recorded the effect as shadow and a person does it by hand. Never run here.
        return Outcome(_shadow_result(request), "shadow")
    if go.arguments is None or arguments_digest(go.arguments) != digest:
        # The go is ours but for other arguments than the approved ones we hashed: refuse to run them, and say
        # so on the receipt (the action did not happen).
        error = f"The client did not run it: the go's arguments are not the approved ones ({digest})."
        yield from _protocol.report(request.id, result_body(False, error=error), policy)
        raise UnexpectedResponse(error, go.arguments)

    try:
        result = yield Call(function, go.arguments)
    except unreported:
        raise
    except Exception as exc:
        # It ran and failed: that is its outcome, recorded so that a re-run does not try again.
        try:
            error = repr(exc)[:_MAX_ERROR]
            yield from _protocol.report(request.id, result_body(False, error=error), policy)
        except HitlError:
            logger.exception("The failure of %s (request %s) could not be reported.", request.action, request.id)
        raise
    # Anything else (KeyboardInterrupt, SystemExit, a cancelled task) went through unreported on purpose: the
    # action may have half-happened, so the receipt stays "consumed, outcome unknown" for a person to check.
    try:
        yield from _protocol.report(request.id, report_of(result), policy)
    except HitlError as exc:
        raise ReportFailed(request, result) from exc
    return Outcome(result, "ran")


def run_compensations(
    client: Client, handlers: Mapping[str, Callable[..., Any]], run_id: str | None = None
) -> dict[str, Outcome]:
    """Runs the compensations a person approved for this agent (`client.pending_compensations(run_id)`: its runs
    being undone), in undo order, each through the same consume as any approved request (`run_approved`: the one
    go for the approved arguments' digest, the handler called once with them as keyword arguments, its outcome
    reported). `handlers` maps a compensation's action to the function that runs it. Returns each request's
    outcome by its id. Refuses (ValueError, nothing consumed) when an action has no handler; stops at the first
    handler that raises (its failure reported: the run waits for a person, and its later compensations with it)."""
    for action, handler in handlers.items():
        if inspect.iscoroutinefunction(handler):
            raise TypeError(f"The handler of {action} is a coroutine function: use run_compensations_async.")
    return client._run(_compensations(handlers, client._policy, run_id))


async def run_compensations_async(
    client: AsyncClient, handlers: Mapping[str, Callable[..., Any]], run_id: str | None = None
) -> dict[str, Outcome]:
    """`run_compensations` for an `AsyncClient` (handlers may be coroutine functions)."""
    return await client._run(_compensations(handlers, client._policy, run_id))


def _compensations(
    handlers: Mapping[str, Callable[..., Any]], policy: RetryPolicy, run_id: str | None
) -> Flow[dict[str, Outcome]]:
    pending = yield from _protocol.pending_compensations(run_id, policy)
    missing = sorted({request.action for request in pending} - set(handlers))
    if missing:
        raise ValueError(f"No handler for the compensations {', '.join(missing)}: nothing was run.")
    outcomes: dict[str, Outcome] = {}
    for request in pending:
        outcomes[request.id] = yield from run_approved(request, handlers[request.action], policy)
    return outcomes


def _recorded_outcome(request: ApprovalRequest) -> Any:
    execution = request.execution
    if execution.status is ExecutionStatus.SUCCEEDED:
        return _shadow_result(request) if request.shadow else execution.result
    if execution.status is ExecutionStatus.FAILED:
        raise ActionFailed(request)
    raise OutcomeUnknown(request)


def _shadow_result(request: ApprovalRequest) -> dict[str, Any]:
    """What a call on a shadow card returns in place of the function's result (it was not called): the same on
    every re-run, built from the request alone."""
    return {"shadow": True, "request_id": request.id, "action": request.action, "arguments": request.arguments}


def _raise_unless_approved(request: ApprovalRequest) -> None:
    if request.status is RequestStatus.REJECTED:
        raise Rejected(request)
    if request.status is RequestStatus.EXPIRED:
        raise Expired(request)
    if request.status is RequestStatus.CANCELLED:
        raise Cancelled(request)


def _approved_arguments(request: ApprovalRequest) -> dict[str, Any]:
    _raise_unless_approved(request)
    if request.arguments is None:
        raise UnexpectedResponse(f"Request {request.id} is approved but has no arguments to execute.")
    return request.arguments


def _keyword_signature(function: Callable[..., Any]) -> inspect.Signature:
    signature = inspect.signature(function)
    for parameter in signature.parameters.values():
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            raise TypeError(
                f"require_approval calls {function.__name__} with keyword arguments (the approved ones, by name): "
                f"its parameter {parameter} cannot be given by name."
            )
    return signature


def _schema_from_hints(function: Callable[..., Any]) -> dict[str, Any] | None:
    try:
        import pydantic  # noqa: PLC0415 - optional: the client works without it
    except ImportError:
        return None
    try:
        # TypeAdapter reads a function's parameters (its typing only names type forms).
        return pydantic.TypeAdapter(cast(Any, function)).json_schema()
    except Exception:  # hints pydantic cannot describe: no schema, so reviewers may not edit
        logger.warning("No JSON Schema could be derived from %s's type hints; pass schema=.", function.__name__)
        return None


def _as_json(result: Any) -> Any:
    """The function's result as the receipt records it: JSON as is; a pydantic model or a dataclass as its
    JSON; anything else as its repr() (the action happened, so an unreadable result must not lose that)."""

    def fallback(value: Any) -> Any:
        if hasattr(value, "model_dump"):
            return value.model_dump(mode="json")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.asdict(value)
        raise TypeError(type(value).__name__)

    try:
        return json.loads(json.dumps(result, default=fallback, allow_nan=False))
    except (TypeError, ValueError):
        return repr(result)
