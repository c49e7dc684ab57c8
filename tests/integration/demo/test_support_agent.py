"""The `support_agent` demo workflow (demo.workflows), driven in-process by the demo's scripted chat model
(demo.model.ScriptedModel.chat): tools, approvals, a rejection that changes the agent's course, and the run page
that shows the conversation."""

from __future__ import annotations

import json

import pytest

from approvals.models import Approval
from core import pii
from demo import sandbox
from demo.models import SandboxCall
from runs import submission
from runs.api import _workflow_inputs, run_out
from runs.models import Run
from tests.conftest import approves_every_channel
from tests.engine_helpers import drive
from tests.openai_stub import text, tool_calls

CUSTOMER = "cus_2077"


@pytest.fixture
def bob(bob, demo):
    """The reviewer, with approve_channel on every channel of these tests (Approval.decide checks it)."""
    return approves_every_channel(bob)


def submit(message: str, **extra) -> Run:
    run, created = submission.submit(
        workflow="support_agent", input={"customer_id": CUSTOMER, "message": message, **extra}
    )
    assert created
    return run


def tools_called(run: Run) -> list[str]:
    return [s.name.rsplit(".", 1)[-1] for s in run.steps.order_by("seq") if s.name.count(".") == 3]


def writes(system: str) -> list[SandboxCall]:
    return list(SandboxCall.objects.filter(system=system, applied=True).exclude(idempotency_key=""))


def test_a_small_refund_finishes_with_the_email_approved(demo, bob):
    run = drive(submit("My headphones arrived broken. Please refund 9.00 of it."))
    assert run.status == Run.Status.WAITING_HUMAN, run.error
    # The refund is below the auto-approve amount: paid without a card; the email always asks.
    assert tools_called(run) == ["lookup_customer", "list_orders", "refund_order", "send_email"]
    card = Approval.objects.get(run=run)
    assert card.channel.name == "email" and card.rule_id == "tool:send_email"
    # The customer's address and name are references (docs/personal-data.md): the model never saw them.
    assert pii.is_ref(card.proposed["to"]) and pii.reveal(card.proposed["to"]) == f"{CUSTOMER}@example.com"
    assert "9.00" in card.proposed["body"] and pii.reveal(card.proposed["body"]).startswith("Hello Barbara 2077,")
    assert card.current == {"to": card.proposed["to"], "subject": "", "body": ""}
    assert sandbox.stats(effects_only=True)["channels"] == {"payments": 1, "email": 0, "crm": 0}

    card.decide(bob, "approve")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED, run.error
    assert tools_called(run) == ["lookup_customer", "list_orders", "refund_order", "send_email", "add_note"]
    assert sandbox.stats(effects_only=True) == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}
    assert sandbox.stats()["duplicates"] == 0
    (paid,) = writes("payments")
    assert paid.payload["amount_cents"] == 900 and paid.payload["order_id"].startswith("ord_")
    assert "Refunded 900" in writes("crm")[0].payload["text"]
    # The email system got them in clear (ctx.pii); what the run keeps of its answer has the reference again.
    (sent,) = writes("email")
    assert sent.payload["to"] == f"{CUSTOMER}@example.com" and sent.payload["body"].startswith("Hello Barbara 2077,")
    email_step = run.steps.get(name__endswith=".send_email")
    assert email_step.output["result"]["to"] == card.proposed["to"]
    assert run.result["turns"] == 6 and "emailed the customer" in run.result["answer"]
    # Each turn was one model call, never repeated on resume, with its tokens on its step.
    assert SandboxCall.objects.filter(run_id=run.id, system="model").count() == 6
    turn = run.steps.get(name="support_agent.turn3")
    assert turn.kind == "compute" and turn.tokens_in > 0 and turn.cost > 0
    assert run.steps.get(name="support_agent.turn3.1.refund_order").output.get("approved_by") is None


def test_a_big_refund_parks_with_a_card_that_diffs_against_the_order(demo, bob):
    run = drive(submit("Order never arrived, I want my money back."))
    assert run.status == Run.Status.WAITING_HUMAN
    card = Approval.objects.get(run=run)
    order = sandbox.orders_of(CUSTOMER)[0]
    assert order["total_cents"] >= 2_000  # the whole order, above the auto-approve amount
    assert card.channel.name == "payments" and card.rule_id == "tool:refund_order"
    assert card.proposed == {
        "customer_id": CUSTOMER,
        "order_id": order["id"],
        "amount_cents": order["total_cents"],
        "currency": order["currency"],
        "reason": "Order never arrived, I want my money back.",
    }
    assert card.current == {**card.proposed, "amount_cents": 0, "reason": ""}
    assert card.headline == "Order never arrived, I want my money back."
    assert card.amount_minor == order["total_cents"]
    assert order["id"] in card.summary and "Refunding" in card.summary  # the model's words
    assert writes("payments") == []

    card.decide(bob, "edit", payload={**card.proposed, "amount_cents": 1_500})
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN  # now the email
    assert writes("payments")[0].payload["amount_cents"] == 1_500
    email = Approval.objects.get(run=run, status="pending")
    assert "15.00" in email.proposed["body"]  # the model was told the edited amount
    assert run.steps.get(name="support_agent.turn3.1.refund_order").output["edited"] is True


def test_a_rejected_refund_changes_the_agents_course(demo, bob):
    run = drive(submit("Order never arrived, I want my money back."))
    card = Approval.objects.get(run=run)
    card.decide(bob, "reject", comment="Tracking says it was delivered; ask for a photo.", reason="policy")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED, run.error
    assert tools_called(run) == ["lookup_customer", "list_orders", "refund_order", "add_note"]
    assert writes("payments") == [] and writes("email") == []
    (note,) = writes("crm")
    assert "No refund: a reviewer rejected it: Tracking says it was delivered" in note.payload["text"]
    assert "I did not refund" in run.result["answer"]
    assert Approval.objects.filter(run=run).count() == 1


def test_invalid_arguments_go_back_to_the_model_which_does_not_pay(demo):
    run = drive(submit("Please refund 0.00 for the late delivery."))
    assert run.status == Run.Status.SUCCEEDED, run.error
    refund = run.steps.get(name="support_agent.turn3.1.refund_order").output
    assert "invalid arguments" in refund["error"]
    assert tools_called(run) == ["lookup_customer", "list_orders", "refund_order", "add_note"]
    assert writes("payments") == [] and not Approval.objects.exists()


def test_an_injected_model_fault_is_retried_without_repeating_tool_calls(demo):
    run = submit("Please refund 9.00.", faults={"support_agent.turn2": ["5xx"]})
    with pytest.raises(Exception, match="503"):
        drive(run)
    run = drive(run, attempts=1)
    assert run.status == Run.Status.WAITING_HUMAN  # the email card
    model = SandboxCall.objects.filter(run_id=run.id, system="model")
    assert model.filter(operation="support_agent.turn2").count() == 2
    assert SandboxCall.objects.filter(run_id=run.id, system="crm", operation__endswith="lookup_customer").count() == 1


def test_the_api_names_the_agent_step_at_the_cursor_and_documents_the_input(demo):
    run = drive(submit("Order never arrived, I want my money back."))
    assert run_out(run)["current_step"] == "support_agent.turn3.1.refund_order"
    schema = _workflow_inputs()["support_agent"]
    assert set(schema["required"]) == {"customer_id", "message"} and "order_id" in schema["properties"]


def test_the_run_page_shows_the_conversation_escaped(demo, alice, bob, client):
    message = "Never arrived <script>alert('x')</script> refund please."
    run = drive(submit(message))
    card = Approval.objects.get(run=run)
    card.decide(bob, "reject", comment="No refund <b>without</b> a photo", reason="policy")
    run = drive(run)
    client.force_login(alice)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert "<script>alert" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "<b>without</b>" not in page and "No refund &lt;b&gt;without&lt;/b&gt; a photo" in page
    for tool in ("lookup_customer", "list_orders", "refund_order", "add_note"):
        assert f'data-tool="{tool}"' in page
    assert page.count('class="agent-turn') == 5
    assert f"&quot;customer_id&quot;: &quot;{CUSTOMER}&quot;" in page  # the arguments
    assert "rejected by bob" in page and f'href="/approvals/{card.pk}/"' in page
    assert "I did not refund" in page  # the answer
    assert json.dumps(run.result["turns"]) in page


def test_the_run_page_shows_who_edited_and_approved(demo, alice, bob, client):
    run = drive(submit("Order never arrived, I want my money back."))
    refund_card = Approval.objects.get(run=run)
    refund_card.decide(bob, "edit", payload={**refund_card.proposed, "amount_cents": 1_500})
    run = drive(run)
    email_card = Approval.objects.get(run=run, status="pending")
    email_card.decide(bob, "approve")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED, run.error
    client.force_login(alice)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert page.count("edited by bob") == 1 and page.count("approved by bob") == 1
    assert f'href="/approvals/{refund_card.pk}/"' in page and f'href="/approvals/{email_card.pk}/"' in page
    assert "executed arguments (as edited)" in page and "&quot;amount_cents&quot;: 1500" in page
    assert "no approval needed" in page  # the CRM note
    assert page.count('class="agent-turn') == 6 and 'class="agent-answer' in page


def test_it_runs_on_an_openai_compatible_endpoint(demo, bob, settings, openai_stub):
    """The same workflow on a real chat-completions API (a local stub through the openai SDK): the model decides
    from the tool results it is sent, as a real one would."""
    settings.MODEL_NAME = "gpt-4o-mini"

    def model(request: dict) -> dict:
        results = [json.loads(m["content"]) for m in request["messages"] if m["role"] == "tool"]
        if not results:
            return tool_calls([("lookup_customer", {"customer_id": CUSTOMER})])
        if len(results) == 1:
            return tool_calls([("list_orders", {"customer_id": CUSTOMER})])
        if len(results) == 2:
            order = results[1]["result"][0]
            refund = {"customer_id": CUSTOMER, "order_id": order["id"], "amount_cents": 500}
            refund |= {"currency": order["currency"], "reason": "arrived broken"}
            return tool_calls([("refund_order", refund)], content="Refunding 5.00 of the order.")
        if len(results) == 3:
            email = {"customer_id": CUSTOMER, "to": results[0]["result"]["email"], "subject": "Your refund"}
            email["body"] = "We refunded 5.00."
            return tool_calls([("send_email", email)])
        if len(results) == 4:
            return tool_calls([("add_note", {"customer_id": CUSTOMER, "text": "Refunded 5.00, emailed."})])
        return text("Refunded 5.00 and told the customer.")

    openai_stub.script(*[model] * 6)
    run = drive(submit("My kettle arrived broken."))
    assert run.status == Run.Status.WAITING_HUMAN, run.error
    Approval.objects.get(run=run, rule_id="tool:send_email").decide(bob, "approve")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED, run.error
    assert run.result["answer"] == "Refunded 5.00 and told the customer."
    assert openai_stub.calls == 6 and SandboxCall.objects.filter(run_id=run.id, system="model").count() == 0
    assert sandbox.stats(effects_only=True) == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}
    assert {t["function"]["name"] for t in openai_stub.requests[0]["tools"]} == {
        "lookup_customer",
        "list_orders",
        "refund_order",
        "send_email",
        "add_note",
    }
    assert run.steps.get(name="support_agent.turn1").cost > 0
