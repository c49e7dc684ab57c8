"""What a decision must fit before anything is written (approvals.rules.check) and the one validator of an edit
(approvals.edits): a budget card's new limit, an agent's turn limit, an action card's gate declaration, a reconcile
card that is not edited, and a gate this process cannot find (refused, never checked less). On cards as plain
values; through Approval.decide, the card page and the API: tests/integration/approvals (test_api_approvals.py,
test_card_view.py, test_pending_edit.py) and tests/integration/runs/test_budget_ceiling.py."""

from __future__ import annotations

from decimal import Decimal
from types import SimpleNamespace

import pytest
from pydantic import BaseModel, Field

from approvals import edits, rules
from runs.gates import ANY_LEAF, GateSpec, Kind


def run(cost: str = "1.50", workflow: str = "refund", version: int = 1) -> SimpleNamespace:
    return SimpleNamespace(cost=Decimal(cost), workflow=workflow, workflow_version=version, created_by_id=99)


def card(kind=Kind.ACTION, proposed=None, *, current=None, to_execute=None, **fields) -> SimpleNamespace:
    nothing_decided = SimpleNamespace(order_by=lambda *_: SimpleNamespace(first=lambda: None))
    values = {
        "kind": kind,
        "proposed": proposed or {},
        "current": current,
        "to_execute": to_execute,
        "run": run(),
        "step_seq": 2,
        "status": "pending",
        "OPEN": ("pending", "escalated"),
        "version": 4,
        "shadow": False,
        "decisions": nothing_decided,
        "decided_at": None,
    }
    return SimpleNamespace(**(values | fields))


def budget(cost_limit="5.00", spent="1.50", **fields) -> SimpleNamespace:
    return card(Kind.BUDGET, {"cost_limit": cost_limit}, run=run(spent), **fields)


def turns(max_turns=40, taken=30, **fields) -> SimpleNamespace:
    return card(Kind.BUDGET, {"max_turns": max_turns}, current={"turns": taken}, **fields)


@pytest.fixture(autouse=True)
def _ceilings(settings):
    settings.BUDGET_CEILING, settings.AGENT_MAX_TURNS = Decimal("100"), 100


# --- budget cards --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"cost_limit": "2.50"}, None),
        ({"cost_limit": 50}, None),
        ({"cost_limit": "100"}, None),
        ({"cost_limit": "2.5", "note": "x"}, {"loc": "payload", "msg": "must be {cost_limit} and nothing else"}),
        ([], {"loc": "payload", "msg": "must be {cost_limit} and nothing else"}),
        ({"cost_limit": "two"}, {"loc": "cost_limit", "msg": 'must be a decimal number, such as "2.50"'}),
        ({"cost_limit": True}, {"loc": "cost_limit", "msg": 'must be a decimal number, such as "2.50"'}),
        ({"cost_limit": 2.5}, {"loc": "cost_limit", "msg": 'must be a decimal number, such as "2.50"'}),
        ({"cost_limit": "NaN"}, {"loc": "cost_limit", "msg": 'must be a decimal number, such as "2.50"'}),
        ({"cost_limit": "Infinity"}, {"loc": "cost_limit", "msg": 'must be a decimal number, such as "2.50"'}),
        ({"cost_limit": "1.50"}, {"loc": "cost_limit", "msg": "must be more than what the run has spent (1.50)"}),
        ({"cost_limit": "100.01"}, {"loc": "cost_limit", "msg": "must be at most 100 (BUDGET_CEILING)"}),
        ({"cost_limit": "2.0000001"}, {"loc": "cost_limit", "msg": "has at most 6 decimal places"}),
    ],
)
def test_a_budget_cards_edit_is_a_new_cost_limit_above_what_was_spent_within_the_ceiling(payload, error):
    assert edits.edit_errors(budget(), payload) == ([] if error is None else [error])


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"max_turns": 60}, None),
        ({"max_turns": 100}, None),
        ({"max_turns": 60, "cost_limit": "2"}, {"loc": "payload", "msg": "must be {max_turns} and nothing else"}),
        ({"max_turns": "60"}, {"loc": "max_turns", "msg": "must be a whole number"}),
        ({"max_turns": True}, {"loc": "max_turns", "msg": "must be a whole number"}),
        ({"max_turns": 60.0}, {"loc": "max_turns", "msg": "must be a whole number"}),
        ({"max_turns": 30}, {"loc": "max_turns", "msg": "must be more than the turns taken (30)"}),
        ({"max_turns": 101}, {"loc": "max_turns", "msg": "must be at most 100 (AGENT_MAX_TURNS)"}),
    ],
)
def test_an_agents_turn_limit_card_takes_only_a_larger_turn_limit(payload, error):
    assert edits.edit_errors(turns(), payload) == ([] if error is None else [error])
    assert edits.editable_paths(turns()) == ("max_turns",)


def test_approving_a_budget_card_as_proposed_is_held_to_the_ceiling_too(settings):
    assert edits.approval_refusal(budget("5.00")) == ""
    settings.BUDGET_CEILING = Decimal("4")  # lowered since the card opened
    assert edits.approval_refusal(budget("5.00")) == (
        "this card proposes a cost limit of 5.00, above BUDGET_CEILING (4), lowered since it opened: edit it to at "
        "most 4, or stop the run"
    )
    assert edits.approval_refusal(budget("4", spent="4")).startswith("the ceiling is reached (the run has spent 4;")
    # Under the two-person rule a pending edit is what the approval runs.
    assert edits.approval_refusal(budget("5.00", to_execute={"cost_limit": "3"})) == ""
    assert edits.approval_refusal(budget("1.50", spent="1.50", to_execute=None)) == (
        "this card's cost limit of 1.50 leaves no room (the run has spent 1.50): edit it to more, or stop the run"
    )
    assert edits.approval_refusal(turns(120, taken=30)).startswith("this card proposes a turn limit of 120")
    assert edits.approval_refusal(card(Kind.ACTION, {"amount": 5})) == ""


# --- reconcile and action cards --------------------------------------------------------------------------------------


def test_a_reconcile_card_is_approved_or_rejected_not_edited():
    reconcile = card(Kind.RECONCILE, {"happened": "?"})
    assert edits.edit_errors(reconcile, {"happened": "yes"}) == [
        {"loc": "decision", "msg": "a reconcile card is approved (it happened) or rejected, not edited"}
    ]
    assert not edits.accepts_edits(reconcile)


class Refund(BaseModel):
    order_id: str
    amount_cents: int = Field(gt=0)


def _no_more_than_proposed(proposed: dict, edited: dict) -> list[dict]:
    if edited["amount_cents"] > proposed["amount_cents"]:
        return [{"loc": "amount_cents", "msg": "may not be more than proposed"}]
    return []


PROPOSED = {"order_id": "o-1", "amount_cents": 900, "meta": {"channel": "web"}}
GATES = {
    "declares nothing": GateSpec(),
    "any leaf": GateSpec(editable=ANY_LEAF),
    "the amount": GateSpec(proposal=Refund, editable=("amount_cents",), check_edit=_no_more_than_proposed),
}


@pytest.fixture
def gate(monkeypatch):
    """An action card whose gate is `spec`, found as an external agent's cards are (edits.register_resolver)."""

    def action_card(spec: GateSpec | None) -> SimpleNamespace:
        monkeypatch.setitem(edits._resolvers, "a-resolved-workflow", lambda card: spec)
        return card(Kind.ACTION, PROPOSED, run=run(workflow="a-resolved-workflow"))

    return action_card


@pytest.mark.parametrize(
    ("spec", "payload", "errors"),
    [
        ("declares nothing", {**PROPOSED, "amount_cents": 1}, []),
        (
            "declares nothing",
            {**PROPOSED, "amount_cents": "1"},
            [{"loc": "amount_cents", "msg": "must be a whole number"}],
        ),
        (
            "declares nothing",
            {"order_id": "o-1", "meta": {}},
            [
                {"loc": "amount_cents", "msg": "is required"},
                {"loc": "meta.channel", "msg": "is required"},
            ],
        ),
        ("declares nothing", {**PROPOSED, "extra": 1}, [{"loc": "extra", "msg": "is not part of the proposal"}]),
        ("declares nothing", "900", [{"loc": "payload", "msg": "must be an object"}]),
        ("any leaf", {**PROPOSED, "order_id": "o-2", "meta": {"channel": "phone"}}, []),
        (
            "any leaf",
            {**PROPOSED, "meta": {"channel": "web", "by": "me"}},
            [{"loc": "meta.by", "msg": "is not part of the proposal"}],
        ),
        ("the amount", {**PROPOSED, "amount_cents": 500}, []),
        ("the amount", {**PROPOSED, "order_id": "o-2"}, [{"loc": "order_id", "msg": "may not be changed"}]),
        (
            "the amount",
            {**PROPOSED, "amount_cents": 901},
            [{"loc": "amount_cents", "msg": "may not be more than proposed"}],
        ),
        (
            "the amount",
            {**PROPOSED, "amount_cents": 0},
            [{"loc": "amount_cents", "msg": "Input should be greater than 0"}],
        ),
    ],
)
def test_an_action_cards_edit_is_what_its_gate_declares(gate, spec, payload, errors):
    assert edits.edit_errors(gate(GATES[spec]), payload) == errors


def test_the_leaves_a_person_may_change():
    assert edits.editable_paths(card(Kind.BUDGET, {"cost_limit": "5"})) == ("cost_limit",)


def test_the_editable_leaves_of_an_action_card(gate):
    assert edits.editable_paths(gate(GATES["the amount"])) == ("amount_cents",)
    assert edits.editable_paths(gate(GATES["any leaf"])) is None  # every leaf
    assert edits.editable_paths(gate(None)) is None  # a step that asks without declaring a gate
    assert edits.accepts_edits(gate(GATES["the amount"]))


def test_a_gate_this_process_cannot_find_refuses_the_edit_saying_why():
    unknown = card(Kind.ACTION, PROPOSED, run=run(workflow="not-deployed-here", version=9))
    with pytest.raises(edits.GateUnresolved, match="this console cannot load workflow not-deployed-here v9"):
        edits.edit_errors(unknown, PROPOSED)
    assert edits.accepts_edits(unknown)  # offered: the edit is then refused, saying why
    assert edits.editable_paths(unknown) is None
    asked = rules.Asked.of("edit", payload=PROPOSED)
    with pytest.raises(rules.CannotCheckEdit, match="try again once the deploy is complete"):
        rules.check(None, unknown, asked, version=None)


# --- the checks of Approval.decide, in order ----------------------------------------------------------------------


def test_a_decided_card_is_refused():
    decided = budget(status="approved")
    with pytest.raises(rules.AlreadyDecided, match="this card was already approved by system"):
        rules.check(None, decided, rules.Asked.of("approve"), version=None)


def test_a_decision_on_a_card_that_changed_since_it_was_seen_is_refused():
    with pytest.raises(rules.StaleVersion, match=r"the card changed \(version 4, you sent 3\): reload it"):
        rules.check(None, budget(), rules.Asked.of("approve"), version=3)
    rules.check(None, budget(), rules.Asked.of("approve"), version=4)
    rules.check(None, budget(), rules.Asked.of("approve"), version=None)  # not asked: Approval.decide's caller


def test_a_shadow_card_is_answered_with_an_agreement_and_only_a_shadow_card_is():
    with pytest.raises(rules.InvalidDecision, match="this is a shadow card"):
        rules.check(None, budget(shadow=True), rules.Asked.of("approve"), version=None)
    rules.check(None, budget(shadow=True), rules.Asked.of("approve", agreement="agree"), version=None)
    with pytest.raises(rules.InvalidDecision, match="recorded on shadow cards only"):
        rules.check(None, budget(), rules.Asked.of("approve", done_by_hand="did it"), version=None)


def test_an_edit_that_does_not_fit_is_refused_with_its_field_errors():
    asked = rules.Asked.of("edit", payload={"cost_limit": "1000"})
    with pytest.raises(rules.InvalidDecision) as refused:
        rules.check(None, budget(), asked, version=None)
    assert str(refused.value) == "this edit is not allowed: cost_limit must be at most 100 (BUDGET_CEILING)"
    assert refused.value.errors == [{"loc": "cost_limit", "msg": "must be at most 100 (BUDGET_CEILING)"}]


def test_an_approval_that_would_raise_the_limit_past_the_ceiling_is_refused(settings):
    settings.BUDGET_CEILING = Decimal("4")
    with pytest.raises(rules.InvalidDecision, match="this card cannot be approved: this card proposes a cost limit"):
        rules.check(None, budget("5.00"), rules.Asked.of("approve"), version=None)
    rules.check(None, budget("5.00"), rules.Asked.of("reject", comment="too much"), version=None)
