"""An agent workflow for tests and the scripted chat model that drives it from the run's input.

The run's input carries `script`: the model's turns in order, each `{"calls": [[tool, arguments], ...],
"say": "..."}` (a turn that calls tools) or `{"answer": "..."}` (the final one). Every model call and every tool
call is counted as a demo SandboxCall, so tests (in-process or with real worker processes) can check that a
recorded turn is never asked again and an effect never repeated. Select the model with
AGENT_MODEL=tests.agent_workflows.ScriptedChat.

A model call's SandboxCall payload is `{"turn": N, "seen": [...]}`, `seen` the tool results (their `content`,
parsed) the model was sent since its previous turn. For tests that kill a worker in the middle of a run:
a turn with `"sleep": seconds` sleeps after its model call was counted, and the run input's `"hang": {step:
seconds}` makes the tool call step `step` (such as `helper.turn2.1.pay`) sleep once its call was counted (an
effect: applied, its receipt not yet completed); `"slow": {step: seconds}` makes it sleep before its call is
counted (in flight, not yet applied: a lookup does not find it). Each sleeps on its first call only, not when
resumed. The model goes through the model's circuit breaker, as a real model client does (runs.llm).
"""

from __future__ import annotations

import json
import time

from pydantic import BaseModel, Field

from demo.models import SandboxCall
from runs import breakers
from runs.llm import Model
from runs.tools import tool
from runs.workflow import Display, Fatal, Workflow, register


class ScriptedChat(Model):
    name = "scripted"

    def chat(self, messages: list[dict], tools: list[dict]) -> dict:
        with breakers.guard("model"):
            return self._chat(messages, tools)

    def _chat(self, messages: list[dict], tools: list[dict]) -> dict:
        turn = sum(1 for m in messages if m["role"] == "assistant")
        since = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        seen = [_parsed(m["content"]) for m in messages[since + 1 :] if m["role"] == "tool"]
        SandboxCall.objects.create(
            system="model",
            operation=self.step,
            run_id=self.run.id,
            payload={"turn": turn + 1, "seen": seen},
            applied=True,
        )
        script = self.run.input["script"]
        if turn >= len(script):
            raise Fatal("the script has no more turns")
        step = script[turn]
        if step.get("sleep") and _first(self.run.id, "model", {"turn": turn + 1}):
            time.sleep(step["sleep"])
        self._account(100 + 10 * len(messages), 20)
        if "answer" in step:
            return {"role": "assistant", "content": step["answer"], "tool_calls": []}
        calls = [
            {
                "id": f"call_{turn + 1}_{i}",
                "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
            for i, (name, args) in enumerate(step["calls"])
        ]
        return {"role": "assistant", "content": step.get("say"), "tool_calls": calls}


def _parsed(content):
    try:
        return json.loads(content)
    except (TypeError, ValueError):
        return content


def _first(run_id, system: str, payload: dict, operation: str | None = None) -> bool:
    """Whether the call just counted is the first of its kind in this run (a resumed call sleeps no more)."""
    calls = SandboxCall.objects.filter(run_id=run_id, system=system, payload__contains=payload)
    return (calls.filter(operation=operation) if operation else calls).count() == 1


def _count(ctx, system: str, payload: dict) -> dict:
    slow = (ctx.input.get("slow") or {}).get(ctx.step.name)
    if slow and not SandboxCall.objects.filter(run_id=ctx.run.id, system=system, operation=ctx.step.name).exists():
        time.sleep(slow)
    call = SandboxCall.objects.create(
        system=system, operation=ctx.step.name, run_id=ctx.run.id, payload=payload, applied=True
    )
    seconds = (ctx.input.get("hang") or {}).get(ctx.step.name)
    if seconds and _first(ctx.run.id, system, {}, operation=ctx.step.name):
        time.sleep(seconds)
    return {"id": f"{system}_{call.pk}"}


@tool
def lookup_customer(ctx, customer_id: str) -> dict:
    """Look up a customer by id."""
    _count(ctx, "crm_read", {"customer_id": customer_id})
    return {"id": customer_id, "name": "Ada", "balance_cents": 5_000}


class Payment(BaseModel):
    customer_id: str
    amount_cents: int = Field(gt=0, le=100_000)
    note: str = ""


def _current_balance(ctx, args: Payment) -> dict:
    return {"customer_id": args.customer_id, "refunded_cents": 0}


def _paid(history: list[dict]) -> int:
    """What the run's earlier `pay` calls paid (the approval policy counts them)."""
    return sum(c["arguments"]["amount_cents"] for c in history if c["tool"] == "pay" and "result" in c)


@tool(
    kind="effect",
    channel="payments",
    approval=lambda args, history: args.amount_cents + _paid(history) > 1_000,
    current=_current_balance,
    display=Display(headline="note", amount_minor="amount_cents"),
    risk="high",
)
def pay(ctx, args: Payment) -> dict:
    """Refund a customer (amount in cents)."""
    return ctx.effect(lambda key: {**_count(ctx, "payments", {"key": key, **args.model_dump()}), "status": "paid"})


@tool(kind="effect", channel="payments", approval="never")
def note(ctx, text: str) -> dict:
    """Write a note on the customer's record."""
    return ctx.effect(lambda key: _count(ctx, "crm", {"key": key, "text": text}), lookup=_note_written)


def _note_written(key: str) -> dict | None:
    """The CRM can say whether a note with this key was written (reconciles an ambiguous write)."""
    call = SandboxCall.objects.filter(system="crm", payload__key=key).first()
    return {"id": f"crm_{call.pk}"} if call is not None else None


agent = register(Workflow("test_agent"))


@agent.agent(tools=[lookup_customer, pay, note], max_turns=4, prompt_version="test-1")
def helper(ctx):
    return [
        {"role": "system", "content": "You help customers."},
        {"role": "user", "content": ctx.input.get("message", "help")},
    ]


@agent.compute
def after(ctx):
    return {"agent_said": ctx.outputs["helper"]["answer"]}
