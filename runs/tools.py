"""Tools and agent stages as a workflow declares them (`@tool`, `Workflow.agent`): a tool's JSON schema from the
function's type hints (or its pydantic argument model), its kind (`read`: retried freely; `effect`: through
`ctx.effect` on a channel, so kill switches, breakers, shadow mode and receipts apply) and its approval policy
(`never`, `always`, or a predicate on the arguments and the run's earlier tool calls). The loop that runs them is
runs.agent. See docs/workflows.md.

A tool's `ctx` is the step's runs.steps.Context, not imported here: the step module declares agent stages with
these specs."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, create_model

from runs.errors import Fatal
from runs.gates import Display, canonical_hash
from runs.personal import Pii

ALWAYS, NEVER = "always", "never"


@dataclass(frozen=True)
class Tool:
    """A function the model may call. `fn(ctx, args)` with the validated argument model when the function takes
    one, else `fn(ctx, **arguments)`. `current(ctx, args)`: the target's state now, shown beside the proposal on
    an approval card."""

    name: str
    description: str
    fn: Callable[..., Any]
    args: type[BaseModel]
    kind: str = "read"  # read | effect
    channel: str | None = None
    # `always`, `never`, or a predicate: `approval(args)`, or `approval(args, history)` with what the run already
    # did (its earlier tool calls, `history`), so that a policy can count (three refunds of 19.99 are 59.97).
    approval: str | Callable[..., bool] = NEVER
    current: Callable[..., dict] | None = None  # (ctx, args)
    display: Display = field(default_factory=Display)
    risk: str = "medium"
    takes_model: bool = False
    compensation: Any = None  # an effect's undo (runs.steps.Compensation: runs.compensations)
    pii: Pii | None = None  # a read's personal fields, sealed before the model sees its result (runs.personal)

    def schema(self) -> dict:
        """The OpenAI function-tool declaration."""
        parameters = self.args.model_json_schema()
        parameters.pop("title", None)
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }

    def needs_approval(self, args: BaseModel, history: list[dict]) -> bool:
        if self.approval == ALWAYS:
            return True
        if self.approval == NEVER:
            return False
        if _arity(self.approval) >= 2:
            return bool(self.approval(args, history))
        return bool(self.approval(args))

    def call(self, ctx, args: BaseModel) -> Any:
        return self.fn(ctx, args) if self.takes_model else self.fn(ctx, **args.model_dump())


def _arity(fn: Callable) -> int:
    """How many positional arguments `fn` takes."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def history(stage: str, outputs: dict) -> list[dict]:
    """The tool calls an agent stage has made so far, in order, as recorded: each {tool, call_id, arguments, and
    result (executed), rejected (by a person), skipped or error (not executed)}. What an approval policy sees."""
    prefix = f"{stage}.turn"
    return [
        output
        for name, output in outputs.items()
        if name.startswith(prefix) and isinstance(output, dict) and "tool" in output and "call_id" in output
    ]


def tool(
    fn: Callable | None = None,
    *,
    kind: str = "read",
    channel: str | None = None,
    approval: str | Callable[..., bool] = NEVER,
    current: Callable | None = None,
    display: Display | None = None,
    name: str | None = None,
    description: str | None = None,
    risk: str = "medium",
    compensate: Any = None,
    pii: Pii | None = None,
):
    """Declare a tool. Its arguments are the function's parameters after `ctx`, with type hints (or a single
    pydantic model parameter); its description is the docstring. `compensate` (an effect's only): what undoes
    it, a runs.steps.Compensation or its call `(ctx, key, answer)` (runs.compensations). `pii` (a read's only): the
    personal fields of what it returns (runs.personal.Pii), sealed before the model sees them."""

    def decorator(fn: Callable) -> Tool:
        if kind not in ("read", "effect"):
            raise ValueError(f"tool {fn.__name__}: kind must be 'read' or 'effect', not {kind!r}")
        if compensate is not None and kind != "effect":
            raise ValueError(f"tool {fn.__name__}: a read tool has no side effect to undo; compensate= is for effects")
        if pii is not None and (kind != "read" or not isinstance(pii, Pii)):
            raise ValueError(f"tool {fn.__name__}: pii= takes a runs.personal.Pii, on a read tool")
        if (kind == "effect" or approval != NEVER) and not channel:
            raise ValueError(f"tool {fn.__name__}: an effect or an approval needs a channel")
        if isinstance(approval, str) and approval not in (ALWAYS, NEVER):
            raise ValueError(f"tool {fn.__name__}: approval is 'always', 'never' or a predicate")
        if callable(approval) and _arity(approval) not in (1, 2):
            raise ValueError(f"tool {fn.__name__}: an approval predicate takes (args) or (args, history)")
        args, takes_model = _argument_model(fn)
        return Tool(
            name=name or fn.__name__,
            description=description or inspect.getdoc(fn) or "",
            fn=fn,
            args=args,
            kind=kind,
            channel=channel,
            approval=approval,
            current=current,
            display=display or Display(),
            risk=risk,
            takes_model=takes_model,
            compensation=compensate,
            pii=pii,
        )

    return decorator(fn) if fn else decorator


def _argument_model(fn: Callable) -> tuple[type[BaseModel], bool]:
    params = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]  # after ctx
    if len(params) == 1 and isinstance(params[0].annotation, type) and issubclass(params[0].annotation, BaseModel):
        return params[0].annotation, True
    fields = {}
    for p in params:
        if p.annotation is inspect.Parameter.empty:
            raise ValueError(f"tool {fn.__name__}: parameter {p.name} needs a type hint")
        fields[p.name] = (p.annotation, ... if p.default is inspect.Parameter.empty else p.default)
    return create_model(f"{fn.__name__}_arguments", **fields), False


@dataclass(frozen=True)
class AgentSpec:
    """An agent stage: `fn(ctx)` gives the conversation's opening messages (from the run's input and the steps
    before the stage, not from the agent's own steps); the model then loops over `tools` for at most
    `max_turns` turns (a person may extend it from a budget card)."""

    tools: dict[str, Tool]
    max_turns: int = 10
    prompt_version: str = "1"

    @property
    def tools_version(self) -> str:
        return canonical_hash([t.schema() for t in self.tools.values()])[:16]

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]


def check_tools(tools: list[Tool]) -> dict[str, Tool]:
    by_name: dict[str, Tool] = {}
    for t in tools:
        if not isinstance(t, Tool):
            raise Fatal(f"{t!r} is not a tool: declare it with @runs.tools.tool")
        if t.name in by_name:
            raise ValueError(f"two tools are named {t.name!r}")
        by_name[t.name] = t
    return by_name
