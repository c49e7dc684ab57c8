"""The Pydantic AI adapter against the in-memory console and an in-memory chat-completions model (both through
httpx.MockTransport): Pydantic AI runs for real, its deferred calls become requests, the decisions continue the
run, and the tool runs only with the console's go. The same against the live console: tests/system/
test_adapter_pydantic_ai.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from conftest import BASE_URL
from fake_console import FakeConsole, ProcessDied, digest_of
from openai import AsyncOpenAI
from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults, RunContext, Tool
from pydantic_ai.capabilities import HandleDeferredToolCalls
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from hitl_client import AsyncClient, Client, Locked
from hitl_client.adapters.pydantic_ai import (
    NoApprovalSession,
    NotAnApprovalTool,
    SessionFinished,
    approval_tool,
    run_with_approvals,
)

ASKED = {"order_id": "o-42", "amount_cents": 500}


class Model:
    """A chat-completions model that calls the tools it is scripted to call, then answers with the outputs it
    was sent (so a test reads what the model was told). Every request body is kept."""

    def __init__(self, calls: list[tuple[str, dict[str, Any] | str]]) -> None:
        self.calls, self.requests = calls, []
        self.die_with_output = False

    def handler(self, http: httpx.Request) -> httpx.Response:
        body = json.loads(http.content)
        self.requests.append(body)
        last = body["messages"][-1]
        if last["role"] == "tool":
            if self.die_with_output:
                raise ProcessDied
            outputs = [m["content"] for m in body["messages"] if m["role"] == "tool"]
            message = {"role": "assistant", "content": "Done. " + " | ".join(outputs)}
            return _completion(message, "stop")
        tool_calls = [
            {
                "id": f"call_{n}",
                "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
            for n, (name, args) in enumerate(self.calls)
        ]
        return _completion({"role": "assistant", "content": None, "tool_calls": tool_calls}, "tool_calls")

    def tool_outputs(self) -> dict[str, str]:
        """What the model was sent as each call's output, by call id (the last request's view)."""
        return {m["tool_call_id"]: m["content"] for m in self.requests[-1]["messages"] if m["role"] == "tool"}


def _completion(message: dict[str, Any], finish: str) -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "test",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        },
    )


class Refunds:
    """The payment system: counts every refund it is asked for (deliberately not idempotent)."""

    def __init__(self) -> None:
        self.made: list[tuple[str, int]] = []
        self.die = False
        self.fail = False

    def tool(self, **options: Any) -> Tool[Any]:
        @approval_tool(channel="payments", rationale="the parcel never arrived", **options)
        def refund_order(order_id: str, amount_cents: int) -> dict[str, Any]:
            """Refund an order."""
            self.made.append((order_id, amount_cents))
            if self.die:
                raise ProcessDied  # the process dies after the refund, before its report
            if self.fail:
                raise RuntimeError("the bank said no")
            return {"refund_id": f"r-{len(self.made)}", "amount_cents": amount_cents}

        return refund_order


def agent_with(model: Model, *tools: Tool[Any]) -> Agent[Any, str]:
    openai = AsyncOpenAI(
        base_url="http://model.test/v1",
        api_key="test",
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(model.handler)),
        max_retries=0,
    )
    chat = OpenAIChatModel("test", provider=OpenAIProvider(openai_client=openai))
    return Agent(chat, instructions="Refund what you are asked to.", tools=list(tools))


def run(console: FakeConsole, agent: Agent[Any, Any], **options: Any):
    async def main():
        transport = httpx.MockTransport(console.handler)
        async with AsyncClient(BASE_URL, "tok-alice", transport=transport, backoff=0, max_backoff=0) as client:
            options.setdefault("session", "ticket-42")
            return await run_with_approvals(agent, "Refund order o-42.", client=client, **options)

    return asyncio.run(main())


def test_an_edit_runs_the_tool_once_with_the_edited_arguments_and_the_model_is_told(console, tmp_path):
    refunds, model = Refunds(), Model([("refund_order", ASKED)])
    edited = {**ASKED, "amount_cents": 300}
    console.approves_while_waiting(edit=edited)

    result = run(console, agent_with(model, refunds.tool()), history_path=tmp_path / "history.json")

    assert refunds.made == [("o-42", 300)]
    request = console.only()
    assert request.key == "ticket-42:call_0" and request.asked == ASKED
    assert console.consumed_digests == [digest_of(edited)]
    assert request.execution == "succeeded" and request.result == {"refund_id": "r-1", "amount_cents": 300}
    told = model.tool_outputs()["call_0"]
    assert "A person edited the arguments" in told and '"amount_cents": 300' in told
    assert "Done." in result.output
    # The card's edits are checked against the tool's parameters (these two, nothing else).
    schema = request.body["schema"]
    assert schema["required"] == ["order_id", "amount_cents"] and schema["additionalProperties"] is False
    saved = json.loads((tmp_path / "history.json").read_text())
    assert saved["finished"] is True and "Done." in saved["output"]


def test_an_edit_tells_the_model_the_reviewers_comment(console):
    # Issue 24: LangGraph and the MCP gateway told the model why the arguments changed; this adapter dropped it.
    refunds, model = Refunds(), Model([("refund_order", ASKED)])
    edited = {**ASKED, "amount_cents": 300}
    console.approves_while_waiting(edit=edited, comment="Two euros went back as a voucher already.")

    run(console, agent_with(model, refunds.tool()))

    assert refunds.made == [("o-42", 300)]
    told = model.tool_outputs()["call_0"]
    assert "A person edited the arguments" in told
    assert "Their comment: Two euros went back as a voucher already." in told


def test_on_wait_is_told_what_the_run_waits_for_before_each_wait(console):
    # Issue 24: LangGraph's invoke_with_approvals has on_wait; this adapter printed nothing while it waited.
    refunds, model = Refunds(), Model([("refund_order", ASKED), ("refund_order", {**ASKED, "order_id": "o-43"})])
    told: list[list[dict[str, Any]]] = []
    console.approves_while_waiting()

    run(console, agent_with(model, refunds.tool()), on_wait=told.append)

    assert len(told) == 1 and len(told[0]) == 2  # once, before the wait, with both undecided requests
    first, second = told[0]
    request = next(r for r in console.requests.values() if r.asked == ASKED)
    assert first == {
        "request_id": request.id,
        "url": f"/api/approval-requests/{request.id}",
        "card_id": str(request.card_id),
        "card_url": f"{BASE_URL}/approvals/{request.card_id}/",
        "action": "refund_order",
        "tool_call_id": "call_0",
    }
    assert second["tool_call_id"] == "call_1" and second["card_url"].startswith(f"{BASE_URL}/approvals/")
    assert refunds.made == [("o-42", 500), ("o-43", 500)]


def test_a_rejection_reaches_the_model_with_the_comment_and_runs_nothing(console):
    refunds, model = Refunds(), Model([("refund_order", ASKED)])
    console.rejects_while_waiting(comment="Customer already got a voucher.")

    result = run(console, agent_with(model, refunds.tool()))

    assert refunds.made == [] and console.consumed_digests == []
    told = model.tool_outputs()["call_0"]
    assert "rejected" in told and "it did not run" in told and "Customer already got a voucher." in told
    assert "Customer already got a voucher." in result.output


def test_each_call_of_a_turn_is_its_own_request_and_decision(console):
    refunds, model = Refunds(), Model([("refund_order", ASKED), ("refund_order", {**ASKED, "order_id": "o-43"})])

    def decide(request):
        if request.asked["order_id"] == "o-42":
            console.approve(request.id)
        else:
            console.reject(request.id, comment="not eligible")

    console.reviewer = decide
    run(console, agent_with(model, refunds.tool()))

    assert refunds.made == [("o-42", 500)]
    keys = sorted(r.key for r in console.requests.values())
    assert keys == ["ticket-42:call_0", "ticket-42:call_1"]
    # One session, one external run: the second request joined the first one's.
    assert len({r.run_id for r in console.requests.values()}) == 1
    told = model.tool_outputs()
    assert "r-1" in told["call_0"] and "not eligible" in told["call_1"]


def test_a_process_that_died_after_the_go_is_restarted_and_does_not_run_the_tool_again(console, tmp_path):
    refunds, model = Refunds(), Model([("refund_order", ASKED)])
    console.approves_while_waiting()
    refunds.die = True
    history = tmp_path / "history.json"
    with pytest.raises(ProcessDied):
        run(console, agent_with(model, refunds.tool()), history_path=history)
    assert refunds.made == [("o-42", 500)] and console.only().execution == "pending"
    calls_before = len(model.requests)

    refunds.die = False
    result = run(console, agent_with(model, refunds.tool()), history_path=history)

    assert refunds.made == [("o-42", 500)]  # not again
    # The restart read the receipt (consumed, no outcome) and did not ask for another go.
    assert console.calls("POST", "/consume") == 1
    told = model.tool_outputs()["call_0"]
    assert "no outcome was reported" in told and "It is not run again" in told
    # Continued from the saved history: the model was not asked for the call again, only for the answer.
    assert len(model.requests) == calls_before + 1
    assert "not run again" in result.output


def test_a_restart_after_the_report_gives_the_model_the_recorded_result(console, tmp_path):
    refunds, model = Refunds(), Model([("refund_order", ASKED)])
    console.approves_while_waiting()
    history = tmp_path / "history.json"
    agent = agent_with(model, refunds.tool())
    # The refund ran and was reported; the process dies as it sends the model the output.
    model.die_with_output = True
    with pytest.raises(ProcessDied):
        run(console, agent, history_path=history)
    assert refunds.made == [("o-42", 500)] and console.only().execution == "succeeded"

    model.die_with_output = False
    run(console, agent, history_path=history)

    assert refunds.made == [("o-42", 500)] and console.calls("POST", "/consume") == 1
    assert json.loads(model.tool_outputs()["call_0"]) == {"refund_id": "r-1", "amount_cents": 500}


def test_the_tools_own_failure_is_reported_told_to_the_model_and_not_run_again(console, tmp_path):
    refunds, model = Refunds(), Model([("refund_order", ASKED)])
    console.approves_while_waiting()
    refunds.fail = True

    run(console, agent_with(model, refunds.tool()))

    assert refunds.made == [("o-42", 500)]
    request = console.only()
    assert request.execution == "failed" and "the bank said no" in request.error
    assert "refund_order failed: the bank said no" in model.tool_outputs()["call_0"]


def test_on_a_shadow_channel_the_tool_is_never_called_and_the_model_is_told(console):
    refunds, model = Refunds(), Model([("refund_order", ASKED)])
    console.shadow_channels.add("payments")
    console.approves_while_waiting()

    run(console, agent_with(model, refunds.tool()))

    assert refunds.made == []
    told = model.tool_outputs()["call_0"]
    assert "shadow mode" in told and "a person carries it out by hand" in told and '"amount_cents": 500' in told


def test_a_kill_switch_stops_the_run_and_a_later_run_goes_on_once_it_is_released(console, tmp_path):
    refunds, model = Refunds(), Model([("refund_order", ASKED)])
    console.approves_while_waiting()
    console.locked_channels.add("payments")
    history = tmp_path / "history.json"
    agent = agent_with(model, refunds.tool())
    with pytest.raises(Locked):
        run(console, agent, history_path=history)
    assert refunds.made == [] and console.only().execution == "not_started"

    console.locked_channels.clear()
    run(console, agent, history_path=history)

    assert refunds.made == [("o-42", 500)] and len(console.requests) == 1


def test_a_finished_session_is_not_run_again(console, tmp_path):
    refunds, model = Refunds(), Model([("refund_order", ASKED)])
    console.approves_while_waiting()
    history = tmp_path / "history.json"
    agent = agent_with(model, refunds.tool())
    run(console, agent, history_path=history)
    model_calls, seen = len(model.requests), len(console.seen)

    with pytest.raises(SessionFinished) as finished:
        run(console, agent, history_path=history)

    assert "Done." in finished.value.output
    assert refunds.made == [("o-42", 500)] and len(model.requests) == model_calls and len(console.seen) == seen


def test_arguments_that_do_not_fit_the_tool_go_back_to_the_model_without_a_card(console):
    refunds = Refunds()
    model = Model([("refund_order", {**ASKED, "note": "x"}), ("refund_order", "{not json")])

    run(console, agent_with(model, refunds.tool()))

    assert console.requests == {} and refunds.made == []
    told = model.tool_outputs()
    assert "note" in told["call_0"] and "Extra inputs are not permitted" in told["call_0"]
    assert "Invalid JSON" in told["call_1"]


def test_an_approval_tool_run_without_run_with_approvals_refuses_and_runs_nothing(console):
    refunds, model = Refunds(), Model([("refund_order", ASKED)])
    agent = agent_with(model, refunds.tool())

    async def approve_in_pydantic_ai_alone():
        result = await agent.run("Refund order o-42.", output_type=[str, DeferredToolRequests])
        assert isinstance(result.output, DeferredToolRequests)
        approvals = {call.tool_call_id: True for call in result.output.approvals}
        await agent.run(
            message_history=result.all_messages(),
            deferred_tool_results=DeferredToolResults(approvals=approvals),
            output_type=[str, DeferredToolRequests],
        )

    with pytest.raises(NoApprovalSession):
        asyncio.run(approve_in_pydantic_ai_alone())
    assert refunds.made == [] and console.seen == []


def test_a_call_approved_inside_pydantic_ai_is_refused_even_under_run_with_approvals(console):
    # Pydantic AI's own inline handler approves every deferred call: the tool is reached with no card asked.
    refunds, model = Refunds(), Model([("refund_order", ASKED)])
    agent = agent_with(model, refunds.tool())
    approve_all = HandleDeferredToolCalls(handler=lambda ctx, requests: requests.build_results(approve_all=True))

    with pytest.raises(NoApprovalSession, match="did not ask the console"):
        run(console, agent, capabilities=[approve_all])
    assert refunds.made == [] and console.seen == []


def test_a_tool_that_needs_approval_but_is_not_an_approval_tool_stops_the_run(console):
    made = []

    def refund_order(order_id: str, amount_cents: int) -> str:
        """Refund an order."""
        made.append(order_id)
        return "ok"

    agent = agent_with(Model([("refund_order", ASKED)]), Tool(refund_order, requires_approval=True))
    with pytest.raises(NotAnApprovalTool, match="refund_order"):
        run(console, agent)
    assert made == [] and console.seen == []


def test_the_function_may_take_the_run_context_and_be_async(console):
    seen: list[tuple[str | None, dict[str, Any]]] = []

    @approval_tool(channel="payments", current=lambda order_id, amount_cents: {"balance": 900})
    async def refund_order(ctx: RunContext[Any], order_id: str, amount_cents: int = 100) -> str:
        """Refund an order."""
        seen.append((ctx.tool_call_id, {"order_id": order_id, "amount_cents": amount_cents}))
        return "refunded"

    console.approves_while_waiting()
    run(console, agent_with(Model([("refund_order", {"order_id": "o-42"})]), refund_order))

    # The default is part of what the person approved, and of what ran.
    assert seen == [("call_0", {"order_id": "o-42", "amount_cents": 100})]
    assert console.only().asked == {"order_id": "o-42", "amount_cents": 100}
    assert console.only().body["current"] == {"balance": 900}


def test_bad_arguments_of_the_adapter_are_refused_before_anything_is_asked(console, tmp_path):
    console.rejects_while_waiting(comment="not this one")  # were anything asked, the run would end, not wait
    model = Model([("refund_order", ASKED)])
    agent = agent_with(model, Refunds().tool())
    with pytest.raises(ValueError, match="session must be"):
        run(console, agent, session="s" * 121)
    sync_client = Client(BASE_URL, "tok-alice", transport=httpx.MockTransport(console.handler))
    with sync_client, pytest.raises(TypeError, match="AsyncClient"):
        asyncio.run(run_with_approvals(agent, "x", client=sync_client, session="s"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="message_history"):
        run(console, agent, message_history=[])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": 1, "session": "ticket-1", "run_id": None}))
    with pytest.raises(ValueError, match="ticket-1"):
        run(console, agent, history_path=other)
    with pytest.raises(TypeError, match="by name"):

        @approval_tool(channel="payments")
        def positional(order_id: str, /) -> None: ...

    assert console.seen == [] and model.requests == []
