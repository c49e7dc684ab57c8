"""Agents: a durable tool-calling loop as a stage of a workflow (`Workflow.agent`). See docs/workflows.md.

The model decides which tool to call next, reads the result and calls again until it answers. Each model turn
and each tool call is its own checkpointed step, with the run's next sequence number: the steps of an agent stage
are not declared up front but read from what the run recorded (`expand`). A turn's output is the assistant's
message; the steps after it are its tool calls, then the next turn, until a turn calls no tool: then one last step
records the answer as the stage's output (`outputs[stage]`). A resumed run replays recorded turns and tool results
from their checkpoints, never calling the model or a tool again.

Tools and the stage's spec are declared in runs.tools (`@tool`, AgentSpec). Arguments the model produces are
validated first; invalid ones go back to the model as the tool's error, never executed.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from django.conf import settings

from runs import gates, personal
from runs.errors import Fatal, Park, Stop
from runs.gates import ANY_LEAF, ApprovalRequest, GateSpec, Outcome, canonical_hash, schema_errors
from runs.steps import Compensation, Context, StepDef
from runs.tools import NEVER, AgentSpec, history


def turn_name(stage: str, turn: int) -> str:
    return f"{stage}.turn{turn}"


def call_name(stage: str, turn: int, index: int, call: dict) -> str:
    return f"{stage}.turn{turn}.{index + 1}.{_call_tool(call)}"[:100]


def expand(stage: StepDef, start: int, seq: int, outputs: dict) -> tuple[StepDef | None, int]:
    """The step at `seq` when it falls in this agent stage (which began at `start`), else (None, the position
    after the stage). Steps before `seq` are done, so their outputs are in `outputs`."""
    spec: AgentSpec = stage.agent
    versions = {"prompt_version": spec.prompt_version, "tools_version": spec.tools_version}
    pos, turn = start, 1
    while True:
        if pos == seq:
            return StepDef(turn_name(stage.name, turn), "compute", _turn_fn(stage, turn), versions=versions), pos
        message = outputs[turn_name(stage.name, turn)]
        pos += 1
        calls = message.get("tool_calls") or []
        if not calls:
            if pos == seq:
                return StepDef(stage.name, "compute", _answer_fn(message, turn), versions=versions), pos
            return None, pos + 1
        for index, call in enumerate(calls):
            if pos == seq:
                return _call_step(stage, turn, index, call, message, versions), pos
            pos += 1
        turn += 1


def _call_step(stage: StepDef, turn: int, index: int, call: dict, message: dict, versions: dict) -> StepDef:
    known = stage.agent.tools.get(_call_tool(call))
    gate = None
    if known is not None and known.approval != NEVER:
        gate = GateSpec(proposal=known.args, editable=ANY_LEAF, display=known.display)
    return StepDef(
        call_name(stage.name, turn, index, call),
        known.kind if known else "read",
        _call_fn(stage, turn, index, call, message),
        channel=known.channel if known else None,
        gate=gate,
        versions=versions,
        compensation=Compensation.of(known.compensation, f"tool {known.name}") if known else None,
    )


def _turn_fn(stage: StepDef, turn: int) -> Callable[[Context], dict]:
    def run_turn(ctx: Context) -> dict:
        spec: AgentSpec = stage.agent
        limit = _max_turns(stage, turn, ctx.outputs)
        extended = {}
        if turn > limit:
            limit = _extend_turns(ctx, stage, limit, turn)
            extended = {"max_turns": limit}
        message = ctx.model.chat(conversation(ctx, stage, turn), spec.schemas())
        return {**_message(message), "model": getattr(ctx.model, "name", ""), **extended}

    return run_turn


def _answer_fn(message: dict, turns: int) -> Callable[[Context], dict]:
    return lambda ctx: {"answer": message.get("content") or "", "turns": turns}


def _max_turns(stage: StepDef, turn: int, outputs: dict) -> int:
    """The stage's turn limit as a person last extended it (recorded on the turn that asked)."""
    limit = stage.agent.max_turns
    for t in range(1, turn):
        limit = outputs.get(turn_name(stage.name, t), {}).get("max_turns", limit)
    return limit


def _extend_turns(ctx: Context, stage: StepDef, limit: int, turn: int) -> int:
    """Past its turn limit the run parks with a budget card: a person extends the limit or stops the run."""
    channel = next((t.channel for t in stage.agent.tools.values() if t.channel), "payments")
    # The card proposes at most the ceiling (approvals.edits holds approvals and edits to it too). An agent that
    # has taken that many turns gets a card all the same, proposing the ceiling, which cannot be approved.
    ceiling, taken = settings.AGENT_MAX_TURNS, turn - 1
    request = ApprovalRequest(
        channel=channel,
        kind=gates.Kind.BUDGET,
        proposed={"max_turns": min(limit * 2, ceiling)},
        current={"turns": taken, "max_turns": limit},
        summary=(
            f"The agent '{stage.name}' has taken {taken} turns, its limit, and the ceiling of {ceiling} "
            "(AGENT_MAX_TURNS) is reached: stop the run, or raise AGENT_MAX_TURNS first."
            if taken >= ceiling
            else f"The agent '{stage.name}' has taken {taken} turns, its limit. Extend the limit or stop the run."
        ),
        rule_id="max-turns",
        risk="medium",
    )
    park = Park(f"turn limit {limit} of agent {stage.name} reached", request, paused=True)
    decision = gates.backend().decision(ctx.run, ctx.seq, request)
    if decision is None:
        raise park
    if decision.rejected:
        undo = {"undo": "budget"} if decision.undo else {}  # stop and undo (runs.compensations)
        raise Stop({"outcome": "stopped at turn limit", "by": decision.by, "comment": decision.comment, **undo})
    extended = min(int((decision.payload or {})["max_turns"]), ceiling)  # the ceiling may have been lowered
    if extended <= taken:
        raise park  # no room: ask again rather than take another turn
    return extended


def conversation(ctx: Context, stage: StepDef, turn: int) -> list[dict]:
    """The messages the model sees at `turn`: the stage's opening, then each recorded turn and its tool results."""
    opening = stage.fn(ctx)
    messages = [{"role": "user", "content": opening}] if isinstance(opening, str) else list(opening)
    for t in range(1, turn):
        message = ctx.outputs[turn_name(stage.name, t)]
        messages.append(_message(message))
        for index, call in enumerate(message.get("tool_calls") or []):
            result = ctx.outputs[call_name(stage.name, t, index, call)]
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": for_model(result)})
    return messages


def _message(message: dict) -> dict:
    """The assistant message as the chat API takes it back."""
    out = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def for_model(result: dict) -> str:
    """What a tool call's step tells the model (its `content`)."""
    if "error" in result:
        return json.dumps({"error": result["error"]})
    if "skipped" in result:
        return json.dumps({"error": "not executed", **result["skipped"]})
    if "rejected" in result:
        rejected = result["rejected"]
        return json.dumps(
            {
                "error": "a reviewer rejected this call; it was not executed",
                "comment": rejected.get("comment", ""),
                "reason": rejected.get("reason", ""),
                **({"note": "this call was already rejected in this run"} if result.get("repeat") else {}),
            }
        )
    answer: dict = {"result": result.get("result")}
    if result.get("edited"):
        answer["executed_arguments"] = result["arguments"]
        answer["note"] = "a reviewer edited the arguments before the call was executed"
    return json.dumps(answer, default=str)


def _call_tool(call: dict) -> str:
    return str((call.get("function") or {}).get("name") or "")


def _call_fn(stage: StepDef, turn: int, index: int, call: dict, message: dict) -> Callable[[Context], dict]:
    def run_call(ctx: Context) -> dict:
        name = _call_tool(call)
        base = {"tool": name, "call_id": call.get("id", "")}
        known = stage.agent.tools.get(name)
        if known is None:
            return {**base, "error": f"there is no tool {name!r}; the tools are {', '.join(stage.agent.tools)}"}
        raw = (call.get("function") or {}).get("arguments") or "{}"
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError as exc:
            return {**base, "error": f"the arguments are not JSON: {exc}"}
        if errors := schema_errors(known.args, arguments):
            return {**base, "error": "invalid arguments, not executed", "details": errors}
        args = known.args.model_validate(arguments)
        proposed = args.model_dump(mode="json")
        if known.kind == "effect" and (refused := _rejected_earlier_in_turn(stage, turn, index, message, ctx.outputs)):
            # A person refused a call of this turn: the model planned the calls together, so the effects it
            # planned after the refused one go back to it unexecuted, with the reason, for it to plan again.
            return {**base, "arguments": proposed, "skipped": refused}
        decision = None
        if known.needs_approval(args, history(stage.name, ctx.outputs)):
            if (earlier := _earlier_rejection(stage, ctx.outputs, name, proposed)) is not None:
                return {**base, "arguments": proposed, "rejected": earlier, "repeat": True}
            decision = ctx.gate(
                ApprovalRequest(
                    channel=known.channel,
                    proposed=proposed,
                    current=known.current(ctx, args) if known.current else None,
                    summary=message.get("content") or f"The agent wants to call {name}.",
                    rule_id=f"tool:{name}",
                    risk=known.risk,
                )
            )
            if decision["decision"] == Outcome.REJECTED:
                rejected = {k: decision[k] for k in ("comment", "reason", "by")}
                if decision.get("undo"):
                    # Reject and undo: the run stops here and what it did is undone (runs.compensations).
                    raise Stop({"outcome": "rejected", "step": ctx.step.name, **rejected, "undo": "rejected"})
                return {**base, "arguments": proposed, "rejected": rejected}
            if decision["payload"] != proposed:
                # Validated as the card was decided, and again by ctx.gate; if it still fails, it is not retried.
                if errors := schema_errors(known.args, decision["payload"]):
                    text = "; ".join(f"{e['loc']} {e['msg']}" for e in errors)
                    raise Fatal(f"the edited arguments of {name} do not fit the tool ({text}): not executed")
                args = known.args.model_validate(decision["payload"])
        executed = args.model_dump(mode="json")
        # A read's declared personal fields are sealed: the model sees their references, never the values.
        result = personal.seal_read(known.pii, known.call(ctx, args), field=name, run_id=ctx.run.id, known=ctx.known)
        out = {**base, "arguments": executed, "result": result}
        if decision is not None:
            out.update(approved_by=decision["by"], edited=executed != proposed)
        return out

    return run_call


def _rejected_earlier_in_turn(stage: StepDef, turn: int, index: int, message: dict, outputs: dict) -> dict | None:
    """Why a call of `turn` after position `index` is not executed: an earlier call of the same turn was rejected
    by a person. None when none was."""
    calls = message.get("tool_calls") or []
    for earlier, call in enumerate(calls[:index]):
        output = outputs.get(call_name(stage.name, turn, earlier, call))
        if isinstance(output, dict) and "rejected" in output:
            rejected = output["rejected"]
            return {
                "reason": f"a reviewer rejected {output.get('tool')} earlier in this turn, so the calls planned "
                "after it were not executed",
                "rejected_call": output.get("call_id", ""),
                "comment": rejected.get("comment", ""),
            }
    return None


def _earlier_rejection(stage: StepDef, outputs: dict, name: str, proposed: dict) -> dict | None:
    """A person's rejection of the same call with the same arguments earlier in this run: not asked twice."""
    prefix, wanted = f"{stage.name}.turn", canonical_hash(proposed)
    for step, output in outputs.items():
        if (
            step.startswith(prefix)
            and isinstance(output, dict)
            and output.get("tool") == name
            and "rejected" in output
            and canonical_hash(output.get("arguments")) == wanted
        ):
            return output["rejected"]
    return None
