"""The workflow definition API: a workflow is Python code, registered by name and version, whose steps are
plain functions of a `Context`. See docs/workflows.md for a worked example (the `refund` demo)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django.db import transaction
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from runs import gates
from runs.gates import ApprovalRequest, Decision

if TYPE_CHECKING:
    from runs.agent import AgentSpec, Tool
    from runs.models import Run


# Errors a step may raise. Anything else is treated as Retryable (bounded), because an unknown error from a
# model or a network library is more often transient than not.
class Retryable(Exception):
    """Transport errors, 429/5xx, timeouts: retried with exponential backoff and jitter."""


class Fatal(Exception):
    """Validation, 4xx, refusals: never retried; the run goes to the dead-letter queue."""


class Ambiguous(Exception):
    """A write that may or may not have happened: never retried blindly."""


class Wait(Exception):
    """The step cannot run yet and was not attempted (an external system's circuit breaker is open, the
    tenant is over its token rate): the engine gives the run back to the queue for `delay` seconds, without
    counting an attempt or recording a failure (runs.breakers.BreakerOpen, runs.ratelimit.Throttled)."""

    def __init__(self, reason: str, delay: float):
        super().__init__(reason)
        self.reason = reason
        self.delay = delay


class Stop(Exception):
    """Raised inside a step to end the run as cancelled with `result` (a person stopped it from a budget card)."""

    def __init__(self, result: dict):
        super().__init__(result.get("outcome", "stopped"))
        self.result = result


class Park(Exception):
    """Raised inside a step to park the run: for a person's decision (with `request`) or a kill switch (with
    `kill_switch_channel`, the channel whose effect it stopped)."""

    def __init__(
        self,
        reason: str,
        request: ApprovalRequest | None = None,
        paused: bool = False,
        kill_switch_channel: str | None = None,
    ):
        super().__init__(reason)
        self.reason = reason
        self.request = request
        self.paused = paused
        self.kill_switch_channel = kill_switch_channel


StepFn = Callable[["Context"], Any]


class InvalidInput(ValueError):
    """A run's input (or an edit of a proposal) that its schema refuses: `errors` is a list of {loc, msg}."""

    def __init__(self, errors: list[dict]):
        super().__init__("; ".join(f"{e['loc']}: {e['msg']}" for e in errors))
        self.errors = errors


def schema_errors(schema: type[BaseModel], value: Any, prefix: str = "") -> list[dict]:
    """The field errors of `value` against a pydantic model, each {loc: "a.b", msg}; [] when it is valid."""
    try:
        schema.model_validate(value)
    except PydanticValidationError as exc:
        return [
            {"loc": ".".join(str(part) for part in (prefix, *error["loc"]) if part != ""), "msg": error["msg"]}
            for error in exc.errors(include_url=False, include_context=False, include_input=False)
        ]
    return []


@dataclass(frozen=True)
class Display:
    """How a gate's card shows its proposal: paths into it (dotted) for the headline and the amount column."""

    headline: str | None = None
    amount_minor: str | None = None  # an amount in minor units (cents)
    currency: str | None = None

    def values(self, proposed: Any) -> dict:
        return {
            "headline": str(leaf(proposed, self.headline) or "")[:300],
            "amount_minor": _int_or_none(leaf(proposed, self.amount_minor)),
            "currency": str(leaf(proposed, self.currency) or "")[:3],
        }


ANY_LEAF = ("*",)  # GateSpec.editable: a person may change any leaf (keeping the proposal's schema)


@dataclass(frozen=True)
class GateSpec:
    """What a person may do with a gate's proposal: its schema, the leaves they may edit (dotted paths), a check
    of an edit against the proposal (bounds such as "no more than proposed"), and display hints. One validator,
    `edit_errors`, serves the card form, the API and bulk decisions (approvals.models.Approval.decide)."""

    proposal: type[BaseModel] | None = None
    editable: tuple[str, ...] = ()
    check_edit: Callable[[dict, dict], list[dict]] | None = None
    display: Display = field(default_factory=Display)

    def edit_errors(self, proposed: dict, edited: Any) -> list[dict]:
        if not isinstance(edited, dict):
            return [{"loc": "payload", "msg": "must be an object"}]
        if self.proposal is None and not self.editable:  # declares nothing: any value, the proposal's shape
            errors = shape_errors(proposed, edited)
        elif self.editable == ANY_LEAF:  # any value, but no leaf the proposal does not have
            errors = [
                {"loc": p, "msg": "is not part of the proposal"}
                for p in sorted(set(leaves(edited)) - set(leaves(proposed)))
            ]
        else:
            errors = [
                {"loc": path, "msg": "may not be changed"}
                for path in sorted(set(leaves(proposed)) | set(leaves(edited)))
                if path not in self.editable and leaf(proposed, path, _MISSING) != leaf(edited, path, _MISSING)
            ]
        if self.proposal is not None:
            errors += schema_errors(self.proposal, edited)
        if not errors and self.check_edit is not None:
            errors += self.check_edit(proposed, edited)
        return errors


_MISSING = object()


def shape_errors(proposed: Any, edited: Any, path: str = "") -> list[dict]:
    """Where `edited` does not keep the shape of `proposed`: a missing or added key, or a value of another type."""
    if isinstance(proposed, dict):
        if not isinstance(edited, dict):
            return [{"loc": path or "payload", "msg": "must be an object"}]
        errors = []
        for key in edited.keys() - proposed.keys():
            errors.append({"loc": f"{path}.{key}" if path else str(key), "msg": "is not part of the proposal"})
        for key, value in proposed.items():
            child = f"{path}.{key}" if path else str(key)
            if key not in edited:
                errors.append({"loc": child, "msg": "is required"})
            else:
                errors += shape_errors(value, edited[key], child)
        return errors
    if proposed is None:
        return []
    expected = type(proposed)
    if expected is float and type(edited) is int:
        return []  # 10 for 10.0 is the same number
    if type(edited) is not expected:
        names = {bool: "true or false", int: "a whole number", float: "a number", str: "text", list: "a list"}
        return [{"loc": path or "payload", "msg": f"must be {names.get(expected, expected.__name__)}"}]
    return []


def check_decided_edit(step: StepDef, proposed: Any, decision: Decision) -> None:
    """Defence in depth, before a step acts on a decision: an edit must still fit the step's gate (its
    GateSpec, else the proposal's shape). Approval.decide checked it already; this catches a card decided by
    other means (written into the database, or by a console that checked it against another deployment).
    Raises Fatal, so the run goes to the dead-letter queue with the reason and nothing is executed."""
    if decision.decision != "edited":
        return
    if proposed is None:
        raise Fatal(f"the edit decided on {step.name} cannot be checked (the proposal is unknown): not executed")
    if errors := (step.gate or GateSpec()).edit_errors(proposed, decision.payload):
        text = "; ".join(f"{e['loc']} {e['msg']}" for e in errors)
        raise Fatal(f"the edit decided on {step.name} does not fit its gate ({text}): not executed")


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a JSON object by dotted path (a non-empty object is not a leaf; lists are)."""
    if not isinstance(value, dict) or (not value and prefix):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(leaves(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def leaf(value: Any, path: str | None, default: Any = None) -> Any:
    if not path:
        return default
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63 else None


@dataclass(frozen=True)
class StepDef:
    name: str
    kind: str  # compute | read | effect | gate | agent (a stage of steps: runs.agent)
    fn: StepFn
    channel: str | None = None
    gate: GateSpec | None = None
    agent: AgentSpec | None = None
    versions: dict | None = None  # recorded on the step (prompt_version, tools_version) and part of its input


@dataclass
class Workflow:
    """Ordered steps, declared with the decorators below in the order they run.

    `on_reject`: how a rejected gate ends the run, "succeed" (default: the run succeeded, its result says it
    was rejected) or "fail".
    """

    name: str
    version: int = 1
    on_reject: str = "succeed"
    description: str = ""
    input_schema: type[BaseModel] | None = None
    steps: list[StepDef] = field(default_factory=list)

    def validate_input(self, value: Any) -> None:
        """Raises InvalidInput with the field errors when the input does not fit the workflow's schema."""
        if self.input_schema is not None and (errors := schema_errors(self.input_schema, value, "input")):
            raise InvalidInput(errors)

    def _add(self, kind: str, channel: str | None = None, name: str | None = None, gate: GateSpec | None = None):
        def decorator(fn: StepFn) -> StepFn:
            step_name = name or fn.__name__
            if any(s.name == step_name for s in self.steps):
                raise ValueError(f"{self.name}: two steps are named {step_name!r}")
            self.steps.append(StepDef(step_name, kind, fn, channel, gate))
            return fn

        return decorator

    def compute(self, fn: StepFn | None = None, *, name: str | None = None):
        """A model call or any computation: its output is recorded and replayed, never recomputed."""
        return self._add("compute", name=name)(fn) if fn else self._add("compute", name=name)

    def read(self, fn: StepFn | None = None, *, name: str | None = None):
        """A tool read (no side effect): retried freely."""
        return self._add("read", name=name)(fn) if fn else self._add("read", name=name)

    def effect(self, channel: str, *, name: str | None = None):
        """A side effect on `channel`: the step must go through `ctx.effect(...)`."""
        return self._add("effect", channel=channel, name=name)

    def gate(
        self,
        channel: str,
        *,
        name: str | None = None,
        proposal: type[BaseModel] | None = None,
        editable: tuple[str, ...] = (),
        check_edit: Callable[[dict, dict], list[dict]] | None = None,
        display: Display | None = None,
    ):
        """A person's sign-off on `channel`: the step returns `ctx.gate(...)` (or decides by itself).

        `proposal` (a pydantic model) is the shape of what the gate proposes; `editable` the dotted paths of the
        leaves a person may change (nothing else may change); `check_edit(proposed, edited)` returns further
        errors ({loc, msg}) such as bounds relative to the proposal; `display` the card's headline and amount."""
        spec = GateSpec(proposal, tuple(editable), check_edit, display or Display())
        return self._add("gate", channel=channel, name=name, gate=spec)

    def agent(
        self,
        *,
        tools: list[Tool],
        max_turns: int = 10,
        prompt_version: str = "1",
        name: str | None = None,
    ):
        """A tool-calling loop (runs.agent): the decorated `fn(ctx)` returns the conversation's opening (a list
        of chat messages, or the user's message as text). Each model turn and each tool call is a checkpointed
        step; the stage's output (`outputs[name]`) is `{"answer", "turns"}`. `prompt_version` names the prompt
        the function writes (recorded on each step, with a hash of the tools' schemas)."""
        from runs.agent import AgentSpec, check_tools

        spec = AgentSpec(tools=check_tools(tools), max_turns=max_turns, prompt_version=prompt_version)

        def decorator(fn: StepFn) -> StepFn:
            step_name = name or fn.__name__
            if any(s.name == step_name for s in self.steps):
                raise ValueError(f"{self.name}: two steps are named {step_name!r}")
            self.steps.append(StepDef(step_name, "agent", fn, agent=spec))
            return fn

        return decorator

    def step_at(self, seq: int, outputs: dict) -> StepDef | None:
        """The step at position `seq` of a run whose done steps' outputs are `outputs`, None past the last. A
        fixed step has its declared place; an agent stage's steps are read from what its turns recorded."""
        from runs.agent import expand

        pos = 0
        for stage in self.steps:
            if stage.kind != "agent":
                if pos == seq:
                    return stage
                pos += 1
                continue
            found, pos = expand(stage, pos, seq, outputs)
            if found is not None:
                return found
        return None

    def result(self, outputs: dict) -> Any:
        """A finished run's result: the output of its last step (an agent stage's answer)."""
        return outputs.get(self.steps[-1].name) if self.steps else None

    def step_of(self, run: Run, seq: int) -> StepDef | None:
        """The step at `seq` of `run`, from the run's recorded outputs (approval cards look up their gate)."""
        from runs.models import Step

        if all(s.kind != "agent" for s in self.steps):
            return self.steps[seq] if seq < len(self.steps) else None
        done = Step.objects.filter(run=run, seq__lt=seq, status=Step.Status.DONE).order_by("seq")
        try:
            return self.step_at(seq, dict(done.values_list("name", "output")))
        except (KeyError, AttributeError, TypeError):
            return None


class UnknownWorkflow(LookupError):
    pass


_registry: dict[str, dict[int, Workflow]] = {}


def register(workflow: Workflow) -> Workflow:
    versions = _registry.setdefault(workflow.name, {})
    if workflow.version in versions and versions[workflow.version] is not workflow:
        raise ValueError(f"workflow {workflow.name} v{workflow.version} is registered twice")
    versions[workflow.version] = workflow
    return workflow


def get(name: str, version: int | None = None) -> Workflow:
    """The workflow `name` at `version` (the latest when None)."""
    versions = _registry.get(name)
    if not versions:
        raise UnknownWorkflow(f"unknown workflow {name!r}; known: {', '.join(sorted(_registry)) or 'none'}")
    if version is None:
        return versions[max(versions)]
    if version not in versions:
        raise UnknownWorkflow(
            f"workflow {name!r} has no version {version} in this deployment (it has "
            f"{', '.join(map(str, sorted(versions)))}); the run is kept and can be requeued once it is deployed"
        )
    return versions[version]


def names() -> list[str]:
    return sorted(_registry)


@dataclass
class Usage:
    """The tokens and cost a step's attempt used. Bound to its run and step by the step's Context, each `add`
    (one model call) is also counted at once against the run's cost limit and the tenant's token rate
    (runs.models.ModelUsage), so an attempt that fails or is lost before its checkpoint still counts."""

    tokens_in: int = 0
    tokens_out: int = 0
    cost: Decimal = Decimal(0)
    counted_for: tuple | None = None  # (run, step name)

    def add(self, tokens_in: int, tokens_out: int, cost: Decimal) -> None:
        self.tokens_in += tokens_in
        self.tokens_out += tokens_out
        self.cost += cost
        if self.counted_for is not None and (tokens_in or tokens_out or cost):
            from runs.models import ModelUsage

            ModelUsage.record(*self.counted_for, tokens_in, tokens_out, cost)


class Context:
    """What a step sees: the run input, earlier steps' outputs, the model and tools, effects and gates."""

    def __init__(self, run: Run, step: StepDef, seq: int, outputs: dict[str, Any], model, tools):
        self.run = run
        self.step = step
        self.seq = seq
        self.input: dict = run.input
        self.outputs = outputs
        self.model = model
        self.tools = tools
        self.usage: Usage = getattr(model, "usage", None) or Usage()
        self.usage.counted_for = (run, step.name)
        self.last_effect_key: str | None = None
        self._effects = 0

    def effect(
        self,
        call: Callable[[str], dict],
        *,
        key: str | None = None,
        lookup: Callable[[str], dict | None] | None = None,
        action: str | None = None,
        preview: dict | None = None,
    ) -> dict:
        """Do a side effect on this step's channel at most once.

        `call(idempotency_key)` performs it and returns the external system's answer (a dict, with `id` when
        it has one). The receipt is written first; a done receipt makes this a no-op that returns the stored
        answer. A pending receipt means an earlier attempt may have written: `lookup(key)` is asked when the
        tool has one, otherwise the run parks for a person to reconcile.

        In shadow mode `call` is never made: the effect is recorded as a ShadowEffect with `preview` (what the
        call would send, for the person who does it by hand) and answers `{"shadow": True, "id":
        "shadow:<key>"}`, so the run goes on. The mode is decided once per effect: the card that authorized it
        (the run's latest decided action card on this channel, at this step or before) says it; without one,
        the channel and workflow do (console.models.Channel.in_shadow) when the effect's receipt is first
        written. Kill switches apply as to any effect.
        """
        from runs import breakers
        from runs.models import Receipt

        channel = self.step.channel
        self._effects += 1
        # The n-th effect of a step gets its own default key, so two effects of one step are two writes.
        key = key or f"{self.run.id}:{self.seq}:{action or self.step.name}" + (
            f"#{self._effects}" if self._effects > 1 else ""
        )
        self.last_effect_key = key
        breakers.check(channel)  # an open breaker: the run waits, before any receipt is written (BreakerOpen)
        receipt = _open_receipt(self.run, self.seq, channel, key, step=self.step.name, preview=preview)
        if receipt.status == Receipt.Status.DONE:
            return receipt.response
        if receipt.shadow:
            # Recorded with the receipt, never sent: nothing can be ambiguous, so a pending shadow receipt (its
            # first attempt stopped here) is completed without asking anyone.
            return receipt.complete(shadow_response(key))
        if not receipt.fresh:
            found = lookup(key) if lookup else self._reconciled_by_a_person(receipt)
            if found is not None:
                return receipt.complete(found, reconciled=True)
            # The lookup is authoritative: the write did not happen, so it is safe to do it now.
        try:
            response = call(key)
        except Fatal:
            receipt.discard()  # the tool says the call was refused, so not applied
            raise
        except Wait:
            # The tool's breaker refused the call before making it (runs.breakers.guard): nothing was sent. A
            # receipt written for this attempt goes; an earlier attempt's pending one stays to be reconciled.
            if receipt.fresh:
                receipt.discard()
            raise
        except Retryable:
            # A 5xx or a timeout the tool calls retryable may still have been applied. With a lookup, the
            # receipt stays pending and the next attempt asks before calling again; without one, the tool's
            # word that it was not applied is all there is.
            if lookup is None:
                receipt.discard()
            raise
        except Exception as exc:  # noqa: BLE001 - whatever else happened, the write may have been applied
            raise Ambiguous(f"{channel} call {key} ended with {exc.__class__.__name__}: {exc}") from exc
        return receipt.complete(response)

    def _reconciled_by_a_person(self, receipt) -> dict | None:
        request = ApprovalRequest(
            channel=receipt.channel,
            kind=gates.Kind.RECONCILE,
            proposed={"receipt": receipt.key, "receipt_created_at": receipt.created_at.isoformat()},
            summary=(
                f"An earlier attempt of '{self.step.name}' may have reached {receipt.channel} (the worker "
                f"stopped between the call and its receipt). Approve if it happened; reject if it did not, "
                f"and it will be done now."
            ),
            rule_id="ambiguous-write",
            risk="high",
        )
        decision = gates.backend().decision(self.run, self.seq, request)
        if decision is None:
            raise Park(f"did this {receipt.channel} write happen? ({receipt.key})", request)
        if decision.rejected:
            # It did not happen: write it now, as a new attempt of the same receipt, so that if this attempt
            # is interrupted too, the question is asked again (the card binds to the attempt's start).
            receipt.rearm()
            return None
        return {"reconciled_by": decision.by, "comment": decision.comment}

    def gate(self, request: ApprovalRequest | None = None, **fields) -> dict:
        """Ask a person. Returns the decision (`decision`, `payload` to act on, `comment`, `reason`, `by`)
        once it is taken; until then the run parks in `waiting_human`."""
        if request is None:
            request = ApprovalRequest(channel=self.step.channel, **fields)
        decision: Decision | None = gates.backend().decision(self.run, self.seq, request)
        if decision is None:
            raise Park(f"waiting for a decision on {request.channel}", request)
        check_decided_edit(self.step, request.proposed, decision)
        return decision.as_output()


def _open_receipt(run: Run, seq: int, channel: str, key: str, *, step: str = "", preview: dict | None = None):
    """Insert the receipt (or find the one an earlier attempt wrote), checking the run's owner, a cancel and the
    channel's kill switch in the same transaction: an engaged switch that has committed stops every effect not
    already past here. `receipt.shadow`: the effect is in shadow mode (a ShadowEffect is written with a new
    receipt when the workflow or channel is in shadow; an earlier attempt's pending receipt keeps its mode)."""
    from core.models import Channel
    from runs.models import Receipt, ShadowEffect

    if _inside_a_transaction():
        raise Fatal(
            f"ctx.effect() on {channel} was called inside transaction.atomic(): its receipt must commit before "
            "the call, so call it outside any transaction"
        )
    with transaction.atomic():
        if run.owned():
            # A cancel committed while the step ran (the row lock orders it before this receipt, or after it):
            # the effect does not start, and the run ends cancelled.
            raise Stop({"outcome": "cancelled"})
        if (killed := Channel.killed_for_effects(channel)) is not None:
            raise Park(killed.describe(channel), paused=True, kill_switch_channel=channel)
        receipt, created = Receipt.objects.get_or_create(
            key=key, defaults={"run": run, "step_seq": seq, "channel": channel}
        )
        if created:
            # Decided once per effect: as the card that authorized it was (a person who did it by hand must not
            # see it done again, nor an approved live effect be dropped, because the mode changed since), else
            # as the channel and workflow are now, recorded with the receipt for its later attempts.
            authorized = gates.backend().shadow_of(run, seq, channel)
            receipt.shadow = Channel.in_shadow(channel, run.workflow) if authorized is None else authorized
            if receipt.shadow:
                ShadowEffect.objects.create(run=run, step_seq=seq, step=step, channel=channel, key=key, preview=preview)
        else:
            receipt.shadow = receipt.status == Receipt.Status.PENDING and ShadowEffect.objects.filter(key=key).exists()
    receipt.run = run  # the owner's copy: its writes name this owner
    receipt.fresh = created
    return receipt


def shadow_response(key: str) -> dict:
    """What a shadow effect answers in place of its external system (the receipt keeps it as its response)."""
    external_id = f"shadow:{key}"
    if len(external_id) > 200:  # Receipt.external_id; a natural key may be longer
        external_id = f"shadow:{gates.canonical_hash(key)[:40]}"
    return {"shadow": True, "id": external_id}


def _inside_a_transaction() -> bool:
    # The test suite wraps each test in transactions of its own (marked by Django's TestCase): those aside.
    connection = transaction.get_connection()
    return any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)
