"""An edit executes only once it has been checked against its gate's declaration. A console that cannot load the
run's workflow version, or cannot find the gate's step in it (web and worker disagree on WORKFLOW_MODULES, a
deploy in progress), refuses the edit with 409 and writes nothing, rather than falling back to a weaker check.
And the engine checks a decided edit again before the step acts on it: one that breaks the gate's declaration
(a card written by other means) sends the run to the dead-letter queue, with nothing executed."""

from __future__ import annotations

import json

import pytest
from django.db import transaction
from django.db.models import F
from django.utils import timezone

import tests.agent_workflows  # noqa: F401 - registers test_agent
from approvals.errors import DecisionError
from approvals.models import Approval, Decision
from core.models import AuditEntry, Channel
from demo.models import SandboxCall
from jobs.models import DeadLetter
from runs import submission
from runs.models import Run, Step
from tests.conftest import approves_every_channel
from tests.engine_helpers import REFUND, drive
from tests.integration.approvals.test_api_approvals import decide, snapshot


def parked_refund() -> tuple[Run, Approval]:
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    assert run.status == Run.Status.WAITING_HUMAN
    return run, Approval.objects.get(run=run)


def too_much(card: Approval) -> dict:
    """An edit the refund gate refuses (more than proposed) that keeps the proposal's shape and types."""
    payload = json.loads(json.dumps(card.proposed))
    payload["refund"]["amount_cents"] += 1
    return payload


def _leaves(value: dict, prefix: str = "") -> dict:
    out = {}
    for key, item in value.items():
        path = f"{prefix}.{key}" if prefix else key
        out.update(_leaves(item, path) if isinstance(item, dict) else {path: item})
    return out


# How a console comes to be unable to resolve a card's gate: the run's version or workflow is not deployed in
# it, or its deployment of that version has no step at the card's position.
UNRESOLVABLE = {
    "the run's version is not deployed": lambda card: Run.objects.filter(pk=card.run_id).update(workflow_version=99),
    "the run's workflow is not deployed": lambda card: Run.objects.filter(pk=card.run_id).update(workflow="refund2"),
    "the version has no step at the card's seq": lambda card: Approval.objects.filter(pk=card.pk).update(step_seq=40),
}


def state(card: Approval) -> tuple:
    return (*snapshot(card), AuditEntry.objects.filter(approval_id=card.pk).count())


@pytest.mark.parametrize("make_unresolvable", UNRESOLVABLE.values(), ids=UNRESOLVABLE.keys())
def test_the_api_refuses_an_edit_it_cannot_check_with_409_and_writes_nothing(client, demo, make_unresolvable):
    run, card = parked_refund()
    make_unresolvable(card)
    card = Approval.objects.get(pk=card.pk)
    before = state(card)
    response = decide(client, demo["reviewer"], card, decision="edit", comment="", payload=too_much(card))
    assert response.status_code == 409, response.content
    assert "cannot check the edit" in response.json()["detail"]
    assert "try again once the deploy is complete" in response.json()["detail"]
    assert state(card) == before
    # Rejecting needs no check: a person can still stop the run.
    response = decide(client, demo["reviewer"], card, decision="reject", comment="not now", reason="other")
    assert response.status_code == 200, response.content


def test_decide_says_which_workflow_version_it_cannot_load(demo):
    run, card = parked_refund()
    Run.objects.filter(pk=run.pk).update(workflow_version=99)
    before = state(card)
    with pytest.raises(DecisionError, match="cannot load workflow refund v99") as refused:
        Approval.objects.get(pk=card.pk).decide(demo["reviewer"], "edit", payload=too_much(card))
    assert refused.value.status == 409
    assert state(card) == before


def test_the_card_page_still_opens_and_refuses_the_edit_with_409(client, demo):
    run, card = parked_refund()
    Run.objects.filter(pk=run.pk).update(workflow_version=99)
    client.force_login(demo["reviewer"])
    assert client.get(f"/approvals/{card.pk}/").status_code == 200
    before = state(card)
    # Every leaf, as the browser posts the form (a gate this console cannot load offers them all).
    form = {"decision": "edit", "version": card.version, **{f"p:{k}": v for k, v in _leaves(too_much(card)).items()}}
    response = client.post(f"/approvals/{card.pk}/decide", form, headers={"HX-Request": "true"})
    assert response.status_code == 409
    assert "cannot check the edit" in response.content.decode()
    assert state(card) == before


@pytest.fixture
def agent(db, settings):
    settings.AGENT_MODEL = "tests.agent_workflows.ScriptedChat"
    Channel.objects.get_or_create(name="payments")


@pytest.fixture
def bob(bob, agent):
    """The reviewer, with approve_channel on the agent's channel (Approval.decide checks it)."""
    return approves_every_channel(bob)


def parked_payment() -> tuple[Run, Approval]:
    call = {"calls": [["pay", {"customer_id": "c1", "amount_cents": 5_000, "note": "late"}]], "say": "It was late."}
    script = [call, {"answer": "done"}]
    run = drive(submission.submit(workflow="test_agent", input={"message": "my order never came", "script": script})[0])
    assert run.status == Run.Status.WAITING_HUMAN
    return run, Approval.objects.get(run=run)


def test_an_agent_tool_call_card_is_checked_against_the_tools_schema_or_refused(agent, bob):
    run, card = parked_payment()
    # Resolved through Workflow.step_of: the tool's argument model refuses a negative amount.
    with pytest.raises(Exception, match="amount_cents"):
        card.decide(bob, "edit", payload={**card.proposed, "amount_cents": -1})
    # Its turn's checkpoint is what tells which tool the card is for: without it, nothing can be checked.
    Step.objects.filter(run=run, name="helper.turn1").delete()
    before = state(card)
    with pytest.raises(DecisionError, match="cannot find the step at seq 1"):
        Approval.objects.get(pk=card.pk).decide(bob, "edit", payload={**card.proposed, "amount_cents": 10})
    assert state(card) == before


# --- the engine checks a decided edit again -------------------------------------------------------------------


def plant_edit(card: Approval, payload) -> None:
    """A decided edit written straight into the database, past Approval.decide's validator."""
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=card.run_id)
        Approval.objects.filter(pk=card.pk).update(
            status=Approval.Status.EDITED, decided_at=timezone.now(), version=F("version") + 1
        )
        Decision.objects.create(approval=card, decision=Decision.Kind.EDIT, payload=payload)
        run.resume()


def test_a_gate_replayed_with_an_edit_its_declaration_refuses_is_dead_lettered_and_pays_nothing(demo):
    run, card = parked_refund()
    plant_edit(card, too_much(card))
    run = drive(run)  # not raised: Fatal, not retried
    assert run.status == Run.Status.FAILED
    letter = DeadLetter.objects.get(run_id=run.id)
    assert letter.error_class == "Fatal" and letter.step == "approve_refund"
    assert "refund.amount_cents" in letter.error and "not executed" in letter.error
    assert not SandboxCall.objects.filter(run_id=run.id, system="payments").exists()
    assert not run.steps.filter(name="issue_refund").exists()


@pytest.mark.parametrize(
    "payload",
    [{"customer_id": "c1", "amount_cents": -1, "note": "late"}, {"amount_cents": 10}, "not an object"],
    ids=["a negative amount", "missing arguments", "not an object"],
)
def test_a_tool_call_decided_with_an_edit_its_schema_refuses_is_dead_lettered_and_not_called(agent, payload):
    run, card = parked_payment()
    plant_edit(card, payload)
    run = drive(run)  # not raised: Fatal, not retried
    assert run.status == Run.Status.FAILED, run.error
    letter = DeadLetter.objects.get(run_id=run.id)
    assert letter.error_class == "Fatal" and letter.step == "helper.turn1.1.pay"
    assert not SandboxCall.objects.filter(run_id=run.id, system="payments").exists()


def test_a_valid_planted_edit_still_executes(agent):
    run, card = parked_payment()
    plant_edit(card, {**card.proposed, "amount_cents": 2_500})
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED, run.error
    assert SandboxCall.objects.get(run_id=run.id, system="payments").payload["amount_cents"] == 2_500
