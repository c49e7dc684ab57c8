"""The LangGraph adapter (`hitl_client.adapters.langgraph`) on real LangGraph graphs against the in-memory console:
what runs, what the model is told, and what is refused before anything is asked. The console's side and the
process crashes are in the system test (tests/system/test_adapters.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from conftest import run_coroutine
from fake_console import FakeConsole

pytest.importorskip("langgraph")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402
from langgraph.graph import START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import tools_condition  # noqa: E402
from langgraph.types import Command  # noqa: E402

from hitl_client import AsyncClient, Locked  # noqa: E402
from hitl_client.adapters.langgraph import (  # noqa: E402
    INTERRUPT_KEY,
    ApprovalToolNode,
    ainvoke_with_approvals,
    invoke_with_approvals,
)

REFUND = {"order_id": "o-1", "amount_cents": 5_000}
THREAD = {"configurable": {"thread_id": "t-1"}}


@dataclass
class Shop:
    """The tools' side: every call they made."""

    refunds: list[dict[str, Any]] = field(default_factory=list)
    lookups: list[str] = field(default_factory=list)
    model_saw: list[list[str]] = field(default_factory=list)

    def graph(self, client: Any, calls: list[tuple[str, dict[str, Any]]], checkpointer: Any = None, **options: Any):
        """A graph whose model asks for `calls` once, then ends with what the tools answered."""

        @tool
        def refund_order(order_id: str, amount_cents: int) -> dict:
            """Refund an order."""
            if amount_cents == 13:
                raise RuntimeError("the payment service is down")
            self.refunds.append({"order_id": order_id, "amount_cents": amount_cents})
            return {"refunded_cents": amount_cents}

        @tool
        def lookup_order(order_id: str) -> dict:
            """Look an order up."""
            self.lookups.append(order_id)
            return {"paid_cents": 5_000}

        def model(state: MessagesState) -> dict:
            told = [m.content for m in state["messages"] if isinstance(m, ToolMessage)]
            if told:
                self.model_saw.append(told)
                return {"messages": [AIMessage("done")]}
            tool_calls = [{"name": name, "args": args, "id": f"call_{n}"} for n, (name, args) in enumerate(calls)]
            return {"messages": [AIMessage("", tool_calls=tool_calls)]}

        options.setdefault("needs_approval", {"refund_order"})
        builder = StateGraph(MessagesState)
        builder.add_node("agent", model)
        builder.add_node(
            "tools", ApprovalToolNode([refund_order, lookup_order], client=client, channel="payments", **options)
        )
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", tools_condition)
        builder.add_edge("tools", "agent")
        return builder.compile(checkpointer=InMemorySaver() if checkpointer is None else checkpointer)


def ask(text: str = "refund o-1") -> dict[str, Any]:
    return {"messages": [HumanMessage(text)]}


def test_it_runs_an_edited_call_once_with_the_edited_arguments_and_tells_the_model(client, console: FakeConsole):
    shop = Shop()
    edited = {**REFUND, "amount_cents": 3_000}
    console.approves_while_waiting(edit=edited)
    invoke_with_approvals(shop.graph(client, [("refund_order", REFUND)]), ask(), THREAD, client=client)

    assert shop.refunds == [edited]
    request = console.only()
    assert (request.key, request.execution, request.result) == (
        "langgraph:t-1:call_0",
        "succeeded",
        '{"refunded_cents": 3000}',
    )
    # The edit must fit the tool's own argument schema.
    assert request.body["schema"]["required"] == ["order_id", "amount_cents"]
    ((told,),) = shop.model_saw
    assert told.startswith('{"refunded_cents": 3000}') and "A reviewer edited the arguments" in told


def test_it_tells_the_model_a_rejection_with_the_comment_and_runs_nothing(client, console: FakeConsole):
    shop = Shop()
    console.rejects_while_waiting(comment="Ask for a photo first.")
    invoke_with_approvals(shop.graph(client, [("refund_order", REFUND)]), ask(), THREAD, client=client)

    assert shop.refunds == [] and console.calls("POST", "/consume") == 0
    ((told,),) = shop.model_saw
    assert "rejected" in told and "Ask for a photo first." in told and "did not run" in told


def test_an_expired_request_runs_nothing(client, console: FakeConsole):
    shop = Shop()
    console.reviewer = lambda request: console.expire(request.id)
    invoke_with_approvals(shop.graph(client, [("refund_order", REFUND)]), ask(), THREAD, client=client)
    assert shop.refunds == [] and console.calls("POST", "/consume") == 0
    assert "in time" in shop.model_saw[0][0]


def test_it_asks_only_for_the_calls_that_need_approval_and_runs_the_others_once_decided(client, console):
    shop = Shop()
    graph = shop.graph(client, [("lookup_order", {"order_id": "o-1"}), ("refund_order", REFUND)])
    stopped = graph.invoke(ask(), THREAD)

    # The graph waits in an interrupt that names the request; nothing ran meanwhile, not even the lookup.
    (waiting,) = stopped["__interrupt__"]
    assert [r["request_id"] for r in waiting.value[INTERRUPT_KEY]] == [console.only().id]
    assert shop.lookups == [] and shop.refunds == []
    console.approve(console.only().id)
    invoke_with_approvals(graph, ask(), THREAD, client=client)
    assert shop.lookups == ["o-1"] and shop.refunds == [REFUND]
    assert [r.action for r in console.requests.values()] == ["refund_order"]


def test_a_resume_before_the_decision_only_waits_again(client, console: FakeConsole):
    shop = Shop()
    graph = shop.graph(client, [("refund_order", REFUND)])
    graph.invoke(ask(), THREAD)
    # Whatever the resume value says, the node asks the console: still pending, so it stops again.
    again = graph.invoke(Command(resume={"approved": True, "arguments": {**REFUND, "amount_cents": 1}}), THREAD)
    assert again["__interrupt__"] and shop.refunds == [] and console.calls("POST", "/consume") == 0
    console.approve(console.only().id)
    invoke_with_approvals(graph, ask(), THREAD, client=client)
    assert shop.refunds == [REFUND]


def test_a_call_whose_go_was_taken_before_is_not_run_again(client, console: FakeConsole):
    shop = Shop()
    graph = shop.graph(client, [("refund_order", REFUND)])
    graph.invoke(ask(), THREAD)
    console.approve(console.only().id)
    console.consumed_by_another(console.only())  # an earlier process of this thread died after its go
    invoke_with_approvals(graph, ask(), THREAD, client=client)
    assert shop.refunds == []
    assert "outcome unknown" in shop.model_saw[0][0] and "not run again" in shop.model_saw[0][0]


def test_a_thread_that_lost_its_checkpoint_gets_the_recorded_result_without_running_again(client, console):
    shop = Shop()
    console.approves_while_waiting()
    invoke_with_approvals(shop.graph(client, [("refund_order", REFUND)]), ask(), THREAD, client=client)
    # A new checkpointer: the node runs again for the same thread and call, so the same request.
    invoke_with_approvals(shop.graph(client, [("refund_order", REFUND)]), ask(), THREAD, client=client)
    assert shop.refunds == [REFUND] and len(console.requests) == 1
    assert shop.model_saw == [['{"refunded_cents": 5000}'], ['{"refunded_cents": 5000}']]


def test_a_tool_that_fails_is_reported_as_failed_and_not_run_again(client, console: FakeConsole):
    shop = Shop()
    console.approves_while_waiting(edit={**REFUND, "amount_cents": 13})
    graph = shop.graph(client, [("refund_order", REFUND)], handle_tool_errors=True)
    invoke_with_approvals(graph, ask(), THREAD, client=client)
    assert console.only().execution == "failed" and "the payment service is down" in console.only().error
    assert "the payment service is down" in shop.model_saw[0][0]
    # The same call again (a lost checkpoint): its recorded failure, not a second try.
    invoke_with_approvals(shop.graph(client, [("refund_order", REFUND)]), ask(), THREAD, client=client)
    assert "ran before and failed" in shop.model_saw[1][0] and console.calls("POST", "/consume") == 1


def test_a_tool_error_toolnode_lets_through_is_reported_then_raised_and_the_rerun_tells_the_model(client, console):
    shop = Shop()
    console.approves_while_waiting(edit={**REFUND, "amount_cents": 13})
    graph = shop.graph(client, [("refund_order", REFUND)])  # ToolNode's default: only bad arguments are handled
    with pytest.raises(RuntimeError, match="the payment service is down"):
        invoke_with_approvals(graph, ask(), THREAD, client=client)
    assert console.only().execution == "failed"
    invoke_with_approvals(graph, ask(), THREAD, client=client)  # the thread continues at the tools node
    assert "ran before and failed" in shop.model_saw[0][0] and console.calls("POST", "/consume") == 1


def test_on_wait_is_told_where_a_person_decides(client, console: FakeConsole):
    # Issue 24: the example showed the request's API address (`url`), which only the agent's token may read;
    # on_wait now gets the card's address in the console too, as the other adapters' on_wait does.
    shop, told = Shop(), []
    console.approves_while_waiting()

    invoke_with_approvals(
        shop.graph(client, [("refund_order", REFUND)]), ask(), THREAD, client=client, on_wait=told.extend
    )

    (waiting,) = told
    request = console.only()
    assert waiting["request_id"] == request.id and waiting["card_id"] == str(request.card_id)
    assert waiting["card_url"] == f"http://console.test/approvals/{request.card_id}/"
    assert waiting["url"] == f"/api/approval-requests/{request.id}"


def test_a_wrapper_of_its_own_is_refused(client):
    with pytest.raises(TypeError, match="wrap_tool_call"):
        Shop().graph(client, [], wrap_tool_call=lambda request, execute: execute(request))


def test_a_kill_switch_stops_the_graph_with_nothing_run_until_it_is_released(client, console: FakeConsole):
    shop = Shop()
    graph = shop.graph(client, [("refund_order", REFUND)])
    console.approves_while_waiting()
    console.locked_channels.add("payments")
    with pytest.raises(Locked):
        invoke_with_approvals(graph, ask(), THREAD, client=client)
    assert shop.refunds == [] and console.only().execution == "not_started"
    console.locked_channels.clear()
    invoke_with_approvals(graph, ask(), THREAD, client=client)  # the thread continues at the tools node
    assert shop.refunds == [REFUND]


@pytest.mark.parametrize("node_client", ["async", "blocking"])
def test_it_runs_on_asyncio(client, console: FakeConsole, node_client: str):
    # With a blocking client, the node's flows run in a worker thread; the tool, a coroutine of the graph's loop,
    # is run back on that loop.
    shop = Shop()
    edited = {**REFUND, "amount_cents": 100}
    console.approves_while_waiting(edit=edited)

    async def run() -> None:
        transport = httpx.MockTransport(console.handler)
        async with AsyncClient("http://console.test", "tok-alice", transport=transport, backoff=0) as waiter:
            node = waiter if node_client == "async" else client
            graph = shop.graph(node, [("refund_order", REFUND), ("lookup_order", {"order_id": "o-1"})])
            await ainvoke_with_approvals(graph, ask(), THREAD, client=waiter)

    run_coroutine(run())
    assert shop.refunds == [edited] and shop.lookups == ["o-1"] and console.only().execution == "succeeded"
    ((told, looked_up),) = shop.model_saw
    assert "A reviewer edited the arguments" in told and "paid_cents" in looked_up


def test_needs_approval_naming_a_tool_the_node_does_not_have_is_refused(client):
    with pytest.raises(ValueError, match="refund_everything"):
        Shop().graph(client, [], needs_approval={"refund_order", "refund_everything"})


def test_a_graph_without_a_thread_is_refused_before_anything_is_asked(client, console: FakeConsole):
    shop = Shop()
    graph = shop.graph(client, [("refund_order", REFUND)], checkpointer=False)
    with pytest.raises(ValueError, match="thread_id"):
        graph.invoke(ask())
    assert console.seen == [] and shop.refunds == []


def test_an_async_client_in_a_sync_graph_is_refused_before_anything_is_asked(console: FakeConsole):
    shop = Shop()
    client = AsyncClient("http://console.test", "tok-alice", transport=httpx.MockTransport(console.handler))
    with pytest.raises(TypeError, match="ainvoke"):
        shop.graph(client, [("refund_order", REFUND)]).invoke(ask(), THREAD)
    assert console.seen == [] and shop.refunds == []
