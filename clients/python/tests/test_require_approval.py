"""@require_approval against the fake console: asks, waits, consumes, runs once, reports; and never runs an
action twice when the same call is made again after a crash."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import pytest
from fake_console import ProcessDied

from hitl_client import (
    ActionFailed,
    AsyncClient,
    Cancelled,
    ConnectionFailed,
    DigestMismatch,
    Expired,
    Locked,
    OutcomeUnknown,
    Rejected,
    ReportFailed,
    UnexpectedResponse,
    WaitTimeout,
    arguments_digest,
    require_approval,
)


class Payments:
    """The fake payment system the tool moves money in: every refund that really happened is in `refunds`."""

    def __init__(self):
        self.refunds: list[tuple[str, int]] = []
        self.fail_with: BaseException | None = None

    def refund(self, order_id: str, amount_cents: int) -> dict:
        if self.fail_with is not None:
            raise self.fail_with
        self.refunds.append((order_id, amount_cents))
        return {"refund_id": f"r-{len(self.refunds)}", "amount_cents": amount_cents}


@pytest.fixture
def payments():
    return Payments()


@pytest.fixture
def refund(client, payments):
    @require_approval(client, channel="payments", rationale="the parcel arrived late", risk="high")
    def refund(order_id: str, amount_cents: int) -> dict:
        return payments.refund(order_id, amount_cents)

    return refund


def test_it_asks_waits_runs_once_and_reports(refund, console, payments):
    console.approves_while_waiting(by="bob")
    assert refund("o-42", amount_cents=500) == {"refund_id": "r-1", "amount_cents": 500}
    assert payments.refunds == [("o-42", 500)]
    request = console.only()
    assert (request.action, request.channel, request.body["risk"]) == ("refund", "payments", "high")
    assert request.body["arguments"] == {"order_id": "o-42", "amount_cents": 500}
    assert request.execution == "succeeded" and request.result == {"refund_id": "r-1", "amount_cents": 500}
    assert console.calls("POST", "/consume") == 1 and console.calls("POST", "/result") == 1


def test_the_reviewers_edit_is_what_runs(refund, console, payments):
    console.approves_while_waiting(edit={"order_id": "o-42", "amount_cents": 300})
    assert refund("o-42", 500)["amount_cents"] == 300
    assert payments.refunds == [("o-42", 300)]
    # Bound to the edit: the go was taken for the edited arguments' digest, not the asked ones'.
    assert console.consumed_digests == [arguments_digest({"order_id": "o-42", "amount_cents": 300})]
    assert console.only().edited and console.only().execution == "succeeded"


def test_a_rejection_raises_with_the_comment_and_runs_nothing(refund, console, payments):
    console.rejects_while_waiting(comment="Refund only the shipping", reason="policy", by="carol")
    with pytest.raises(Rejected) as raised:
        refund("o-42", 500)
    assert (raised.value.comment, raised.value.reason, raised.value.decided_by) == (
        "Refund only the shipping",
        "policy",
        "carol",
    )
    assert payments.refunds == [] and console.calls("POST", "/consume") == 0


def test_an_expiry_raises_expired_and_runs_nothing(refund, console, payments):
    console.reviewer = lambda request: console.expire(request.id)
    with pytest.raises(Expired):
        refund("o-42", 500)
    assert payments.refunds == [] and console.calls("POST", "/consume") == 0


def test_a_cancellation_raises_cancelled_and_runs_nothing(refund, console, payments):
    console.reviewer = lambda request: console.cancel(request.id)
    with pytest.raises(Cancelled):
        refund("o-42", 500)
    assert payments.refunds == []


def test_a_request_that_expires_before_its_consume_raises_expired(refund, console, payments):
    console.approves_while_waiting()
    console.before_consume = lambda request: console.expire(request.id)
    with pytest.raises(Expired):
        refund("o-42", 500)
    assert payments.refunds == [] and console.only().execution == "not_started"


# -- exactly once, across crashes --------------------------------------------------------------------------


@pytest.mark.parametrize("death", [KeyboardInterrupt(), SystemExit(1), ProcessDied()])
def test_a_process_that_dies_in_the_action_never_runs_it_again(refund, console, payments, death):
    console.approves_while_waiting()
    payments.fail_with = death
    with pytest.raises(type(death)):
        refund("o-42", 500)
    # Nothing was reported: the action may have half-happened, and the receipt says so.
    assert console.only().execution == "pending" and console.calls("POST", "/result") == 0

    payments.fail_with = None  # the restarted process would succeed, if it were let run
    with pytest.raises(OutcomeUnknown) as raised:
        refund("o-42", 500)
    assert payments.refunds == []
    assert raised.value.request.id == console.only().id
    assert console.calls("POST", "/consume") == 1 and len(console.requests) == 1


def test_a_process_that_dies_before_reporting_never_runs_it_again(refund, console, payments):
    console.approves_while_waiting()
    console.fail("POST", "/result", "die")
    with pytest.raises(ProcessDied):
        refund("o-42", 500)
    assert payments.refunds == [("o-42", 500)]  # it did happen, and nobody heard
    assert console.only().execution == "pending"

    with pytest.raises(OutcomeUnknown):
        refund("o-42", 500)
    assert payments.refunds == [("o-42", 500)]


def test_after_a_recorded_result_the_same_call_returns_it_without_running(refund, console, payments):
    console.approves_while_waiting(edit={"order_id": "o-42", "amount_cents": 300})
    first = refund("o-42", 500)
    again = refund("o-42", 500)
    assert again == first == {"refund_id": "r-1", "amount_cents": 300}
    assert payments.refunds == [("o-42", 300)]
    assert console.calls("POST", "/consume") == 1 and console.calls("POST", "/result") == 1


def test_the_same_call_with_a_changed_current_still_returns_the_recorded_result(client, console, payments):
    # The target's state moves once the action has run (the refund shows on the order): a re-run sends another
    # `current` under the same key and must still get the same request back (contract: same key, same action
    # and arguments -> the same request).
    refunded = {"o-42": 0}

    def current(order_id, amount_cents):
        return {"refunded_cents": refunded[order_id]}

    @require_approval(client, channel="payments", rationale="r", current=current)
    def refund(order_id: str, amount_cents: int) -> dict:
        refunded[order_id] += amount_cents
        return payments.refund(order_id, amount_cents)

    console.approves_while_waiting()
    refund("o-42", 500)
    assert refund("o-42", 500) == {"refund_id": "r-1", "amount_cents": 500}
    assert payments.refunds == [("o-42", 500)]
    assert console.only().body["current"] == {"refunded_cents": 0}  # the first request's stands


def test_a_failed_action_is_reported_reraised_and_not_run_again(refund, console, payments):
    console.approves_while_waiting()
    payments.fail_with = ValueError("card expired")
    with pytest.raises(ValueError, match="card expired"):
        refund("o-42", 500)
    assert console.only().execution == "failed" and console.only().error == "ValueError('card expired')"

    payments.fail_with = None
    with pytest.raises(ActionFailed) as raised:
        refund("o-42", 500)
    assert raised.value.error == "ValueError('card expired')"
    assert payments.refunds == []


def test_a_long_error_is_recorded_by_its_start(refund, console, payments):
    console.approves_while_waiting()
    payments.fail_with = RuntimeError("x" * 100_000)
    with pytest.raises(RuntimeError):
        refund("o-42", 500)
    assert console.only().execution == "failed" and len(console.only().error) == 4000


def test_a_consume_already_taken_by_a_twin_process_does_not_run(refund, console, payments):
    console.approves_while_waiting()
    console.before_consume = console.consumed_by_another
    with pytest.raises(OutcomeUnknown):
        refund("o-42", 500)
    assert payments.refunds == [] and console.consumed_digests == []


def test_a_consume_whose_answer_was_lost_is_asked_again_under_its_nonce_and_runs_once(refund, console, payments):
    console.approves_while_waiting()
    console.fail("POST", "/consume", "drop_answer")
    assert refund("o-42", 500) == {"refund_id": "r-1", "amount_cents": 500}
    assert payments.refunds == [("o-42", 500)] and console.only().execution == "succeeded"
    assert console.calls("POST", "/consume") == 2 and len(set(console.nonces)) == 1
    assert console.consumed_digests == [arguments_digest({"order_id": "o-42", "amount_cents": 500})]


def test_a_consume_whose_answers_stay_lost_raises_and_the_rerun_does_not_run_it(refund, console, payments):
    # Every answer lost (the console took the first): the call gives up without running; the re-run, another
    # process with another nonce, cannot tell that nothing ran, so it is left to a person.
    console.approves_while_waiting()
    console.fail("POST", "/consume", "drop_answer", times=10)
    with pytest.raises(ConnectionFailed):
        refund("o-42", 500)
    assert payments.refunds == [] and console.only().execution == "pending"
    with pytest.raises(OutcomeUnknown):
        refund("o-42", 500)
    assert payments.refunds == [] and console.calls("POST", "/consume") == 1 + 4


def test_a_consume_that_never_arrived_is_sent_again_and_runs_once(refund, console, payments):
    console.approves_while_waiting()
    console.fail("POST", "/consume", "drop_request")
    assert refund("o-42", 500) == {"refund_id": "r-1", "amount_cents": 500}
    assert payments.refunds == [("o-42", 500)]
    assert console.calls("POST", "/consume") == 2


def test_a_kill_switch_stops_it_before_the_go_and_a_later_call_runs_once(refund, console, payments):
    console.approves_while_waiting()
    console.locked_channels.add("payments")
    with pytest.raises(Locked):
        refund("o-42", 500)
    assert payments.refunds == [] and console.only().execution == "not_started"

    console.locked_channels.clear()
    assert refund("o-42", 500)["refund_id"] == "r-1"
    assert refund("o-42", 500)["refund_id"] == "r-1"
    assert payments.refunds == [("o-42", 500)] and len(console.requests) == 1


def test_a_shadow_card_never_runs_the_function_and_the_call_returns_the_shadow_result(refund, console, payments):
    console.shadow_channels.add("payments")
    console.approves_while_waiting(edit={"order_id": "o-42", "amount_cents": 300})
    result = refund("o-42", 500)
    expected = {
        "shadow": True,
        "request_id": console.only().id,
        "action": "refund",
        "arguments": {"order_id": "o-42", "amount_cents": 300},  # what the reviewer approved, done by hand
    }
    assert result == expected
    assert refund("o-42", 500) == expected  # a re-run: the same, from what the console recorded
    assert payments.refunds == [] and console.calls("POST", "/result") == 0
    assert console.calls("POST", "/consume") == 1 and console.only().execution == "succeeded"


def test_a_shadow_consume_whose_answer_was_lost_still_never_runs_the_function(refund, console, payments):
    # Asked again under its nonce, the shadow's consume is already done (recorded as shadow): 409, read as such.
    console.shadow_channels.add("payments")
    console.approves_while_waiting()
    console.fail("POST", "/consume", "drop_answer")
    assert refund("o-42", 500)["shadow"] is True
    assert payments.refunds == [] and console.calls("POST", "/consume") == 2


@pytest.mark.parametrize("value", [["r-1", "r-2"], "r-1", 7, None, True])
def test_a_result_of_any_json_value_is_recorded_and_given_back_to_a_rerun(client, console, value):
    calls = []

    @require_approval(client, channel="payments", rationale="r")
    def refund(order_id: str) -> object:
        calls.append(order_id)
        return value

    console.approves_while_waiting()
    assert refund("o-42") == value
    assert console.only().execution == "succeeded" and console.only().result == value
    assert refund("o-42") == value and calls == ["o-42"]


def test_a_wait_that_times_out_is_picked_up_by_the_same_call_later(client, console, payments):
    @require_approval(client, channel="payments", rationale="r", timeout=0)
    def refund(order_id: str, amount_cents: int) -> dict:
        return payments.refund(order_id, amount_cents)

    with pytest.raises(WaitTimeout):
        refund("o-42", 500)
    console.approve(console.only().id)
    assert refund("o-42", 500)["refund_id"] == "r-1"
    assert payments.refunds == [("o-42", 500)] and len(console.requests) == 1


def test_a_console_that_hashes_otherwise_is_refused_and_nothing_runs(refund, console, payments):
    console.ensure_ascii = True  # \u escapes: not the contract's canonical form
    console.approves_while_waiting()
    with pytest.raises(DigestMismatch):
        refund("o-42 café", 500)
    assert payments.refunds == [] and console.only().execution == "not_started"


def test_a_go_for_other_arguments_is_not_run_and_the_receipt_says_so(refund, console, payments):
    console.approves_while_waiting()
    console.go_arguments = {"order_id": "o-42", "amount_cents": 50_000}
    with pytest.raises(UnexpectedResponse):
        refund("o-42", 500)
    assert payments.refunds == []
    assert console.only().execution == "failed" and "did not run it" in console.only().error


# -- what is asked -----------------------------------------------------------------------------------------


def test_the_default_key_is_the_action_and_the_arguments_digest(refund, console):
    console.approves_while_waiting()
    refund("o-42", 500)
    refund(order_id="o-42", amount_cents=500)  # the same call, however it is written
    expected = "refund:" + arguments_digest({"order_id": "o-42", "amount_cents": 500})
    assert [request.key for request in console.requests.values()] == [expected]


def test_other_arguments_are_another_action(refund, console, payments):
    console.approves_while_waiting()
    refund("o-42", 500)
    refund("o-43", 500)
    assert payments.refunds == [("o-42", 500), ("o-43", 500)] and len(console.requests) == 2


def test_key_current_rationale_and_run_are_computed_from_the_call(client, console, payments):
    @require_approval(
        client,
        channel="payments",
        action="payments.refund",
        rationale=lambda order_id, amount_cents, note="": f"refund {amount_cents} on {order_id}",
        current=lambda order_id, amount_cents, note="": {"order_id": order_id, "refunded_cents": 0},
        key=lambda order_id, amount_cents, note="": f"refund-{order_id}",
        run=lambda order_id, amount_cents, note="": "7d8f5a3e-1111-4222-8333-944455556666",
        display={"headline": "order_id", "amount_minor": "amount_cents"},
        expires_in=600,
        on_expiry="escalate",
        callback_url="https://agent.example/hooks/approvals",
    )
    def refund(order_id: str, amount_cents: int, note: str = "") -> dict:
        return payments.refund(order_id, amount_cents)

    console.approves_while_waiting()
    refund("o-42", 500)
    body = console.only().body
    assert body["action"] == "payments.refund" and body["idempotency_key"] == "refund-o-42"
    assert body["rationale"] == "refund 500 on o-42"
    assert body["current"] == {"order_id": "o-42", "refunded_cents": 0}
    assert body["run"] == "7d8f5a3e-1111-4222-8333-944455556666"
    assert body["arguments"] == {"order_id": "o-42", "amount_cents": 500, "note": ""}  # defaults included
    assert (body["expires_in"], body["on_expiry"]) == (600, "escalate")
    assert body["display"] == {"headline": "order_id", "amount_minor": "amount_cents"}
    assert body["callback_url"] == "https://agent.example/hooks/approvals"


def test_the_schema_comes_from_the_type_hints(refund, console):
    pytest.importorskip("pydantic")
    console.approves_while_waiting()
    refund("o-42", 500)
    schema = console.only().body["schema"]
    assert schema["type"] == "object" and schema["required"] == ["order_id", "amount_cents"]
    assert schema["properties"]["amount_cents"]["type"] == "integer"
    assert schema["additionalProperties"] is False


def test_without_pydantic_no_schema_is_sent(client, console, monkeypatch):
    monkeypatch.setitem(sys.modules, "pydantic", None)  # import pydantic raises ImportError

    @require_approval(client, channel="payments", rationale="r")
    def refund(order_id: str, amount_cents: int) -> dict:
        return {}

    console.approves_while_waiting()
    refund("o-42", 500)
    assert "schema" not in console.only().body


def test_schema_false_sends_none_and_a_given_schema_is_sent_as_is(client, console, payments):
    given = {"type": "object", "properties": {"amount_cents": {"type": "integer", "maximum": 1000}}}

    @require_approval(client, channel="payments", rationale="r", schema=False)
    def refund(order_id: str, amount_cents: int) -> dict:
        return {}

    @require_approval(client, channel="payments", rationale="r", schema=given)
    def refund_small(order_id: str, amount_cents: int) -> dict:
        return {}

    console.approves_while_waiting()
    refund("o-42", 500)
    refund_small("o-42", 500)
    first, second = console.requests.values()
    assert "schema" not in first.body and second.body["schema"] == given


def test_keyword_arguments_of_a_var_keyword_function_are_sent_flat(client, console):
    seen = []

    @require_approval(client, channel="payments", rationale="r")
    def send_mail(to: str, **headers: str) -> None:
        seen.append((to, headers))

    console.approves_while_waiting()
    send_mail("a@example.com", subject="hi")
    assert console.only().body["arguments"] == {"to": "a@example.com", "subject": "hi"}
    assert seen == [("a@example.com", {"subject": "hi"})]


def test_a_function_that_cannot_take_keyword_arguments_is_refused_at_decoration(client):
    with pytest.raises(TypeError, match="by name"):

        @require_approval(client, channel="payments", rationale="r")
        def refund(order_id, /, amount_cents): ...

    with pytest.raises(TypeError, match="by name"):

        @require_approval(client, channel="payments", rationale="r")
        def refund_many(*order_ids): ...


def test_a_client_of_the_other_kind_is_refused_at_decoration(client):
    with pytest.raises(TypeError, match="AsyncClient"):

        @require_approval(client, channel="payments", rationale="r")
        async def refund(order_id: str) -> None: ...

    async_client = AsyncClient("http://console.test", "t")
    with pytest.raises(TypeError, match="needs a Client"):

        @require_approval(async_client, channel="payments", rationale="r")
        def refund_sync(order_id: str) -> None: ...

    asyncio.run(async_client.aclose())


def test_arguments_that_are_not_json_are_refused_before_anything_is_sent(refund, console):
    with pytest.raises(TypeError):
        refund(object(), 500)
    assert console.seen == []


def test_an_edit_the_function_cannot_take_is_refused_before_the_go(refund, console, payments):
    console.approves_while_waiting(edit={"order_id": "o-42", "amount_cents": 300, "reason": "extra"})
    with pytest.raises(TypeError, match="nothing was consumed"):
        refund("o-42", 500)
    assert payments.refunds == [] and console.only().execution == "not_started"


def test_an_action_without_review_still_runs_once_through_the_receipt(client, console, payments):
    console.unreviewed_channels.add("payments")

    @require_approval(client, channel="payments", rationale="r", approval="never")
    def refund(order_id: str, amount_cents: int) -> dict:
        return payments.refund(order_id, amount_cents)

    refund("o-42", 500)
    refund("o-42", 500)
    assert payments.refunds == [("o-42", 500)] and console.only().card_id is None


# -- what is recorded --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Receipt:
    refund_id: str
    amount_cents: int


def test_a_result_that_is_a_dataclass_is_recorded_as_its_json(client, console):
    @require_approval(client, channel="payments", rationale="r")
    def refund(order_id: str) -> Receipt:
        return Receipt("r-1", 500)

    console.approves_while_waiting()
    assert refund("o-42") == Receipt("r-1", 500)  # this call gets the value itself
    assert console.only().result == {"refund_id": "r-1", "amount_cents": 500}
    assert refund("o-42") == {"refund_id": "r-1", "amount_cents": 500}  # a re-run, what was recorded


def test_a_result_that_is_not_json_is_recorded_as_its_repr(client, console):
    @require_approval(client, channel="payments", rationale="r")
    def refund(order_id: str) -> object:
        return {1, 2}

    console.approves_while_waiting()
    assert refund("o-42") == {1, 2}
    assert console.only().execution == "succeeded" and console.only().result == "{1, 2}"


def test_a_result_the_console_will_not_take_raises_report_failed_with_the_result(refund, console, payments):
    console.approves_while_waiting()
    console.fail("POST", "/result", 422)
    with pytest.raises(ReportFailed) as raised:
        refund("o-42", 500)
    assert raised.value.result == {"refund_id": "r-1", "amount_cents": 500}
    assert payments.refunds == [("o-42", 500)] and console.only().execution == "pending"
