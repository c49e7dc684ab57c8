"""Undo (docs/external-agents.md, "Undo"): a success declares what undoes it (`report(compensation=)`, the
decorator's `compensate=`); once a person undoes the run and approves its compensations, `pending_compensations`
lists them in undo order and `run_compensations` runs each once through the same consume as any request."""

from __future__ import annotations

import httpx
import pytest
from conftest import BASE_URL, run_coroutine
from fake_console import FakeConsole

from hitl_client import (
    AsyncClient,
    ExecutionStatus,
    Invalid,
    require_approval,
    run_compensations,
    run_compensations_async,
)
from hitl_client.client import result_body


def refunds(client, console: FakeConsole):
    """A decorated refund that declares its void as what undoes it, approved by the console's reviewer."""
    console.approves_while_waiting()

    @require_approval(
        client,
        channel="payments",
        rationale="late parcel",
        compensate=lambda result, order_id, **_: {"action": "void_refund", "arguments": {"refund_id": result["id"]}},
    )
    def refund(order_id: str, amount_cents: int) -> dict:
        return {"id": f"re_{order_id}"}

    return refund


def test_the_decorator_declares_what_undoes_a_call_with_its_result(client, console):
    refund = refunds(client, console)
    assert refund(order_id="o-1", amount_cents=500) == {"id": "re_o-1"}
    reported = console.only().reported
    assert reported == {
        "ok": True,
        "result": {"id": "re_o-1"},
        "compensation": {"action": "void_refund", "arguments": {"refund_id": "re_o-1"}},
    }


def test_run_compensations_runs_each_approved_one_once_in_undo_order(client, console):
    refund = refunds(client, console)
    refund(order_id="o-1", amount_cents=500)
    refund(order_id="o-2", amount_cents=700)
    run_id = next(iter(console.requests.values())).run_id
    for request in console.requests.values():
        request.run_id = run_id  # one session
    opened = console.undo(run_id)
    voided: list[str] = []

    def void_refund(refund_id: str) -> dict:
        voided.append(refund_id)
        return {"voided": refund_id}

    # Nothing approved yet: nothing runs.
    assert client.pending_compensations(run_id) == []
    assert run_compensations(client, {"void_refund": void_refund}) == {}
    for request in opened:
        console.approve(request.id)
    pending = client.pending_compensations(run_id)
    assert [(p.action, p.undo_order, p.compensates) for p in pending] == [
        ("void_refund", 0, opened[0].compensates),
        ("void_refund", 1, opened[1].compensates),
    ]
    outcomes = run_compensations(client, {"void_refund": void_refund}, run_id=run_id)
    assert voided == ["re_o-2", "re_o-1"]
    assert [o.value for o in outcomes.values()] == [{"voided": "re_o-2"}, {"voided": "re_o-1"}]
    assert all(console.requests[i].execution == "succeeded" for i in outcomes)
    # Consumed: they are no longer pending, and a second pass runs nothing.
    assert run_compensations(client, {"void_refund": void_refund}) == {}
    assert voided == ["re_o-2", "re_o-1"]


def test_a_compensation_without_a_handler_runs_nothing(client, console):
    refund = refunds(client, console)
    refund(order_id="o-1", amount_cents=500)
    (opened,) = console.undo(console.only().run_id)
    console.approve(opened.id)
    with pytest.raises(ValueError, match="void_refund"):
        run_compensations(client, {"other": lambda: None})
    assert console.requests[opened.id].execution == "not_started"


def test_a_failed_compensation_is_reported_and_raised(client, console):
    refund = refunds(client, console)
    refund(order_id="o-1", amount_cents=500)
    (opened,) = console.undo(console.only().run_id)
    console.approve(opened.id)

    def void_refund(refund_id: str) -> dict:
        raise RuntimeError("the bank said no")

    with pytest.raises(RuntimeError):
        run_compensations(client, {"void_refund": void_refund})
    assert console.requests[opened.id].execution == "failed"


def test_the_async_twin(console):
    console.approves_while_waiting()
    calls: list[str] = []

    async def scenario(client: AsyncClient):
        @require_approval(
            client,
            channel="payments",
            rationale="late parcel",
            compensate=lambda result, **_: {"action": "void_refund", "arguments": {"refund_id": result["id"]}},
        )
        async def refund(order_id: str) -> dict:
            return {"id": f"re_{order_id}"}

        await refund(order_id="o-1")
        (opened,) = console.undo(console.only().run_id)
        console.approve(opened.id)

        async def void_refund(refund_id: str) -> dict:
            calls.append(refund_id)
            return {"voided": refund_id}

        assert [p.id for p in await client.pending_compensations()] == [opened.id]
        outcomes = await run_compensations_async(client, {"void_refund": void_refund})
        return outcomes, await client.get(opened.id)

    async def main():
        transport = httpx.MockTransport(console.handler)
        async with AsyncClient(BASE_URL, "tok-alice", transport=transport, backoff=0, max_backoff=0) as client:
            return await scenario(client)

    outcomes, request = run_coroutine(main())
    assert calls == ["re_o-1"] and request.execution.status is ExecutionStatus.SUCCEEDED
    assert request.compensates is not None and request.undo_order == 0
    assert list(outcomes) == [request.id]


def test_report_takes_a_compensation_of_a_success_only(client, console):
    with pytest.raises(ValueError):
        result_body(False, error="no", compensation={"action": "void", "arguments": {}})
    with pytest.raises(ValueError):
        result_body(True, {}, compensation={"action": "void"})
    with pytest.raises(TypeError):
        result_body(True, {}, compensation={"action": "void", "arguments": [1]})
    assert result_body(True, 1, compensation={"action": "void", "arguments": {"a": 1}}) == {
        "ok": True,
        "result": 1,
        "compensation": {"action": "void", "arguments": {"a": 1}},
    }
    # The console refuses a compensation of a compensation: the client surfaces it.
    refund = refunds(client, console)
    refund(order_id="o-1", amount_cents=500)
    (opened,) = console.undo(console.only().run_id)
    console.approve(opened.id)
    client.consume(opened.id, client.get(opened.id).arguments_digest or "")
    with pytest.raises(Invalid):
        client.report(opened.id, True, {}, compensation={"action": "again", "arguments": {}})
