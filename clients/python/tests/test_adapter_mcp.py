"""The MCP gateway against the in-memory console (through httpx.MockTransport) and an in-memory upstream MCP server
(the SDK's MCPServer, connected in-process): a real MCP client calls the gateway's tools, the calls the policy
names become requests, and only approved ones reach the upstream, once. The same with processes, stdio and the
live console: tests/system/test_adapters.py (with the other adapters) and tests/system/test_adapter_mcp.py."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import mcp_types as types
import pydantic
import pytest
from conftest import BASE_URL
from fake_console import FakeConsole, digest_of
from mcp import Client as McpClient
from mcp.client._memory import InMemoryTransport
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError

from hitl_client import AsyncClient
from hitl_client.adapters import mcp_gateway
from hitl_client.adapters.mcp_gateway import (
    DECISION_META,
    IDEMPOTENCY_KEY_META,
    Gateway,
    UnknownTools,
    decline_elicitation,
)

ASKED = {"order_id": "o-42", "amount_cents": 500}


class Refunds:
    """The upstream MCP server: `lookup_order`, and a `refund_order` that counts every refund it makes
    (deliberately not idempotent). While `holding`, a refund is counted and its answer held back."""

    def __init__(self) -> None:
        self.made: list[tuple[str, int]] = []
        self.fail = False
        self.holding = False
        self.released: asyncio.Event | None = None
        self.server = MCPServer("refunds")

        @self.server.tool()
        def lookup_order(order_id: str) -> dict[str, Any]:
            """Look an order up."""
            return {"order_id": order_id, "status": "lost in transit", "amount_cents": 500}

        @self.server.tool()
        async def refund_order(order_id: str, amount_cents: int) -> dict[str, Any]:
            """Refund an order to the customer's card."""
            self.made.append((order_id, amount_cents))
            if self.fail:
                raise ToolError("the card has expired")
            if self.holding:
                assert self.released is not None
                await self.released.wait()
            return {"refund_id": f"r-{len(self.made)}", "order_id": order_id, "amount_cents": amount_cents}


@asynccontextmanager
async def gateway(
    console: FakeConsole, upstream: Any, *, needs_approval: Any = frozenset({"refund_order"}), **options: Any
) -> AsyncIterator[McpClient]:
    """A gateway process, as far as the console and the client can tell (its own counters, a fresh connection),
    and an MCP client connected to it."""
    # A short timeout: a test whose card nobody decides ends with the gateway's answer, not a hang.
    options = {"channel": "payments", "needs_approval": needs_approval, "session": "ticket-42", "timeout": 5, **options}
    transport = httpx.MockTransport(console.handler)
    async with AsyncExitStack() as stack:
        hitl = await stack.enter_async_context(
            AsyncClient(BASE_URL, "tok-alice", transport=transport, backoff=0, max_backoff=0)
        )
        if isinstance(upstream, Refunds):
            upstream = await stack.enter_async_context(McpClient(upstream.server))
        yield await stack.enter_async_context(McpClient(Gateway(upstream, hitl, **options).server))


def call(console: FakeConsole, refunds: Any, *calls: tuple[str, dict[str, Any]], **options: Any) -> list[Any]:
    """Each call through one gateway, in turn; the results (or the MCPError raised)."""

    async def main() -> list[Any]:
        results: list[Any] = []
        async with gateway(console, refunds, **options) as client:
            for name, arguments, *meta in calls:
                try:
                    answer = client.call_tool(name, arguments, meta=meta[0] if meta else None)
                    # A call that waits for a decision nobody makes would hang the suite.
                    results.append(await asyncio.wait_for(answer, 10))
                except MCPError as exc:
                    results.append(exc)
        return results

    return asyncio.run(main())


def text(result: types.CallToolResult) -> str:
    return "\n".join(part.text for part in result.content if isinstance(part, types.TextContent))


def test_an_edited_call_is_forwarded_once_with_the_edited_arguments_and_says_who_edited(console):
    refunds = Refunds()
    edited = {**ASKED, "amount_cents": 300}
    console.approves_while_waiting(edit=edited, by="bob")

    (result,) = call(console, refunds, ("refund_order", ASKED))

    assert refunds.made == [("o-42", 300)]
    request = console.only()
    assert request.action == "refund_order" and request.asked == ASKED
    assert console.consumed_digests == [digest_of(edited)]
    # The card's edits are checked against the upstream tool's inputSchema.
    assert request.body["schema"]["required"] == ["order_id", "amount_cents"]
    assert request.body["schema"]["properties"]["amount_cents"]["type"] == "integer"
    assert request.key.startswith("mcp:ticket-42:") and request.key.endswith(":1")
    assert not result.is_error
    first, *upstream_parts = result.content
    assert first.text.startswith("Edited by bob: amount_cents 500 -> 300.")
    assert "forwarded once, with the edited arguments" in first.text
    assert json.loads(upstream_parts[0].text) == {"refund_id": "r-1", "order_id": "o-42", "amount_cents": 300}
    decision = result.meta[DECISION_META]
    assert decision["decided_by"] == "bob" and decision["edited"] and decision["arguments"] == edited
    # The console recorded the upstream's answer.
    assert request.execution == "succeeded" and request.result["isError"] is False
    assert json.loads(request.result["content"][0]["text"])["amount_cents"] == 300


def test_an_approved_call_says_who_approved_it(console):
    refunds = Refunds()
    console.approves_while_waiting(by="carol")

    (result,) = call(console, refunds, ("refund_order", ASKED))

    assert refunds.made == [("o-42", 500)]
    assert text(result).startswith("Approved by carol. refund_order was forwarded once.")


def test_a_rejected_call_is_an_error_result_with_the_comment_and_forwards_nothing(console):
    refunds = Refunds()
    console.rejects_while_waiting(comment="The parcel was delivered.", by="bob")

    (result,) = call(console, refunds, ("refund_order", ASKED))

    assert refunds.made == [] and console.consumed_digests == []
    assert result.is_error
    assert text(result) == (
        "Rejected by bob (reason: policy): refund_order was not run, nothing was forwarded. "
        "Their comment: The parcel was delivered."
    )
    # The same as data, as for an approved call (docs/external-agents.md): nothing forwarded.
    assert result.meta[DECISION_META] == {
        "request_id": console.only().id,
        "status": "rejected",
        "decided_by": "bob",
        "edited": False,
        "comment": "The parcel was delivered.",
        "reason": "policy",
        "forwarded": False,
        "arguments": None,
    }


def test_an_expired_request_is_an_error_result_and_forwards_nothing(console):
    refunds = Refunds()
    console.reviewer = lambda request: console.expire(request.id)

    (result,) = call(console, refunds, ("refund_order", ASKED))

    assert refunds.made == [] and result.is_error and "expired" in text(result)
    decision = result.meta[DECISION_META]
    assert decision["status"] == "expired" and decision["forwarded"] is False and decision["decided_by"] is None


def test_a_tool_the_policy_does_not_name_passes_through_without_a_card(console):
    refunds = Refunds()

    (result,) = call(console, refunds, ("lookup_order", {"order_id": "o-42"}))

    assert console.requests == {} and console.seen == []
    assert not result.is_error
    assert json.loads(text(result)) == {"order_id": "o-42", "status": "lost in transit", "amount_cents": 500}


def test_the_gateway_lists_the_upstream_tools_as_its_own(console):
    async def main():
        async with gateway(console, Refunds()) as client:
            listing = await client.list_tools()
            return listing

    listing = asyncio.run(main())

    assert sorted(tool.name for tool in listing.tools) == ["lookup_order", "refund_order"]
    refund = next(tool for tool in listing.tools if tool.name == "refund_order")
    assert refund.description == "Refund an order to the customer's card."
    assert refund.input_schema["required"] == ["order_id", "amount_cents"]


def test_a_predicate_asks_for_the_calls_it_names_only(console):
    refunds = Refunds()
    console.approves_while_waiting()

    def large_refunds(tool: str, arguments: dict[str, Any]) -> bool:
        return tool == "refund_order" and arguments["amount_cents"] > 1_000

    small, large = call(
        console,
        refunds,
        ("refund_order", ASKED),
        ("refund_order", {"order_id": "o-43", "amount_cents": 5_000}),
        needs_approval=large_refunds,
    )

    assert refunds.made == [("o-42", 500), ("o-43", 5_000)]
    assert [r.asked for r in console.requests.values()] == [{"order_id": "o-43", "amount_cents": 5_000}]
    assert not text(small).startswith("Approved") and text(large).startswith("Approved by bob")


def test_a_predicate_that_fails_asks_a_person(console):
    refunds = Refunds()
    console.rejects_while_waiting(comment="no")

    def broken(tool: str, arguments: dict[str, Any]) -> bool:
        raise KeyError("amount")

    (result,) = call(console, refunds, ("refund_order", ASKED), needs_approval=broken)

    assert refunds.made == [] and len(console.requests) == 1 and result.is_error


def test_a_call_whose_go_a_dead_gateway_took_is_not_forwarded_again_by_the_next_one(console):
    refunds = Refunds()
    console.approves_while_waiting()
    refunds.holding = True

    async def dies_while_the_upstream_refunds():
        refunds.released = asyncio.Event()
        async with gateway(console, refunds) as client:
            task = asyncio.ensure_future(client.call_tool("refund_order", ASKED))
            while not refunds.made:
                await asyncio.sleep(0.01)
            # The refund was made, its answer not yet back: the gateway goes away (its task with it).
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(dies_while_the_upstream_refunds())
    assert refunds.made == [("o-42", 500)] and console.only().execution == "pending"

    refunds.holding = False
    (result,) = call(console, refunds, ("refund_order", ASKED))

    assert refunds.made == [("o-42", 500)]  # not again
    assert console.calls("POST", "/consume") == 1 and len(console.requests) == 1
    assert result.is_error
    assert text(result).startswith("Not forwarded again: refund_order (request ")
    assert "no outcome was reported: it may or may not have run" in text(result)


def test_a_restarted_gateway_answers_a_retried_call_with_its_recorded_result(console):
    refunds = Refunds()
    console.approves_while_waiting(by="bob")
    (first,) = call(console, refunds, ("refund_order", ASKED))

    (again,) = call(console, refunds, ("refund_order", ASKED))

    assert refunds.made == [("o-42", 500)] and console.calls("POST", "/consume") == 1
    note, *recorded = again.content
    assert note.text == f"refund_order was done before (request {console.only().id}); it is not forwarded again. " + (
        "Its recorded result:"
    )
    assert recorded == first.content[1:]
    assert again.meta[DECISION_META]["forwarded"] is False


def test_an_identical_call_after_a_settled_one_in_the_same_session_is_a_new_card(console):
    refunds = Refunds()
    console.approves_while_waiting()

    call(console, refunds, ("refund_order", ASKED), ("refund_order", ASKED))

    assert refunds.made == [("o-42", 500), ("o-42", 500)]
    keys = sorted(request.key for request in console.requests.values())
    assert [key.rsplit(":", 1)[1] for key in keys] == ["1", "2"]
    # One session, one external run on the console.
    assert len({request.run_id for request in console.requests.values()}) == 1


def test_identical_calls_at_the_same_time_are_one_request_and_one_refund(console):
    refunds = Refunds()
    console.approves_while_waiting()

    async def main():
        async with gateway(console, refunds) as client:
            results = await asyncio.gather(*(client.call_tool("refund_order", ASKED) for _ in range(2)))
            return results

    first, second = asyncio.run(main())

    assert refunds.made == [("o-42", 500)] and len(console.requests) == 1
    texts = sorted([text(first), text(second)])
    assert texts[0].startswith("Approved by bob") and texts[1].startswith("refund_order was done before")


def test_a_key_in_meta_is_the_idempotency_key(console):
    refunds = Refunds()
    console.approves_while_waiting()
    key = {IDEMPOTENCY_KEY_META: "ticket-42/refund-1"}
    call(console, refunds, ("refund_order", ASKED, key))
    assert console.only().key == "ticket-42/refund-1"

    # Another gateway session, the same key: the same call, not forwarded again.
    (again,) = call(console, refunds, ("refund_order", ASKED, key), session="another")
    # The same key for other arguments: refused, nothing forwarded.
    (other,) = call(console, refunds, ("refund_order", {**ASKED, "amount_cents": 900}, key))

    assert refunds.made == [("o-42", 500)] and len(console.requests) == 1
    assert text(again).startswith("refund_order was done before")
    assert other.is_error and "409 conflict" in text(other)


@pytest.mark.parametrize("key", ["", "k" * 201, 42])
def test_a_bad_key_in_meta_is_refused_and_nothing_is_asked_or_forwarded(console, key):
    refunds = Refunds()
    console.approves_while_waiting()

    (result,) = call(console, refunds, ("refund_order", ASKED, {IDEMPOTENCY_KEY_META: key}))

    assert result.is_error and "must be a string of 1 to 200 characters" in text(result)
    assert console.requests == {} and refunds.made == []


def test_a_kill_switch_stops_the_call_and_the_same_call_after_its_release_runs_once(console):
    refunds = Refunds()
    console.approves_while_waiting()
    console.locked_channels.add("payments")
    (locked,) = call(console, refunds, ("refund_order", ASKED))
    assert locked.is_error and "kill switch" in text(locked)
    assert refunds.made == [] and console.only().execution == "not_started"

    console.locked_channels.clear()
    (result,) = call(console, refunds, ("refund_order", ASKED))

    assert refunds.made == [("o-42", 500)] and len(console.requests) == 1
    assert text(result).startswith("Approved by bob")


def test_in_one_gateway_a_call_stopped_by_the_kill_switch_is_continued_by_the_next_identical_one(console):
    refunds = Refunds()
    console.approves_while_waiting()
    console.locked_channels.add("payments")

    def unlock_after_first_refusal(request):
        if console.calls("POST", "/consume") > 1:
            console.locked_channels.clear()

    console.before_consume = unlock_after_first_refusal

    locked, result = call(console, refunds, ("refund_order", ASKED), ("refund_order", ASKED))

    assert locked.is_error and not result.is_error
    # Not settled, so the second call had the first one's key: one request, one refund.
    assert refunds.made == [("o-42", 500)] and len(console.requests) == 1


def test_a_wait_that_times_out_is_continued_by_the_same_call_once_decided(console):
    refunds = Refunds()

    async def main():
        async with gateway(console, refunds, timeout=0.01, poll=1) as client:
            waited = await client.call_tool("refund_order", ASKED)
            console.approve(console.only().id)
            return waited, await client.call_tool("refund_order", ASKED)

    waited, result = asyncio.run(main())

    assert waited.is_error and "was not decided within" in text(waited)
    # Not settled: the same call after it had the same key, and ran the request a person approved, once.
    assert refunds.made == [("o-42", 500)] and len(console.requests) == 1
    assert text(result).startswith("Approved by bob")


def test_an_upstream_error_result_is_recorded_as_failed_and_not_forwarded_again(console):
    refunds = Refunds()
    refunds.fail = True
    console.approves_while_waiting()
    (failed,) = call(console, refunds, ("refund_order", ASKED))

    assert failed.is_error
    assert text(failed).startswith("Approved by bob. refund_order was forwarded once. The upstream answered an error.")
    assert "the card has expired" in text(failed)
    assert console.only().execution == "failed" and "the card has expired" in console.only().error

    (again,) = call(console, refunds, ("refund_order", ASKED))

    assert refunds.made == [("o-42", 500)]
    assert again.is_error and "ran before and failed" in text(again)


class LostUpstream:
    """An upstream whose connection breaks while a call is on its way: it may or may not have run."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.tool = types.Tool(name="refund_order", input_schema={"type": "object"})

    async def list_tools(self, cursor: str | None = None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[self.tool])

    async def call_tool(self, name: str, arguments: dict[str, Any], meta: Any = None) -> types.CallToolResult:
        self.calls.append(name)
        raise MCPError(types.CONNECTION_CLOSED, "Connection closed")


def test_an_answer_lost_upstream_leaves_the_outcome_unknown_and_is_not_forwarded_again(console):
    upstream = LostUpstream()
    console.approves_while_waiting()
    (lost,) = call(console, upstream, ("refund_order", ASKED))

    assert lost.is_error and "may or may not have run" in text(lost)
    # Not reported as failed: it may have happened; the card says the outcome is unknown.
    assert console.only().execution == "pending" and console.calls("POST", "/result") == 0

    (again,) = call(console, upstream, ("refund_order", ASKED))

    assert upstream.calls == ["refund_order"] and "Not forwarded again" in text(again)


class Confirmation(pydantic.BaseModel):
    confirm: bool


class Eliciting:
    """An upstream whose refund_order asks the user to confirm (MCP elicitation) and refunds only on a yes:
    `asked` counts the confirmations it asked for, `made` the refunds."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.made: list[tuple[str, int]] = []
        self.server = MCPServer("eliciting")

        @self.server.tool()
        async def refund_order(order_id: str, amount_cents: int, ctx: Context) -> dict[str, Any]:
            """Refund an order, once the user confirms."""
            self.asked.append(order_id)
            answer = await ctx.elicit(f"Really refund {amount_cents} on {order_id}?", Confirmation)
            if answer.action != "accept" or not answer.data.confirm:
                raise ToolError(f"the refund was not confirmed ({answer.action})")
            self.made.append((order_id, amount_cents))
            return {"refund_id": "r-1"}


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_an_upstream_that_elicits_input_after_the_go_fails_cleanly_and_is_recorded_as_failed(console, mode):
    # Issue 24: the call failed through the gateway with a raw JSON-RPC error after its approval was consumed.
    # The gateway relays no elicitation: a person approved these arguments, not what the upstream would ask on
    # top of them. Over the current protocol the upstream cannot ask (no back-channel: a protocol error); over
    # the handshake-era one it asks and the gateway declines. Either way the client gets a tool result that
    # says so, and the console records the execution as failed (never "outcome unknown").
    upstream = Eliciting()
    console.approves_while_waiting()

    async def main():
        connection = McpClient(InMemoryTransport(upstream.server), mode=mode, elicitation_callback=decline_elicitation)
        async with connection as client, gateway(console, client) as downstream:
            return await asyncio.wait_for(downstream.call_tool("refund_order", ASKED), 10)

    result = asyncio.run(main())

    assert isinstance(result, types.CallToolResult) and result.is_error, result
    assert upstream.asked == ["o-42"] and upstream.made == []
    assert text(result).startswith("Approved by bob. refund_order was forwarded once.")
    assert result.meta[DECISION_META]["forwarded"] is True
    request = console.only()
    assert request.execution == "failed", request.execution
    if mode == "auto":
        assert "elicitation" in text(result) and "not relayed" in text(result)
        assert "asked for input (elicitation/create)" in request.error, request.error
    else:
        assert "the refund was not confirmed (decline)" in text(result)
        assert "the refund was not confirmed (decline)" in request.error


def test_a_tool_the_upstream_does_not_have_is_a_protocol_error_and_asks_nothing(console):
    refunds = Refunds()

    def everything(tool: str, arguments: dict[str, Any]) -> bool:
        return True

    (error,) = call(console, refunds, ("delete_everything", {}), needs_approval=everything)

    assert isinstance(error, MCPError) and error.code == types.INVALID_PARAMS
    assert "Unknown tool: delete_everything" in error.message
    assert console.requests == {}


def test_a_policy_that_names_a_tool_the_upstream_does_not_have_serves_nothing(console):
    # Issue 24, defect 13: `refund` for `refund_order` would guard nothing and let every refund through.
    refunds = Refunds()
    console.approves_while_waiting()

    results = call(
        console, refunds, ("refund_order", ASKED), ("lookup_order", {"order_id": "o-42"}), needs_approval={"refund"}
    )

    assert refunds.made == [] and console.requests == {}
    for error in results:
        assert isinstance(error, MCPError), error
        assert "refuses to serve: the upstream server has no tool named 'refund' (did you mean 'refund_order'?)" in (
            error.message
        )


def test_verify_names_the_missing_tools_and_what_the_upstream_has(console):
    async def main():
        async with McpClient(Refunds().server) as upstream:
            hitl = AsyncClient(BASE_URL, "tok-alice", transport=httpx.MockTransport(console.handler))
            good = Gateway(upstream, hitl, channel="payments", needs_approval={"refund_order"})
            bad = Gateway(upstream, hitl, channel="payments", needs_approval={"refund_order", "refund_ordr", "x"})
            listed = [tool.name for tool in await good.verify()]
            with pytest.raises(UnknownTools) as raised:
                await bad.verify()
            return listed, raised.value

    listed, error = asyncio.run(main())

    assert sorted(listed) == ["lookup_order", "refund_order"]
    assert error.unknown == ["refund_ordr", "x"] and error.exit_code == 2
    assert str(error).startswith(
        "the upstream server has no tool named 'refund_ordr' (did you mean 'refund_order'?), 'x'; "
        "its tools: lookup_order, refund_order."
    )


def test_a_gateway_that_guards_nothing_starts_only_when_told_to(console):
    hitl = AsyncClient(BASE_URL, "tok-alice", transport=httpx.MockTransport(console.handler))
    with pytest.raises(ValueError, match="would guard nothing"):
        Gateway(object(), hitl, channel="payments", needs_approval=set())

    refunds = Refunds()
    (result,) = call(console, refunds, ("refund_order", ASKED), needs_approval=frozenset(), allow_unguarded=True)

    assert not result.is_error and refunds.made == [("o-42", 500)] and console.requests == {}


def test_each_gateway_has_its_own_session_unless_one_is_named(console):
    # Issue 24: a default session shared by every gateway process of a token gave one conversation the recorded
    # result of another's identical call.
    refunds = Refunds()
    console.approves_while_waiting()

    call(console, refunds, ("refund_order", ASKED), session=None)
    (second,) = call(console, refunds, ("refund_order", ASKED), session=None)

    assert refunds.made == [("o-42", 500), ("o-42", 500)]
    assert text(second).startswith("Approved by bob. refund_order was forwarded once.")
    keys = [request.key for request in console.requests.values()]
    assert len(set(keys)) == 2 and all(re.fullmatch(r"mcp:gw-[0-9a-f]{32}:[0-9a-f]{64}:1", key) for key in keys)


def test_on_a_shadow_channel_nothing_is_forwarded(console):
    refunds = Refunds()
    console.shadow_channels.add("payments")
    console.approves_while_waiting()

    (result,) = call(console, refunds, ("refund_order", ASKED))

    # An error result: the tool's output is not there (a person does it by hand).
    assert refunds.made == [] and result.is_error
    assert "shadow mode" in text(result) and '"amount_cents": 500' in text(result)


def test_without_edits_no_schema_is_sent(console):
    console.approves_while_waiting()

    call(console, Refunds(), ("refund_order", ASKED), edits=False)

    assert "schema" not in console.only().body


def test_the_client_is_told_while_the_gateway_waits_for_a_person(console):
    told: list[str | None] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        told.append(message)

    def approve_on_second_poll(request):
        if console.calls("GET") >= 2:
            console.approve(request.id)

    console.reviewer = approve_on_second_poll

    async def main():
        async with gateway(console, Refunds(), poll=1) as client:
            result = await client.call_tool("refund_order", ASKED, progress_callback=progress)
            return result

    result = asyncio.run(main())

    assert not result.is_error and len(told) == 2
    assert told[0] == (
        f"Waiting for a person's decision on the console: {BASE_URL}/approvals/1/ (card 1, request "
        f"{console.only().id})."
    )


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"session": ""}, "session must be 1 to 100 characters"),
        ({"session": "s" * 101}, "session must be 1 to 100 characters"),
        ({"needs_approval": "refund_order"}, "a collection of tool names"),
    ],
)
def test_bad_options_are_refused(console, options, error):
    hitl = AsyncClient(BASE_URL, "tok-alice", transport=httpx.MockTransport(console.handler))
    arguments = {"channel": "payments", "needs_approval": {"refund_order"}, **options}
    with pytest.raises((ValueError, TypeError), match=error):
        Gateway(object(), hitl, **arguments)


def gateway_command(monkeypatch, capsys, *arguments: str) -> tuple[int, str]:
    """The gateway's command (`main()`, which `python -m hitl_client.adapters.mcp_gateway` runs) in this process, as
    its users start it (no console is asked before it serves: none runs here): its exit code and its stderr. Logging
    starts unconfigured, as in a new process, so that anything the command logs on stderr shows. The command as a
    process of its own: tests/system/test_adapter_mcp.py."""
    monkeypatch.setenv("HITL_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("HITL_TOKEN", "tok-alice")
    monkeypatch.setattr(logging.root, "handlers", [])
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    capsys.readouterr()
    try:
        code = mcp_gateway.main(["--channel", "payments", *arguments])
    except SystemExit as exit_:  # argparse's refusals
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("upstream", "code", "says"),
    [
        ("no-such-mcp-server-command", 1, "could not be started or reached: FileNotFoundError: [Errno 2]"),
        (f"{sys.executable} -c pass", 1, "could not be started or reached: Connection closed."),
        ("http://127.0.0.1:9/mcp", 1, "could not be started or reached: ConnectError"),
        ("", 2, "--upstream is empty"),
        ("'unclosed", 2, "is not a command line: No closing quotation."),
    ],
)
def test_a_bad_upstream_is_one_error_line_and_a_non_zero_exit(monkeypatch, capsys, upstream, code, says):
    # Issue 24: it was a traceback of nested ExceptionGroups.
    returncode, stderr = gateway_command(monkeypatch, capsys, "--upstream", upstream, "--approve", "refund_order")

    assert returncode == code, stderr
    assert stderr.count("\n") == 1, stderr
    assert stderr.startswith("python -m hitl_client.adapters.mcp_gateway: error: ") and says in stderr


def test_the_command_refuses_to_guard_nothing_unless_told_to(monkeypatch, capsys):
    returncode, stderr = gateway_command(monkeypatch, capsys, "--upstream", "whatever")

    assert returncode == 2
    assert "a gateway that guards nothing starts only with --allow-unguarded" in stderr
