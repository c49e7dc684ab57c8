"""The workflow definition API: a workflow is Python code, registered by name and version, whose steps are
plain functions of a `Context`. See docs/workflows.md for a worked example (the `refund` demo).

What an author needs is importable from here: the workflow and its registry, the step context, the errors a step
raises (runs.errors), gate and display declarations (runs.gates), tools (runs.tools)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from runs import personal
from runs.agent import expand
from runs.errors import Ambiguous, Fatal, InvalidInput, Park, Retryable, Stop, UnknownWorkflow, Wait
from runs.gates import ANY_LEAF, ApprovalRequest, Decision, Display, GateSpec, schema_errors
from runs.models import Run, Step
from runs.personal import Pii
from runs.steps import Compensation, Context, StepDef, StepFn, Usage, check_decided_edit, no_compensation
from runs.tools import AgentSpec, Tool, check_tools, tool

__all__ = [
    "ANY_LEAF",
    "Ambiguous",
    "ApprovalRequest",
    "Compensation",
    "Context",
    "Decision",
    "Display",
    "Fatal",
    "GateSpec",
    "InvalidInput",
    "Park",
    "Pii",
    "Retryable",
    "StepDef",
    "Stop",
    "Tool",
    "UnknownWorkflow",
    "Usage",
    "Wait",
    "Workflow",
    "check_decided_edit",
    "get",
    "names",
    "register",
    "tool",
]


@dataclass
class Workflow:
    """Ordered steps, declared with the decorators below in the order they run.

    `on_reject`: how a rejected gate ends the run, "succeed" (default: the run succeeded, its result says it
    was rejected) or "fail".
    `undo`: what a failure for good does to a run with effects to undo (runs.compensations): "ask" (default: a
    person says whether to undo them), "always" (undone at once; a budget card's stop undoes too) or "never".
    """

    name: str
    version: int = 1
    on_reject: str = "succeed"
    description: str = ""
    input_schema: type[BaseModel] | None = None
    steps: list[StepDef] = field(default_factory=list)
    undo: str = "ask"
    # Version shims (`compatible`): (step or agent stage, the recorded versions its current code replays).
    shims: list[tuple[str, dict]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.undo not in ("ask", "always", "never"):
            raise ValueError(f"{self.name}: undo must be 'ask', 'always' or 'never', not {self.undo!r}")

    def validate_input(self, value: Any) -> None:
        """Raises InvalidInput with the field errors when the input does not fit the workflow's schema."""
        if self.input_schema is not None and (errors := schema_errors(self.input_schema, value, "input")):
            raise InvalidInput(errors)

    def input_json_schema(self) -> dict | None:
        """The input's JSON Schema as the vault reads it (its `x-pii` marks and `x-pii-subject`), None without a
        schema. Made once per input model: submission reads it for every run."""
        if self.input_schema is None:
            return None
        cached = self.__dict__.get("_pii_schema")
        if cached is None or cached[0] is not self.input_schema:
            cached = (self.input_schema, self.input_schema.model_json_schema())
            self.__dict__["_pii_schema"] = cached
        return cached[1]

    def seal_input(self, value: Any, run_id) -> Any:
        """A new run's input, its personal fields sealed under `run_id` (runs.personal); pii.Erased for an erased
        subject's."""
        if not self.seals_input():
            return value
        return personal.seal_input(value, self.input_json_schema(), run_id)

    def seals_input(self) -> bool:
        """Whether its input has personal fields to seal (its schema marks some). Read once per input schema:
        walking the schema was 4 % of `POST /api/runs`'s CPU (docs/PROFILE-api.md)."""
        schema = self.input_json_schema()
        cached = self.__dict__.get("_seals_input")
        if cached is None or cached[0] is not schema:
            cached = (schema, bool(personal.marks(schema)))
            self.__dict__["_seals_input"] = cached
        return cached[1]

    def personal_data(self) -> list[str]:
        """Where the workflow marks personal data (its input's fields, its reads' and tools' declared fields, its
        gates' proposals); SchemaError for a schema that marks some and names no subject."""
        found = [f"input.{path}" for path in personal.marks(self.input_json_schema())]
        for step in self.steps:
            if step.pii is not None:
                found += [f"{step.name}.{path}" for path in step.pii.fields]
            if step.gate is not None and step.gate.proposal is not None:
                found += [f"{step.name}.{p}" for p in personal.marks(step.gate.proposal.model_json_schema())]
            for t in step.agent.tools.values() if step.agent is not None else ():
                found += [f"{step.name}.{t.name}.{path}" for path in (t.pii.fields if t.pii else ())]
                if t.kind == "effect" or t.approval != "never":
                    found += [f"{step.name}.{t.name}.{p}" for p in personal.marks(t.args.model_json_schema())]
        return found

    def _add(
        self,
        kind: str,
        channel: str | None = None,
        name: str | None = None,
        gate: GateSpec | None = None,
        compensate: Compensation | Callable | None = None,
        pii: Pii | None = None,
    ):
        if kind != "effect":
            no_compensation(kind, f"{self.name}.{name or 'step'}", compensate)
        compensation = Compensation.of(compensate, f"{self.name}.{name or 'step'}")

        def decorator(fn: StepFn) -> StepFn:
            step_name = name or fn.__name__
            if any(s.name == step_name for s in self.steps):
                raise ValueError(f"{self.name}: two steps are named {step_name!r}")
            self.steps.append(StepDef(step_name, kind, fn, channel, gate, compensation=compensation, pii=pii))
            return fn

        return decorator

    def compute(self, fn: StepFn | None = None, *, name: str | None = None, compensate=None):
        """A model call or any computation: its output is recorded and replayed, never recomputed. (`compensate`
        is refused: there is nothing to undo.)"""
        add = self._add("compute", name=name, compensate=compensate)
        return add(fn) if fn else add

    def read(self, fn: StepFn | None = None, *, name: str | None = None, compensate=None, pii: Pii | None = None):
        """A tool read (no side effect): retried freely. (`compensate` is refused: there is nothing to undo.)
        `pii`: the personal fields of what it returns (runs.personal.Pii), sealed before its checkpoint: later
        steps and the model see their references; `ctx.pii` opens them for an effect."""
        if pii is not None and not isinstance(pii, Pii):
            raise ValueError(f"{self.name}.{name or 'step'}: pii= takes a runs.personal.Pii")
        add = self._add("read", name=name, compensate=compensate, pii=pii)
        return add(fn) if fn else add

    def effect(self, channel: str, *, name: str | None = None, compensate: Compensation | Callable | None = None):
        """A side effect on `channel`: the step must go through `ctx.effect(...)`. `compensate`: what undoes each
        of its effects (a Compensation, or its call `(ctx, key, answer)`): runs.compensations."""
        return self._add("effect", channel=channel, name=name, compensate=compensate)

    def gate(
        self,
        channel: str,
        *,
        name: str | None = None,
        proposal: type[BaseModel] | None = None,
        editable: tuple[str, ...] = (),
        check_edit: Callable[[dict, dict], list[dict]] | None = None,
        display: Display | None = None,
        policy: str = "",
        compensate=None,
    ):
        """A person's sign-off on `channel`: the step returns `ctx.gate(...)` (or decides by itself).

        `proposal` (a pydantic model) is the shape of what the gate proposes; `editable` the dotted paths of the
        leaves a person may change (nothing else may change); `check_edit(proposed, edited)` returns further
        errors ({loc, msg}) such as bounds relative to the proposal; `display` the card's headline and amount;
        `policy` the name of the approval policy its cards follow (approvals.models.ApprovalPolicy), over the
        channel's."""
        spec = GateSpec(proposal, tuple(editable), check_edit, display or Display(), policy)
        return self._add("gate", channel=channel, name=name, gate=spec, compensate=compensate)

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
        spec = AgentSpec(tools=check_tools(tools), max_turns=max_turns, prompt_version=prompt_version)

        def decorator(fn: StepFn) -> StepFn:
            step_name = name or fn.__name__
            if any(s.name == step_name for s in self.steps):
                raise ValueError(f"{self.name}: two steps are named {step_name!r}")
            self.steps.append(StepDef(step_name, "agent", fn, agent=spec))
            return fn

        return decorator

    def compatible(self, step: str, **versions: str) -> None:
        """A version shim: runs recorded when `step` (a step, or an agent stage and all its steps) ran with
        `versions` (prompt_version=, tools_version=) replay on the current code (runs.replay) as if recorded with
        it. What the changed step asks its model or tools may differ; the recorded answers are fed back, and the
        step must still produce what it recorded. Declare it when a change does not alter what old runs did (a
        reworded prompt the recorded answers still fit), never to hide a change that does."""
        if unknown := set(versions) - {"prompt_version", "tools_version"}:
            raise ValueError(f"{self.name}.compatible: unknown version {', '.join(sorted(unknown))}")
        if not versions:
            raise ValueError(f"{self.name}.compatible: name the recorded versions it covers")
        if not any(s.name == step for s in self.steps):
            raise ValueError(f"{self.name}.compatible: no step or agent stage {step!r}")
        self.shims.append((step, dict(versions)))

    def shimmed(self, step: str, recorded: dict) -> bool:
        """Whether a step recorded with `recorded` versions is declared compatible with its current code."""
        return any(
            (step == name or step.startswith(f"{name}.")) and all(recorded.get(k) == v for k, v in versions.items())
            for name, versions in self.shims
        )

    def step_at(self, seq: int, outputs: dict) -> StepDef | None:
        """The step at position `seq` of a run whose done steps' outputs are `outputs`, None past the last. A
        fixed step has its declared place; an agent stage's steps are read from what its turns recorded."""
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
        if all(s.kind != "agent" for s in self.steps):
            return self.steps[seq] if seq < len(self.steps) else None
        done = Step.objects.filter(run=run, seq__lt=seq, status=Step.Status.DONE).order_by("seq")
        try:
            return self.step_at(seq, dict(done.values_list("name", "output")))
        except (KeyError, AttributeError, TypeError):
            return None


_registry: dict[str, dict[int, Workflow]] = {}


def register(workflow: Workflow) -> Workflow:
    """Register `workflow` (refused with core.pii.SchemaError when a schema of it marks personal data and names
    no `x-pii-subject`: whose key would seal it?)."""
    workflow.personal_data()
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


def every_version() -> list[Workflow]:
    """Every registered workflow, each of its versions."""
    return [definition for name in sorted(_registry) for _, definition in sorted(_registry[name].items())]


def names() -> list[str]:
    return sorted(_registry)
