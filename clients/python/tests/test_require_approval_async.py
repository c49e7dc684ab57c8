"""The same guarantees with AsyncClient and coroutine functions (the flows are shared; these check the async
driver: awaiting the function, cancellation, sleeping between retries)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import BASE_URL
from fake_console import FakeConsole

from hitl_client import (
    ActionFailed,
    AlreadyConsumed,
    AsyncClient,
    ExecutionStatus,
    Locked,
    OutcomeUnknown,
    Rejected,
    RequestStatus,
    arguments_digest,
    require_approval,
)

REFUND = {"order_id": "o-42", "amount_cents": 500}


def run_with_client(console: FakeConsole, scenario):
    """Runs `scenario(client)` in a fresh event loop with an AsyncClient on the fake console."""

    async def main():
        transport = httpx.MockTransport(console.handler)
        async with AsyncClient(BASE_URL, "tok-alice", transport=transport, backoff=0, max_backoff=0) as client:
            return await scenario(client)

    return asyncio.run(main())


def test_the_calls_round_trip(console):
    async def scenario(client):
        request = await client.request_approval(
            "payments", "refund", REFUND, idempotency_key="k", rationale="late", current={"refunded_cents": 0}
        )
        console.approves_while_waiting(edit={**REFUND, "amount_cents": 300})
        decision = await client.wait(request.id, timeout=60)
        go = await client.consume(request.id, arguments_digest(decision.arguments))
        execution = await client.report(request.id, ok=True, result={"refund_id": "r-1"})
        return decision, go, execution, await client.get(request.id)

    decision, go, execution, latest = run_with_client(console, scenario)
    assert decision.status is RequestStatus.APPROVED and decision.edited
    assert go.arguments == {**REFUND, "amount_cents": 300}
    assert execution.status is ExecutionStatus.SUCCEEDED and latest.execution.result == {"refund_id": "r-1"}


def test_a_second_consume_is_refused(console):
    async def scenario(client):
        request = await client.request_approval("payments", "refund", REFUND, idempotency_key="k", rationale="r")
        console.approve(request.id)
        await client.consume(request.id, arguments_digest(REFUND))
        await client.consume(request.id, arguments_digest(REFUND))

    with pytest.raises(AlreadyConsumed):
        run_with_client(console, scenario)


class Payments:
    def __init__(self):
        self.refunds: list[tuple[str, int]] = []
        self.fail_with: BaseException | None = None

    async def refund(self, order_id: str, amount_cents: int) -> dict:
        await asyncio.sleep(0)  # a real await inside the action
        if self.fail_with is not None:
            raise self.fail_with
        self.refunds.append((order_id, amount_cents))
        return {"refund_id": f"r-{len(self.refunds)}", "amount_cents": amount_cents}


def call_refund(console: FakeConsole, payments: Payments, *args, **kwargs):
    """Decorates an async refund tool with a fresh AsyncClient (a restarted process) and calls it once."""

    async def scenario(client):
        @require_approval(client, channel="payments", rationale="late parcel")
        async def refund(order_id: str, amount_cents: int) -> dict:
            return await payments.refund(order_id, amount_cents)

        return await refund(*args, **kwargs)

    return run_with_client(console, scenario)


@pytest.fixture
def payments():
    return Payments()


def test_it_runs_the_edited_arguments_once_and_returns_the_result(console, payments):
    console.approves_while_waiting(edit={"order_id": "o-42", "amount_cents": 300})
    assert call_refund(console, payments, "o-42", 500) == {"refund_id": "r-1", "amount_cents": 300}
    assert call_refund(console, payments, "o-42", 500) == {"refund_id": "r-1", "amount_cents": 300}
    assert payments.refunds == [("o-42", 300)]
    assert console.calls("POST", "/consume") == 1 and console.only().execution == "succeeded"


def test_a_rejection_raises_and_runs_nothing(console, payments):
    console.rejects_while_waiting(comment="not this one", reason="fraud")
    with pytest.raises(Rejected) as raised:
        call_refund(console, payments, "o-42", 500)
    assert (raised.value.comment, raised.value.reason) == ("not this one", "fraud")
    assert payments.refunds == []


@pytest.mark.parametrize("death", [KeyboardInterrupt(), asyncio.CancelledError()])
def test_a_task_cancelled_or_killed_in_the_action_never_runs_it_again(console, payments, death):
    console.approves_while_waiting()
    payments.fail_with = death
    with pytest.raises(type(death)):
        call_refund(console, payments, "o-42", 500)
    assert console.only().execution == "pending" and console.calls("POST", "/result") == 0

    payments.fail_with = None
    with pytest.raises(OutcomeUnknown):
        call_refund(console, payments, "o-42", 500)
    assert payments.refunds == []


def test_a_failure_is_recorded_and_a_rerun_raises_action_failed(console, payments):
    console.approves_while_waiting()
    payments.fail_with = RuntimeError("gateway said no")
    with pytest.raises(RuntimeError):
        call_refund(console, payments, "o-42", 500)
    payments.fail_with = None
    with pytest.raises(ActionFailed, match="gateway said no"):
        call_refund(console, payments, "o-42", 500)
    assert payments.refunds == []


def test_a_consume_whose_answer_was_lost_is_asked_again_under_its_nonce_and_runs_once(console, payments):
    console.approves_while_waiting()
    console.fail("POST", "/consume", "drop_answer")
    assert call_refund(console, payments, "o-42", 500)["refund_id"] == "r-1"
    assert payments.refunds == [("o-42", 500)] and console.calls("POST", "/consume") == 2
    assert len(set(console.nonces)) == 1 and len(console.consumed_digests) == 1


def test_a_shadow_card_never_runs_the_coroutine(console, payments):
    console.shadow_channels.add("payments")
    console.approves_while_waiting()
    result = call_refund(console, payments, "o-42", 500)
    assert result == {"shadow": True, "request_id": console.only().id, "action": "refund", "arguments": REFUND}
    assert call_refund(console, payments, "o-42", 500) == result
    assert payments.refunds == [] and console.calls("POST", "/result") == 0


def test_a_consume_that_never_arrived_is_sent_again_and_runs_once(console, payments):
    console.approves_while_waiting()
    console.fail("POST", "/consume", "drop_request")
    assert call_refund(console, payments, "o-42", 500)["refund_id"] == "r-1"
    assert payments.refunds == [("o-42", 500)] and console.calls("POST", "/consume") == 2


def test_a_kill_switch_raises_locked_and_nothing_runs(console, payments):
    console.approves_while_waiting()
    console.locked_channels.add("payments")
    with pytest.raises(Locked):
        call_refund(console, payments, "o-42", 500)
    assert payments.refunds == [] and console.only().execution == "not_started"


def test_retries_sleep_through_the_event_loop(console, payments):
    console.approves_while_waiting()
    console.fail("POST", "/api/approval-requests", 503)
    console.fail("POST", "/result", "drop_answer")
    assert call_refund(console, payments, "o-42", 500)["refund_id"] == "r-1"
    assert console.calls("POST", "/api/approval-requests") == 2 and console.calls("POST", "/result") == 2
    assert console.only().execution == "succeeded"
