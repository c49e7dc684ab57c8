"""The durable agent loop (runs.agent) with real worker processes and the production web server.

The test agent of tests.agent_workflows (tools lookup_customer, pay, note; the scripted chat model) is deployed
on the web server and the workers (WORKFLOW_MODULES, AGENT_MODEL). Runs are submitted and cards decided through
the API, as an agent and a reviewer do. Every model call and tool call is a SandboxCall row, so the tests can
count them:

- a worker SIGKILLed in the middle of a model turn, after tool calls and effects were recorded, or in the middle
  of an approved payment (applied, its receipt not completed), resumes on another worker: recorded turns are not
  asked again, no effect happens twice (the ambiguous payment is reconciled by a person, not repeated);
- an approved call executes once; an edited one executes the edited arguments and the model is told; a rejected
  one reaches the model with the reviewer's comment, and the same call proposed again gets no second card.
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest

import tests.agent_workflows  # noqa: F401 - registers test_agent in this process too
from approvals.models import Approval
from demo.models import SandboxCall
from runs.models import Receipt, Run
from tests.system.conftest import describe_runs, jobs_doing
from tests.worker import settles_as, wait_with_logs

SETTLE = 60  # seconds a run gets to finish or park
SLEEP = 120  # the kill window: far longer than any test waits in it


@pytest.fixture
def system_env() -> dict:
    return {"WORKFLOW_MODULES": "tests.agent_workflows", "AGENT_MODEL": "tests.agent_workflows.ScriptedChat"}


def submit(system, *turns, **run_input) -> Run:
    run_id = system.submit(
        {"message": "my order never came", "script": list(turns), **run_input}, workflow="test_agent"
    )
    return Run.objects.get(pk=run_id)


def model_turns(run: Run) -> Counter:
    """How many times the model was asked for each turn."""
    return Counter(SandboxCall.objects.filter(run_id=run.id, system="model").values_list("payload__turn", flat=True))


def seen_at(run: Run, turn: int) -> list:
    """The tool results the model was sent with its (first) call for `turn`."""
    call = SandboxCall.objects.filter(run_id=run.id, system="model", payload__turn=turn).order_by("pk").first()
    return call.payload["seen"]


def calls(run: Run, system: str) -> list[SandboxCall]:
    return list(SandboxCall.objects.filter(run_id=run.id, system=system).order_by("pk"))


def steps(run: Run) -> list[tuple[str, str, int]]:
    return list(run.steps.order_by("seq").values_list("name", "status", "attempt"))


def output(run: Run, step: str) -> dict:
    return run.steps.get(name=step).output


def pending_card(system, run: Run) -> dict:
    """The run's one pending card, as the reviewer's inbox lists it (waits for it to appear)."""

    def find():
        response = system.reviewer.get("/api/approvals?status=pending")
        assert response.status == 200, response
        return [card for card in response.body if card["run_id"] == str(run.id)]

    (card,) = wait_with_logs(find, f"a card for run {run.id}", system.workers.all, timeout=SETTLE)
    return card


def decide(system, card: dict, decision: str, **body) -> dict:
    response = system.reviewer.post(
        f"/api/approvals/{card['id']}/decision", {"decision": decision, "version": card["version"], **body}
    )
    assert response.status == 200, f"{response}\n{system.server.errors()}"
    return response.body


def one_worker(system):
    """Keep one of the system's workers: the run is on it when the test kills it."""
    first, *others = system.workers.alive
    for worker in others:
        worker.stop()
    return first


def kill_when(system, victim, predicate, what: str):
    """Once `predicate` holds (the victim is asleep in its kill window), start a successor, wait until it takes
    jobs, then SIGKILL the victim: the run is taken back by the successor."""
    wait_with_logs(predicate, what, system.workers.all, timeout=SETTLE)
    successor = system.workers.start()
    wait_with_logs(lambda: successor.ready, "the successor worker to start", system.workers.all, timeout=SETTLE)
    assert victim.alive, system.workers.logs([victim])
    victim.kill(signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL
    return successor


def lookup(customer="c1"):
    return ["lookup_customer", {"customer_id": customer}]


def pay(amount, note=""):
    return ["pay", {"customer_id": "c1", "amount_cents": amount, "note": note}]


def test_a_worker_killed_in_a_model_turn_after_effects_resumes_without_asking_or_paying_again(system):
    victim = one_worker(system)
    run = submit(
        system,
        {"calls": [lookup(), ["note", {"text": "asked for a refund"}]], "say": "Let me look."},
        {"calls": [pay(500, "late")]},
        {"calls": [["note", {"text": "refunded"}]], "sleep": SLEEP},  # killed while the model thinks
        {"answer": "Refunded 5.00."},
    )
    kill_when(system, victim, lambda: model_turns(run)[3] == 1, "the model to be asked for turn 3")
    run.refresh_from_db()
    assert run.status == Run.Status.RUNNING and run.cursor == 5  # turns 1-2 and their three calls recorded

    settles_as(run, Run.Status.SUCCEEDED, system.workers.all, timeout=SETTLE)
    assert run.result == {"agent_said": "Refunded 5.00."}
    # Recorded turns were replayed from their checkpoints; the one the worker died in was asked again.
    assert model_turns(run) == {1: 1, 2: 1, 3: 2, 4: 1}
    assert [c.payload["amount_cents"] for c in calls(run, "payments")] == [500]
    assert [c.payload["text"] for c in calls(run, "crm")] == ["asked for a refund", "refunded"]
    assert len(calls(run, "crm_read")) == 1
    assert steps(run) == [
        ("helper.turn1", "done", 1),
        ("helper.turn1.1.lookup_customer", "done", 1),
        ("helper.turn1.2.note", "done", 1),
        ("helper.turn2", "done", 1),
        ("helper.turn2.1.pay", "done", 1),
        ("helper.turn3", "done", 2),
        ("helper.turn3.1.note", "done", 1),
        ("helper.turn4", "done", 1),
        ("helper", "done", 1),
        ("after", "done", 1),
    ]
    # The resumed turn saw the result of the note its own first attempt never got to call.
    assert seen_at(run, 4)[0]["result"]["id"].startswith("crm_")
    assert not Approval.objects.filter(run=run).exists()
    assert jobs_doing() == []


def test_a_worker_killed_in_an_approved_payment_is_reconciled_not_paid_again(system):
    victim = one_worker(system)
    run = submit(
        system,
        {"calls": [lookup()]},
        {"calls": [pay(5_000, "late")], "say": "It was late."},
        {"answer": "Refunded 50.00."},
        hang={"helper.turn2.1.pay": SLEEP},  # killed after the payment was applied, before its receipt
    )
    card = pending_card(system, run)
    assert (card["kind"], card["rule_id"], card["proposed"]["amount_cents"]) == ("action", "tool:pay", 5_000)
    decide(system, card, "approve", comment="ok")
    kill_when(system, victim, lambda: len(calls(run, "payments")) == 1, "the approved payment to be applied")
    receipt = Receipt.objects.get(run=run, channel="payments")
    assert receipt.status == Receipt.Status.PENDING

    # The successor cannot tell whether the payment happened (the tool has no lookup): a person is asked.
    card = pending_card(system, run)
    assert card["kind"] == "reconcile" and card["proposed"]["receipt"] == receipt.key
    (payment,) = calls(run, "payments")
    assert payment.payload["key"] == receipt.key  # the reviewer finds it in the payment system
    decide(system, card, "approve", comment="it is in the payment system")

    settles_as(run, Run.Status.SUCCEEDED, system.workers.all, timeout=SETTLE)
    assert run.result == {"agent_said": "Refunded 50.00."}
    assert len(calls(run, "payments")) == 1
    assert model_turns(run) == {1: 1, 2: 1, 3: 1}
    assert len(calls(run, "crm_read")) == 1
    assert Counter(Approval.objects.filter(run=run).values_list("kind", "status")) == {
        ("action", "approved"): 1,
        ("reconcile", "approved"): 1,
    }
    receipt.refresh_from_db()
    assert receipt.status == Receipt.Status.DONE and receipt.reconciled
    paid = output(run, "helper.turn2.1.pay")
    assert paid["approved_by"] == "reviewer" and paid["result"]["reconciled_by"] == "reviewer"
    assert ("helper.turn2.1.pay", "done", 2) in steps(run)
    assert jobs_doing() == []


def test_an_approved_tool_call_executes_once(system):
    run = submit(system, {"calls": [pay(5_000, "late")], "say": "It was late."}, {"answer": "done"})
    card = pending_card(system, run)
    assert card["proposed"] == {"customer_id": "c1", "amount_cents": 5_000, "note": "late"}
    assert card["current"] == {"customer_id": "c1", "refunded_cents": 0} and card["summary"] == "It was late."
    assert not calls(run, "payments")
    decide(system, card, "approve", comment="fine")

    settles_as(run, Run.Status.SUCCEEDED, system.workers.all, timeout=SETTLE)
    (payment,) = calls(run, "payments")
    assert payment.payload["amount_cents"] == 5_000
    assert output(run, "helper.turn1.1.pay")["approved_by"] == "reviewer"
    assert model_turns(run) == {1: 1, 2: 1}  # the parked turn was not asked again
    assert seen_at(run, 2)[0]["result"]["status"] == "paid"
    assert list(Approval.objects.filter(run=run).values_list("status", flat=True)) == ["approved"]


def test_an_edited_tool_call_executes_the_edited_arguments_and_the_model_is_told(system):
    run = submit(system, {"calls": [pay(5_000, "late")]}, {"answer": "done"})
    card = pending_card(system, run)
    # The tool's schema is the card's: an edit it refuses is a 422, and changes nothing.
    refused = system.reviewer.post(
        f"/api/approvals/{card['id']}/decision",
        {"decision": "edit", "version": card["version"], "payload": {**card["proposed"], "amount_cents": -1}},
    )
    assert refused.status == 422, refused
    decide(system, card, "edit", payload={**card["proposed"], "amount_cents": 2_500}, comment="half")

    settles_as(run, Run.Status.SUCCEEDED, system.workers.all, timeout=SETTLE)
    (payment,) = calls(run, "payments")
    assert payment.payload["amount_cents"] == 2_500
    paid = output(run, "helper.turn1.1.pay")
    assert paid["edited"] is True and paid["arguments"]["amount_cents"] == 2_500
    told = seen_at(run, 2)[0]
    assert told["executed_arguments"]["amount_cents"] == 2_500 and "edited" in told["note"]
    assert model_turns(run) == {1: 1, 2: 1}


def test_a_rejected_tool_call_reaches_the_model_and_is_not_proposed_again(system):
    comment = "policy says no refunds after 30 days"
    run = submit(system, {"calls": [pay(5_000, "late")]}, {"calls": [pay(5_000, "late")]}, {"answer": "I cannot."})
    card = pending_card(system, run)
    decide(system, card, "reject", comment=comment, reason="policy")

    settles_as(run, Run.Status.SUCCEEDED, system.workers.all, timeout=SETTLE)
    assert run.result == {"agent_said": "I cannot."}
    assert not calls(run, "payments")
    assert list(Approval.objects.filter(run=run).values_list("status", flat=True)) == ["rejected"]
    first, again = output(run, "helper.turn1.1.pay"), output(run, "helper.turn2.1.pay")
    assert first["rejected"]["comment"] == comment and first["rejected"]["by"] == "reviewer"
    assert again["rejected"] == first["rejected"] and again["repeat"] is True
    # What the model was sent: the reviewer's comment, then that the same call was already rejected.
    told = seen_at(run, 2)[0]
    assert told["comment"] == comment and "rejected" in told["error"] and "note" not in told
    assert seen_at(run, 3)[0]["comment"] == comment and "already rejected" in seen_at(run, 3)[0]["note"]
    assert model_turns(run) == {1: 1, 2: 1, 3: 1}, describe_runs([run.id])


def test_a_turn_limit_extended_through_the_api_holds_when_the_worker_dies_in_the_next_turn(system):
    victim = one_worker(system)
    lookups = [{"calls": [lookup(f"c{i}")]} for i in range(1, 5)]  # max_turns is 4
    run = submit(
        system, *lookups, {"calls": [lookup("c5")], "sleep": SLEEP}, {"calls": [lookup("c6")]}, {"answer": "ok"}
    )
    card = pending_card(system, run)
    run.refresh_from_db()
    assert run.status == Run.Status.PAUSED and card["kind"] == "budget" and card["proposed"] == {"max_turns": 8}
    assert model_turns(run) == {1: 1, 2: 1, 3: 1, 4: 1}  # turn 5 asked a person before the model
    decide(system, card, "edit", payload={"max_turns": 7}, comment="three more")
    # Killed in turn 5, after the decision: the turn's output (which records the new limit) is lost with it.
    kill_when(system, victim, lambda: model_turns(run)[5] == 1, "the model to be asked for turn 5")

    settles_as(run, Run.Status.SUCCEEDED, system.workers.all, timeout=SETTLE)
    assert run.result == {"agent_said": "ok"}
    assert model_turns(run) == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 1, 7: 1}
    assert output(run, "helper.turn5")["max_turns"] == 7
    assert len(calls(run, "crm_read")) == 6
    assert list(Approval.objects.filter(run=run).values_list("kind", "status")) == [("budget", "edited")]
