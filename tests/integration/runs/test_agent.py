"""The durable agent loop (runs.agent), driven in-process by the scripted chat model of tests.agent_workflows."""

from __future__ import annotations

import json

import pytest

import tests.agent_workflows  # noqa: F401 - registers test_agent
from approvals.errors import InvalidDecision
from approvals.models import Approval
from core.models import Channel
from demo.models import SandboxCall
from demo.workflows import OrderRefund, _needs_a_person
from jobs.models import DeadLetter
from runs import submission
from runs.models import Run, Step
from runs.workflow import Retryable
from tests.conftest import approves_every_channel
from tests.engine_helpers import drive
from tests.openai_stub import error, text, tool_calls


@pytest.fixture
def agent(db, settings):
    settings.AGENT_MODEL = "tests.agent_workflows.ScriptedChat"
    Channel.objects.get_or_create(name="payments")


@pytest.fixture
def bob(bob, agent):
    """The reviewer, with approve_channel on every channel of these tests (Approval.decide checks it)."""
    return approves_every_channel(bob)


def submit(*turns, message="my order never came") -> Run:
    return submission.submit(workflow="test_agent", input={"message": message, "script": list(turns)})[0]


def calls(run: Run, system: str) -> int:
    return SandboxCall.objects.filter(run_id=run.id, system=system).count()


def steps(run: Run) -> list[tuple[str, str, str]]:
    return list(run.steps.order_by("seq").values_list("name", "kind", "status"))


def tool_messages(run: Run, turn: int) -> list[dict]:
    """What the model was told about tool results before `turn` (rebuilt from the recorded steps)."""
    sent = []
    for step in run.steps.order_by("seq"):
        if step.name.startswith("helper.turn") and step.name.count(".") == 2 and step.kind != "compute":
            sent.append(step.output)
    return sent


def test_a_loop_calls_tools_until_it_answers_each_step_checkpointed(agent):
    run = drive(
        submit(
            {"calls": [["lookup_customer", {"customer_id": "c1"}]], "say": "Let me look."},
            {"calls": [["note", {"text": "customer asked"}], ["pay", {"customer_id": "c1", "amount_cents": 500}]]},
            {"answer": "Refunded 5.00."},
        )
    )
    assert run.status == Run.Status.SUCCEEDED, run.error
    assert steps(run) == [
        ("helper.turn1", "compute", "done"),
        ("helper.turn1.1.lookup_customer", "read", "done"),
        ("helper.turn2", "compute", "done"),
        ("helper.turn2.1.note", "effect", "done"),
        ("helper.turn2.2.pay", "effect", "done"),
        ("helper.turn3", "compute", "done"),
        ("helper", "compute", "done"),
        ("after", "compute", "done"),
    ]
    assert run.result == {"agent_said": "Refunded 5.00."}
    assert (calls(run, "model"), calls(run, "payments"), calls(run, "crm")) == (3, 1, 1)
    turn = run.steps.get(name="helper.turn2")
    assert turn.tokens_in > 0 and turn.cost > 0
    assert turn.prompt_version == "test-1" and len(turn.tools_version) == 16
    assert run.steps.get(name="helper.turn1.1.lookup_customer").output["result"]["name"] == "Ada"


def test_the_model_sees_every_tool_result_in_order(agent, settings):
    seen = []

    class Spy(tests.agent_workflows.ScriptedChat):
        def chat(self, messages, tools):
            seen.append((messages, tools))
            return super().chat(messages, tools)

    tests.agent_workflows.Spy = Spy
    settings.AGENT_MODEL = "tests.agent_workflows.Spy"
    drive(submit({"calls": [["lookup_customer", {"customer_id": "c1"}]]}, {"answer": "ok"}))
    messages, tools = seen[1]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[3]["tool_call_id"] == messages[2]["tool_calls"][0]["id"]
    assert json.loads(messages[3]["content"])["result"]["name"] == "Ada"
    assert {t["function"]["name"] for t in tools} == {"lookup_customer", "pay", "note"}
    pay = next(t for t in tools if t["function"]["name"] == "pay")["function"]["parameters"]
    assert pay["properties"]["amount_cents"]["type"] == "integer" and "customer_id" in pay["required"]


@pytest.mark.parametrize(
    "arguments, error",
    [
        ({"customer_id": "c1", "amount_cents": -5}, "invalid arguments"),
        ({"customer_id": "c1"}, "invalid arguments"),
        ('{"customer_id": "c1", "amount_cents": ', "not JSON"),
    ],
)
def test_invalid_arguments_go_back_to_the_model_and_are_not_executed(agent, arguments, error):
    run = drive(submit({"calls": [["pay", arguments]]}, {"answer": "sorry"}))
    assert run.status == Run.Status.SUCCEEDED
    assert calls(run, "payments") == 0 and not Approval.objects.exists()
    assert error in run.steps.get(name="helper.turn1.1.pay").output["error"]


def test_an_unknown_tool_goes_back_to_the_model(agent):
    run = drive(submit({"calls": [["drop_tables", {}]]}, {"answer": "sorry"}))
    assert run.status == Run.Status.SUCCEEDED
    assert "no tool 'drop_tables'" in run.steps.get(name="helper.turn1.1.drop_tables").output["error"]


def big_payment():
    return {"calls": [["pay", {"customer_id": "c1", "amount_cents": 5_000, "note": "late"}]], "say": "It was late."}


def test_a_call_that_needs_approval_parks_with_a_card_and_executes_once_approved(agent, bob):
    run = drive(submit(big_payment(), {"answer": "done"}))
    assert run.status == Run.Status.WAITING_HUMAN and calls(run, "payments") == 0
    card = Approval.objects.get(run=run)
    assert card.proposed == {"customer_id": "c1", "amount_cents": 5_000, "note": "late"}
    assert card.current == {"customer_id": "c1", "refunded_cents": 0}
    assert card.summary == "It was late." and card.rule_id == "tool:pay"
    assert (card.headline, card.amount_minor, card.channel.name) == ("late", 5_000, "payments")
    card.decide(bob, "approve")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED and calls(run, "payments") == 1
    assert calls(run, "model") == 2  # the parked turn was not asked again
    assert run.steps.get(name="helper.turn1.1.pay").output["approved_by"] == "bob"


def test_an_edited_call_executes_the_edited_arguments_and_the_model_is_told(agent, bob):
    run = drive(submit(big_payment(), {"answer": "done"}))
    card = Approval.objects.get(run=run)
    card.decide(bob, "edit", payload={**card.proposed, "amount_cents": 2_500})
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    paid = SandboxCall.objects.get(run_id=run.id, system="payments")
    assert paid.payload["amount_cents"] == 2_500
    output = run.steps.get(name="helper.turn1.1.pay").output
    assert output["edited"] is True and output["arguments"]["amount_cents"] == 2_500


def test_an_edit_the_tool_schema_refuses_changes_nothing(agent, bob):
    run = drive(submit(big_payment(), {"answer": "done"}))
    card = Approval.objects.get(run=run)
    for payload in ({**card.proposed, "amount_cents": -1}, {**card.proposed, "extra": 1}, {"amount_cents": 10}):
        with pytest.raises(InvalidDecision):
            card.decide(bob, "edit", payload=payload)
    card.refresh_from_db()
    assert card.status == "pending" and calls(run, "payments") == 0


def test_a_rejection_reaches_the_model_and_the_same_call_is_not_proposed_again(agent, bob):
    run = drive(submit(big_payment(), big_payment(), {"answer": "I could not refund."}))
    card = Approval.objects.get(run=run)
    card.decide(bob, "reject", comment="policy says no refunds after 30 days", reason="policy")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED, run.error
    assert calls(run, "payments") == 0 and Approval.objects.filter(run=run).count() == 1
    first = run.steps.get(name="helper.turn1.1.pay").output
    again = run.steps.get(name="helper.turn2.1.pay").output
    assert first["rejected"]["comment"] == "policy says no refunds after 30 days"
    assert again["rejected"] == first["rejected"] and again["repeat"] is True
    assert run.result == {"agent_said": "I could not refund."}


def pay(amount: int, note: str = "") -> list:
    return ["pay", {"customer_id": "c1", "amount_cents": amount, "note": note}]


def test_an_approval_policy_sees_what_the_run_already_did(agent, bob):
    # `pay` needs a person once the run's payments would pass 10.00: three of 4.00 are not three without one.
    run = drive(submit({"calls": [pay(400), pay(400)]}, {"calls": [pay(400, "third")]}, {"answer": "paid"}))
    assert run.status == Run.Status.WAITING_HUMAN and calls(run, "payments") == 2
    card = Approval.objects.get(run=run)
    assert card.proposed["note"] == "third" and card.step_seq == 4
    card.decide(bob, "approve")
    assert drive(run).status == Run.Status.SUCCEEDED and calls(run, "payments") == 3


def test_the_demo_refund_policy_counts_the_runs_refunds_so_far(settings):
    settings.AUTO_APPROVE_CENTS = 2_000
    refund = OrderRefund(customer_id="c1", order_id="o1", amount_cents=1_999, currency="EUR", reason="late")
    done = {"tool": "refund_order", "call_id": "1", "arguments": refund.model_dump(), "result": {"id": "pa_1"}}
    refused = {**done, "result": {"error": "at most 0 EUR cents can be refunded", "refunded": False}}
    rejected = {"tool": "refund_order", "call_id": "2", "arguments": refund.model_dump(), "rejected": {"by": "bob"}}
    assert not _needs_a_person(refund, [])
    assert not _needs_a_person(refund, [refused, rejected])  # nothing was refunded by those
    assert _needs_a_person(refund, [done])  # 19.99 + 19.99 passes 20.00


def test_a_rejected_call_stops_the_effects_planned_after_it_in_its_turn(agent, bob):
    run = drive(
        submit(
            {
                "calls": [
                    pay(5_000, "late"),
                    ["note", {"text": "refunded 50.00"}],
                    ["lookup_customer", {"customer_id": "c1"}],
                ]
            },
            {"answer": "I could not refund."},
        )
    )
    Approval.objects.get(run=run).decide(bob, "reject", comment="no refunds after 30 days")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert calls(run, "payments") == 0 and calls(run, "crm") == 0  # the note about the refund was not written
    assert calls(run, "crm_read") == 1  # a read planned after it still ran
    skipped = run.steps.get(name="helper.turn1.2.note").output
    assert (
        skipped["skipped"]["comment"] == "no refunds after 30 days" and "rejected pay" in skipped["skipped"]["reason"]
    )
    told = SandboxCall.objects.filter(run_id=run.id, system="model", payload__turn=2).get().payload["seen"]
    assert told[1]["error"] == "not executed" and told[1]["rejected_call"] == "call_1_0"


def test_the_turn_limit_parks_with_a_budget_card_then_extends_or_stops(agent, bob):
    lookups = [{"calls": [["lookup_customer", {"customer_id": f"c{i}"}]]} for i in range(6)]
    run = drive(submit(*lookups, {"answer": "done"}))
    assert run.status == Run.Status.PAUSED and calls(run, "model") == 4
    card = Approval.objects.get(run=run)
    assert card.kind == "budget" and card.proposed == {"max_turns": 8}
    with pytest.raises(InvalidDecision):
        card.decide(bob, "edit", payload={"max_turns": 3})
    card.decide(bob, "edit", payload={"max_turns": 7})
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED and calls(run, "model") == 7

    run = drive(submit(*lookups, {"answer": "done"}))
    Approval.objects.get(run=run).decide(bob, "reject", comment="enough")
    run = drive(run)
    assert run.status == Run.Status.CANCELLED and run.result["outcome"] == "stopped at turn limit"


def test_a_model_error_in_a_turn_is_retried_without_repeating_done_tool_calls(agent, settings):
    class FlakyOnce(tests.agent_workflows.ScriptedChat):
        failed = False

        def chat(self, messages, tools):
            if len(messages) > 2 and not FlakyOnce.failed:
                FlakyOnce.failed = True
                raise Retryable("model answered 503")
            return super().chat(messages, tools)

    tests.agent_workflows.FlakyOnce = FlakyOnce
    settings.AGENT_MODEL = "tests.agent_workflows.FlakyOnce"
    run = submit({"calls": [["note", {"text": "hi"}]]}, {"answer": "done"})
    with pytest.raises(Exception, match="503"):
        drive(run)
    run = drive(run, attempts=1)
    assert run.status == Run.Status.SUCCEEDED and calls(run, "crm") == 1 and calls(run, "model") == 2
    assert run.steps.get(name="helper.turn2").attempt == 2


def test_a_changed_prompt_on_resume_is_an_error(agent, bob):
    run = drive(submit(big_payment(), {"answer": "done"}))
    Step.objects.filter(run=run, name="helper.turn1.1.pay").update(input_hash="0" * 64)
    Approval.objects.get(run=run).decide(bob, "approve")
    run = drive(run)
    assert run.status == Run.Status.FAILED and "changed since it was checkpointed" in run.error
    assert calls(run, "payments") == 0


# Against a local OpenAI-compatible server through the openai SDK (runs.llm), never the internet.


@pytest.fixture
def agent_on_stub(db, settings, openai_stub):
    settings.AGENT_MODEL = "runs.llm.model_for_run"
    settings.MODEL_NAME = "gpt-4o-mini"
    Channel.objects.get_or_create(name="payments")
    return openai_stub


def test_a_loop_on_an_openai_compatible_endpoint_records_tokens_and_cost(agent_on_stub):
    agent_on_stub.script(
        tool_calls([("lookup_customer", {"customer_id": "c9"})], prompt_tokens=1_000, completion_tokens=50),
        tool_calls([("pay", '{"customer_id": "c9", "amount_cents": "lots"}')], content="Refunding."),
        text("I could not refund: the amount was invalid.", prompt_tokens=2_000, completion_tokens=20),
    )
    run = drive(submit())
    assert run.status == Run.Status.SUCCEEDED, run.error
    assert agent_on_stub.calls == 3
    assert run.result == {"agent_said": "I could not refund: the amount was invalid."}
    first = run.steps.get(name="helper.turn1")
    # gpt-4o-mini: 0.15 in, 0.60 out per million tokens
    assert (first.tokens_in, first.tokens_out, str(first.cost)) == (1_000, 50, "0.000180")
    assert run.tokens_in == 1_000 + 10 + 2_000
    # The invalid argument went back to the model as the tool's error, and nothing was paid.
    assert calls(run, "payments") == 0 and not Approval.objects.exists()
    sent = agent_on_stub.requests[2]["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert "invalid arguments" in json.loads(sent[5]["content"])["error"]
    assert sent[4]["tool_calls"][0]["function"]["arguments"] == '{"customer_id": "c9", "amount_cents": "lots"}'
    assert {t["function"]["name"] for t in agent_on_stub.requests[0]["tools"]} == {"lookup_customer", "pay", "note"}


def test_a_429_in_a_turn_is_retried_and_a_400_is_fatal(agent_on_stub):
    agent_on_stub.script(error(429), text("fine"))
    run = submit()
    with pytest.raises(Exception, match="429"):
        drive(run)
    run = drive(run, attempts=1)
    assert run.status == Run.Status.SUCCEEDED and agent_on_stub.calls == 2

    agent_on_stub.script(error(400))
    run = drive(submit(message="again"))
    assert run.status == Run.Status.FAILED and agent_on_stub.calls == 3
    assert DeadLetter.objects.filter(run_id=run.id, step="helper.turn1").exists()


@pytest.mark.parametrize(
    "payload",
    [{"max_turns": "7"}, {"max_turns": 7.5}, {"max_turns": True}, {"max_turns": 101}, {"max_turns": 7, "x": 1}, [7]],
)
def test_a_turn_limit_edit_that_is_not_a_whole_number_in_bounds_changes_nothing(agent, bob, payload):
    lookups = [{"calls": [["lookup_customer", {"customer_id": f"c{i}"}]]} for i in range(6)]
    run = drive(submit(*lookups, {"answer": "done"}))
    card = Approval.objects.get(run=run)
    with pytest.raises(InvalidDecision):
        card.decide(bob, "edit", payload=payload)
    card.refresh_from_db()
    run.refresh_from_db()
    assert card.status == "pending" and run.status == Run.Status.PAUSED and calls(run, "model") == 4
