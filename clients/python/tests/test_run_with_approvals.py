"""The adapters whose runs stop for approvals (`run_with_approvals` of the OpenAI Agents SDK and of Pydantic AI),
each through the same scenarios, against the in-memory console and an in-memory chat-completions model: the
framework runs for real, its stops become requests, the decisions continue the run, and the tool runs only with
the console's go. What only one framework has is in test_adapter_<framework>.py; the same scenarios against the
live console, as processes killed and restarted, are tests/system/test_adapters.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from approval_runs import ADAPTERS, Adapter, Model, Refunds
from conftest import BASE_URL
from fake_console import ProcessDied, digest_of

from hitl_client import AsyncClient, Client, Locked

ASKED = {"order_id": "o-42", "amount_cents": 500}


@pytest.fixture(params=sorted(ADAPTERS))
def adapter(request: pytest.FixtureRequest) -> Adapter:
    return ADAPTERS[request.param]()


def test_an_edit_runs_the_tool_once_with_the_edited_arguments_and_the_model_is_told(adapter, console, tmp_path):
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])
    edited = {**ASKED, "amount_cents": 300}
    console.approves_while_waiting(edit=edited)
    path = tmp_path / "session.json"

    result = adapter.run(console, adapter.agent(model, refunds.tool()), **{adapter.path_option: path})

    assert refunds.made == [("o-42", 300)]
    request = console.only()
    assert request.key == "ticket-42:call_0" and request.asked == ASKED
    assert console.consumed_digests == [digest_of(edited)]
    assert request.execution == "succeeded" and request.result == {"refund_id": "r-1", "amount_cents": 300}
    told = model.tool_outputs()["call_0"]
    assert "A person edited the arguments" in told and '"amount_cents": 300' in told
    assert "Done." in adapter.output(result)
    # The card's edits are checked against the tool's parameters (these two, nothing else).
    schema = request.body["schema"]
    assert schema["required"] == ["order_id", "amount_cents"] and schema["additionalProperties"] is False
    saved = json.loads(path.read_text())
    assert saved["finished"] is True and "Done." in saved[adapter.output_key]


def test_an_edit_tells_the_model_the_reviewers_comment(adapter, console):
    # Issue 24: LangGraph and the MCP gateway told the model why the arguments changed; these adapters dropped it.
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])
    console.approves_while_waiting(edit={**ASKED, "amount_cents": 300}, comment="Two euros went back as a voucher.")

    adapter.run(console, adapter.agent(model, refunds.tool()))

    assert refunds.made == [("o-42", 300)]
    told = model.tool_outputs()["call_0"]
    assert "A person edited the arguments" in told and "Their comment: Two euros went back as a voucher." in told


def test_on_wait_is_told_what_the_run_waits_for_before_each_wait(adapter, console):
    # Issue 24: LangGraph's invoke_with_approvals has on_wait; these adapters printed nothing while they waited.
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED), ("refund_order", {**ASKED, "order_id": "o-43"})])
    told: list[list[dict[str, Any]]] = []
    console.approves_while_waiting()

    adapter.run(console, adapter.agent(model, refunds.tool()), on_wait=told.append)

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
    # Both ran, once each (Pydantic AI runs a turn's approved calls side by side: in either order).
    assert sorted(refunds.made) == [("o-42", 500), ("o-43", 500)]


def test_a_rejection_reaches_the_model_with_the_comment_and_runs_nothing(adapter, console):
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])
    console.rejects_while_waiting(comment="Customer already got a voucher.")

    result = adapter.run(console, adapter.agent(model, refunds.tool()))

    assert refunds.made == [] and console.consumed_digests == []
    told = model.tool_outputs()["call_0"]
    assert "rejected" in told and "it did not run" in told and "Customer already got a voucher." in told
    assert "Customer already got a voucher." in adapter.output(result)


def test_each_call_of_a_turn_is_its_own_request_and_decision(adapter, console):
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED), ("refund_order", {**ASKED, "order_id": "o-43"})])

    def decide(request):
        if request.asked["order_id"] == "o-42":
            console.approve(request.id)
        else:
            console.reject(request.id, comment="not eligible")

    console.reviewer = decide
    adapter.run(console, adapter.agent(model, refunds.tool()))

    assert refunds.made == [("o-42", 500)]
    assert sorted(r.key for r in console.requests.values()) == ["ticket-42:call_0", "ticket-42:call_1"]
    # One session, one external run: the second request joined the first one's.
    assert len({r.run_id for r in console.requests.values()}) == 1
    told = model.tool_outputs()
    assert "r-1" in told["call_0"] and "not eligible" in told["call_1"]


def test_a_process_that_died_after_the_go_is_restarted_and_does_not_run_the_tool_again(adapter, console, tmp_path):
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])
    console.approves_while_waiting()
    refunds.die = True
    path = {adapter.path_option: tmp_path / "session.json"}
    with pytest.raises(ProcessDied):
        adapter.run(console, adapter.agent(model, refunds.tool()), **path)
    assert refunds.made == [("o-42", 500)] and console.only().execution == "pending"
    calls_before = len(model.requests)

    refunds.die = False
    result = adapter.run(console, adapter.agent(model, refunds.tool()), **path)

    assert refunds.made == [("o-42", 500)]  # not again
    # The restart read the receipt (consumed, no outcome) and did not ask for another go.
    assert console.calls("POST", "/consume") == 1
    told = model.tool_outputs()["call_0"]
    assert "no outcome was reported" in told and "It is not run again" in told
    # Went on from the saved file: the model was not asked for the call again, only for the answer.
    assert len(model.requests) == calls_before + 1
    assert "not run again" in adapter.output(result)


def test_a_restart_after_the_report_gives_the_model_the_recorded_result(adapter, console, tmp_path):
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])
    console.approves_while_waiting()
    path = {adapter.path_option: tmp_path / "session.json"}
    agent = adapter.agent(model, refunds.tool())
    # The refund ran and was reported; the process dies as it sends the model the output.
    model.die_with_output = True
    with pytest.raises(ProcessDied):
        adapter.run(console, agent, **path)
    assert refunds.made == [("o-42", 500)] and console.only().execution == "succeeded"

    model.die_with_output = False
    adapter.run(console, agent, **path)

    assert refunds.made == [("o-42", 500)] and console.calls("POST", "/consume") == 1
    assert adapter.recorded(model.tool_outputs()["call_0"]) == {"refund_id": "r-1", "amount_cents": 500}


def test_the_tools_own_failure_is_reported_told_to_the_model_and_not_run_again(adapter, console):
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])
    console.approves_while_waiting()
    refunds.fail = True

    adapter.run(console, adapter.agent(model, refunds.tool()))

    assert refunds.made == [("o-42", 500)]
    request = console.only()
    assert request.execution == "failed" and "the bank said no" in request.error
    assert "refund_order failed: the bank said no" in model.tool_outputs()["call_0"]


def test_on_a_shadow_channel_the_tool_is_never_called_and_the_model_is_told(adapter, console):
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])
    console.shadow_channels.add("payments")
    console.approves_while_waiting()

    adapter.run(console, adapter.agent(model, refunds.tool()))

    assert refunds.made == []
    told = model.tool_outputs()["call_0"]
    assert "shadow mode" in told and "a person carries it out by hand" in told and '"amount_cents": 500' in told


def test_a_kill_switch_stops_the_run_and_a_later_run_goes_on_once_it_is_released(adapter, console, tmp_path):
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])
    console.approves_while_waiting()
    console.locked_channels.add("payments")
    path = {adapter.path_option: tmp_path / "session.json"}
    agent = adapter.agent(model, refunds.tool())
    with pytest.raises(Locked):
        adapter.run(console, agent, **path)
    assert refunds.made == [] and console.only().execution == "not_started"

    console.locked_channels.clear()
    adapter.run(console, agent, **path)

    assert refunds.made == [("o-42", 500)] and len(console.requests) == 1


def test_a_finished_session_is_not_run_again(adapter, console, tmp_path):
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])
    console.approves_while_waiting()
    path = {adapter.path_option: tmp_path / "session.json"}
    agent = adapter.agent(model, refunds.tool())
    adapter.run(console, agent, **path)
    model_calls, seen = len(model.requests), len(console.seen)

    with pytest.raises(adapter.module.SessionFinished) as finished:
        adapter.run(console, agent, **path)

    assert "Done." in adapter.finished_output(finished.value)
    assert refunds.made == [("o-42", 500)] and len(model.requests) == model_calls and len(console.seen) == seen


def test_arguments_that_do_not_fit_the_tool_go_back_to_the_model_without_a_card(adapter, console):
    refunds = Refunds(adapter)
    model = Model([("refund_order", {**ASKED, "note": "x"}), ("refund_order", "{not json")])

    adapter.run(console, adapter.agent(model, refunds.tool()))

    assert console.requests == {} and refunds.made == []
    told = model.tool_outputs()
    extra, not_json = adapter.bad_arguments_told
    assert all(words in told["call_0"] for words in extra), told["call_0"]
    assert all(words in told["call_1"] for words in not_json), told["call_1"]


def test_the_function_may_take_the_frameworks_context_and_be_async(adapter, console):
    seen: list[tuple[str | None, dict[str, Any]]] = []
    tool = adapter.context_tool(seen, current=lambda order_id, amount_cents: {"balance": 900})
    console.approves_while_waiting()

    adapter.run(console, adapter.agent(Model([("refund_order", {"order_id": "o-42"})]), tool))

    # The default is part of what the person approved, and of what ran.
    assert seen == [("call_0", {"order_id": "o-42", "amount_cents": 100})]
    assert console.only().asked == {"order_id": "o-42", "amount_cents": 100}
    assert console.only().body["current"] == {"balance": 900}


def test_an_approval_tool_run_without_run_with_approvals_refuses_and_runs_nothing(adapter, console):
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])

    with pytest.raises(Exception) as raised:  # noqa: PT011 - as the framework hands on what the tool raised
        asyncio.run(adapter.approve_without_the_console(adapter.agent(model, refunds.tool())))

    assert isinstance(adapter.refused(raised.value), adapter.module.NoApprovalSession), raised.value
    assert refunds.made == [] and console.seen == []


def test_a_tool_that_needs_approval_but_is_not_an_approval_tool_stops_the_run(adapter, console):
    made: list[str] = []
    tool = adapter.plain_tool_needing_approval(made)

    with pytest.raises(adapter.module.NotAnApprovalTool, match="refund_order"):
        adapter.run(console, adapter.agent(Model([("refund_order", ASKED)]), tool))
    assert made == [] and console.seen == []


def test_bad_arguments_of_the_adapter_are_refused_before_anything_is_asked(adapter, console, tmp_path):
    console.rejects_while_waiting(comment="not this one")  # were anything asked, the run would end, not wait
    model = Model([("refund_order", ASKED)])
    agent = adapter.agent(model, Refunds(adapter).tool())
    with pytest.raises(ValueError, match="session must be"):
        adapter.run(console, agent, session="s" * 121)
    sync_client = Client(BASE_URL, "tok-alice", transport=httpx.MockTransport(console.handler))
    with sync_client, pytest.raises(TypeError, match="AsyncClient"):
        asyncio.run(adapter.module.run_with_approvals(agent, "x", client=sync_client, session="s"))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": 1, "session": "ticket-1", "run_id": None}))
    with pytest.raises(ValueError, match="ticket-1"):
        adapter.run(console, agent, **{adapter.path_option: other})
    not_a_file = tmp_path / "not-a-file.json"
    not_a_file.write_text(json.dumps({"format": 2}))
    with pytest.raises(ValueError, match="not a .* file of run_with_approvals"):
        adapter.run(console, agent, **{adapter.path_option: not_a_file})
    with pytest.raises(TypeError, match="by name"):

        @adapter.module.approval_tool(channel="payments")
        def positional(order_id: str, /) -> None: ...

    assert console.seen == [] and model.requests == []


def test_two_sessions_on_one_client_ask_each_their_own_requests(adapter, console):
    # The same agent and client, two tickets: the session names the keys, so the second is asked, not replayed.
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])
    console.approves_while_waiting()

    async def main() -> None:
        transport = httpx.MockTransport(console.handler)
        async with AsyncClient(BASE_URL, "tok-alice", transport=transport, backoff=0) as client:
            agent = adapter.agent(model, refunds.tool())
            await adapter.module.run_with_approvals(agent, "Refund order o-42.", client=client, session="t-1")
            await adapter.module.run_with_approvals(agent, "Refund order o-42.", client=client, session="t-2")

    asyncio.run(main())
    assert refunds.made == [("o-42", 500), ("o-42", 500)]
    assert sorted(r.key for r in console.requests.values()) == ["t-1:call_0", "t-2:call_0"]
