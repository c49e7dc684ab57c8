"""A budget card never raises a limit past its ceiling: a run's cost limit stays at most BUDGET_CEILING, an agent's
turn limit at most AGENT_MAX_TURNS, whether the card is approved as proposed or edited. A card proposes at most
the ceiling; one that proposes more (opened before the ceiling was lowered) cannot be approved; and once the run
has reached the ceiling its card still opens, so that a person can stop the run, but cannot be approved."""

from __future__ import annotations

from decimal import Decimal

import pytest

import tests.agent_workflows  # noqa: F401 - registers test_agent
from approvals.errors import InvalidDecision
from approvals.inbox import decide_cards
from approvals.models import Approval
from core.models import AuditEntry, Channel
from demo.models import SandboxCall
from runs import submission
from runs.models import Run
from tests.conftest import approves_every_channel
from tests.engine_helpers import SMALL_REFUND, drive
from tests.integration.approvals.test_api_approvals import decide, snapshot

# The refund's classify step costs 0.000034, its draft 0.000160 (the scripted model's tokens at the demo price).
CEILING = Decimal("0.0001")


@pytest.fixture
def agent(db, settings):
    settings.AGENT_MODEL = "tests.agent_workflows.ScriptedChat"
    Channel.objects.get_or_create(name="payments")


@pytest.fixture
def bob(bob, agent):
    """The reviewer, with approve_channel on the agent's channel (Approval.decide checks it)."""
    return approves_every_channel(bob)


def over_budget_refund() -> Run:
    """A refund parked with a budget card after its first step (its limit is far below what a step costs)."""
    run = drive(submission.submit(workflow="refund", input=SMALL_REFUND, cost_limit=Decimal("0.000001"))[0])
    assert run.status == Run.Status.PAUSED
    return run


def over_turns_agent() -> Run:
    """An agent that wants seven turns, parked with a turn-limit card after its four (the stage's max_turns)."""
    lookups = [{"calls": [["lookup_customer", {"customer_id": f"c{i}"}]]} for i in range(6)]
    script = [*lookups, {"answer": "done"}]
    run = drive(submission.submit(workflow="test_agent", input={"message": "where is it", "script": script})[0])
    assert run.status == Run.Status.PAUSED
    return run


def pending_budget_card(run: Run) -> Approval:
    return Approval.objects.get(run=run, kind="budget", status="pending")


def state(card: Approval) -> tuple:
    return (*snapshot(card), AuditEntry.objects.filter(approval_id=card.pk).count())


def approve_every_budget_card(run: Run, user, limit_of) -> tuple[Run, list[str]]:
    """Approve each budget card as proposed while the run keeps asking; a refused approval is followed by a stop.
    Checks after each step that the run's limit (`limit_of(run)`) is within its ceiling."""
    refusals = []
    for _ in range(10):
        if run.status != Run.Status.PAUSED:
            return run, refusals
        card = pending_budget_card(run)
        try:
            card.decide(user, "approve")
        except InvalidDecision as exc:
            refusals.append(str(exc))
            card.decide(user, "reject", comment="the ceiling is reached")
        run = drive(run)
        limit_of(run)
    raise AssertionError("the run kept asking")


def test_repeated_approvals_never_raise_the_cost_limit_past_the_ceiling(demo, settings):
    settings.BUDGET_CEILING = CEILING

    def within(run: Run) -> None:
        assert run.cost_limit <= CEILING

    run, refusals = approve_every_budget_card(over_budget_refund(), demo["reviewer"], within)
    # The first card proposed the ceiling, not twice the limit or the cost plus a cent; the second came once the
    # run had spent past the ceiling, proposed no more than it, and could only stop the run.
    cards = list(Approval.objects.filter(run=run, kind="budget").order_by("pk"))
    assert [c.proposed for c in cards] == [{"cost_limit": "0.0001"}, {"cost_limit": "0.0001"}]
    assert [c.status for c in cards] == ["approved", "rejected"]
    assert (
        refusals and "the ceiling is reached" in refusals[0] and "raise BUDGET_CEILING or stop the run" in refusals[0]
    )
    assert run.status == Run.Status.CANCELLED and run.result["outcome"] == "stopped at cost limit"
    assert not SandboxCall.objects.filter(run_id=run.id, system="payments").exists()


def test_repeated_approvals_never_raise_the_turn_limit_past_agent_max_turns(agent, bob, settings):
    settings.AGENT_MAX_TURNS = 6

    def within(run: Run) -> None:
        limits = [s.output.get("max_turns") for s in run.steps.filter(kind="compute") if s.output]
        assert all(limit is None or limit <= 6 for limit in limits), limits

    run, refusals = approve_every_budget_card(over_turns_agent(), bob, within)
    cards = list(Approval.objects.filter(run=run, kind="budget").order_by("pk"))
    assert [c.proposed for c in cards] == [{"max_turns": 6}, {"max_turns": 6}]
    assert refusals and "raise AGENT_MAX_TURNS or stop the run" in refusals[0]
    assert run.status == Run.Status.CANCELLED and run.result["outcome"] == "stopped at turn limit"
    assert SandboxCall.objects.filter(run_id=run.id, system="model").count() == 6


def test_a_cost_card_above_a_lowered_ceiling_cannot_be_approved_and_nothing_is_written(client, demo, settings):
    run = over_budget_refund()
    card = pending_budget_card(run)
    assert card.proposed == {"cost_limit": "0.010034"}  # the cost plus a cent, under the default ceiling of 100
    settings.BUDGET_CEILING = Decimal("0.005")
    before = state(card)
    response = decide(client, demo["reviewer"], card, decision="approve", comment="")
    assert response.status_code == 422, response.content
    assert "above BUDGET_CEILING (0.005)" in response.json()["detail"]
    assert state(card) == before
    # An edit within the ceiling, or a stop, still goes through.
    response = decide(client, demo["reviewer"], card, decision="edit", comment="", payload={"cost_limit": "0.005"})
    assert response.status_code == 200, response.content
    assert drive(run).cost_limit == Decimal("0.005")


def test_a_turn_card_above_a_lowered_ceiling_cannot_be_approved_but_can_stop_the_run(agent, bob, settings):
    run = over_turns_agent()
    card = pending_budget_card(run)
    assert card.proposed == {"max_turns": 8}
    settings.AGENT_MAX_TURNS = 6
    before = state(card)
    with pytest.raises(InvalidDecision, match=r"above AGENT_MAX_TURNS \(6\)"):
        card.decide(bob, "approve")
    assert state(card) == before
    card.decide(bob, "reject", comment="enough")
    assert drive(run).status == Run.Status.CANCELLED


def test_a_bulk_approval_of_a_budget_card_is_refused(demo, settings):
    """A budget card's row does not show the limit it raises (approvals.inbox.row_shows): it is approved on the
    card, where the ceiling is checked (the tests below), never in bulk."""
    card = pending_budget_card(over_budget_refund())
    settings.BUDGET_CEILING = Decimal("0.005")
    before = state(card)
    [result] = decide_cards(demo["reviewer"], {card.pk: card.version}, "approve", "", "")
    assert result.status == 409 and "open the card to approve it" in result.detail
    assert state(card) == before


def test_a_run_at_the_ceiling_gets_a_card_that_only_stops_it(client, demo, settings):
    settings.BUDGET_CEILING = Decimal("0.00002")  # less than the first step cost
    run = over_budget_refund()
    card = pending_budget_card(run)
    assert card.proposed == {"cost_limit": "0.00002"}
    client.force_login(demo["reviewer"])
    page = client.get(f"/approvals/{card.pk}/").content.decode()
    assert "the ceiling of 0.00002 (BUDGET_CEILING) is reached" in page
    before = state(card)
    response = client.post(f"/approvals/{card.pk}/decide", {"decision": "approve", "version": card.version})
    assert response.status_code == 422
    assert "raise BUDGET_CEILING or stop the run" in response.content.decode()
    for limit in ("0.00002", "0.000034", "0.00003"):  # nothing above what it spent fits under the ceiling
        response = decide(client, demo["reviewer"], card, decision="edit", comment="", payload={"cost_limit": limit})
        assert response.status_code == 422, limit
    assert state(card) == before
    response = client.post(
        f"/approvals/{card.pk}/decide",
        {"decision": "reject", "version": card.version, "reason": "other", "comment": "at the ceiling"},
    )
    assert response.status_code in (200, 302)
    assert drive(run).status == Run.Status.CANCELLED


def test_an_edit_to_no_more_than_the_run_has_spent_is_refused(client, demo):
    run = over_budget_refund()
    card = pending_budget_card(run)
    before = state(card)
    response = decide(
        client, demo["reviewer"], card, decision="edit", comment="", payload={"cost_limit": str(run.cost)}
    )
    assert response.status_code == 422, response.content
    assert state(card) == before


def test_the_engine_holds_an_edited_limit_to_a_ceiling_lowered_since(demo, settings):
    run = over_budget_refund()
    card = pending_budget_card(run)
    card.decide(demo["reviewer"], "edit", payload={"cost_limit": "0.05"})  # under the ceiling of 100
    settings.BUDGET_CEILING = Decimal("0.02")  # still above what the card proposed (0.010034): the same question
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED and run.cost_limit == Decimal("0.02")


def test_a_ceiling_lowered_below_what_the_run_spent_asks_again_before_any_step(demo, settings):
    run = over_budget_refund()
    pending_budget_card(run).decide(demo["reviewer"], "approve")  # 0.010034, under the ceiling of 100
    settings.BUDGET_CEILING = Decimal("0.00002")
    run = drive(run)
    assert run.status == Run.Status.PAUSED and run.cost_limit == Decimal("0.000001")
    assert not run.steps.filter(name="lookup_customer").exists()
    assert pending_budget_card(run).proposed == {"cost_limit": "0.00002"}
