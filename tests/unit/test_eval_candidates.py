"""The candidate language of an evaluation (evals.rules) and its tally (evals.records.tally), without a database:
what a candidate does with a card, the paths its errors name, the period, and the figures of a few cards."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from evals.errors import CandidateInvalid, EmptyPeriod, PeriodInvalid
from evals.records import RecordedCard, tally
from evals.rules import Candidate, parse_when, period

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def card(pk=1, *, channel="payments", amount=1000, currency="EUR", status="approved", rule_id="", risk="medium",
         decisions=(("bob", "approve", "", ""),), waited=60) -> RecordedCard:  # fmt: skip
    created = NOW - timedelta(hours=pk)
    return RecordedCard(
        pk, f"run-{pk}", "refund", "action", channel, rule_id, risk, currency, amount, status, created,
        created + timedelta(seconds=waited), list(decisions),
    )  # fmt: skip


def test_it_takes_the_first_matching_rule_else_otherwise():
    candidate = Candidate.parse(
        {
            "rules": [
                {"if": {"risk": ["high"]}, "then": "refuse"},
                {"if": {"channel": ["payments", "crm"], "amount_below": 5000}, "then": "auto_approve"},
            ],
            "otherwise": "ask",
        }
    )
    assert candidate.action_for(card(risk="high", amount=1)) == "refuse"
    assert candidate.action_for(card(amount=4999)) == "auto_approve"
    assert candidate.action_for(card(amount=5000)) == "ask"
    assert candidate.action_for(card(amount=None)) == "ask"  # no amount: never an amount condition
    assert candidate.action_for(card(channel="email", amount=1)) == "ask"


def test_a_tool_condition_reads_the_tool_cards_rule_id():
    candidate = Candidate.parse({"rules": [{"if": {"tool": "refund_order"}, "then": "auto_approve"}]})
    assert candidate.action_for(card(rule_id="tool:refund_order")) == "auto_approve"
    assert candidate.action_for(card(rule_id="refund_order")) == "ask"


def test_every_error_is_listed_with_its_path():
    with pytest.raises(CandidateInvalid) as caught:
        Candidate.parse('{"rules": [{"if": {"amount_below": -1, "kind": "nope"}, "then": "maybe"}], "x": 1}')
    assert [e.split(":")[0] for e in caught.value.errors] == [
        "$.x",
        "$.rules[0].then",
        "$.rules[0].if.kind",
        "$.rules[0].if.amount_below",
    ]


def test_the_period_reads_ages_and_iso_dates():
    assert parse_when("30d", NOW) == NOW - timedelta(days=30)
    assert parse_when("12h", NOW) == NOW - timedelta(hours=12)
    assert parse_when("2026-11-01", NOW) == datetime(2026, 11, 1, tzinfo=UTC)
    assert parse_when("2026-11-01T10:00:00+01:00", NOW) == datetime(2026, 11, 1, 9, tzinfo=UTC)
    with pytest.raises(PeriodInvalid, match="neither an age"):
        parse_when("last week", NOW)
    with pytest.raises(PeriodInvalid, match="must be after"):
        period("2026-11-02", "2026-11-01", NOW)


def test_the_tally_of_a_few_cards():
    candidate = Candidate.parse(
        {"rules": [{"if": {"amount_below": 5000}, "then": "auto_approve"}], "quorum": {"approvers": 2}}
    )
    cards = [
        card(1, waited=10),  # auto-approved, approved: agreed
        card(2, status="rejected", decisions=[("rita", "reject", "no", "wrong_amount")], waited=30),  # dangerous
        card(3, amount=9000, decisions=[("bob", "approve", "", "")]),  # asked, one approver of two
        card(4, amount=9000, decisions=[("bob", "approve", "", ""), ("rita", "approve", "", "")]),  # asked, two
        card(5, status="rejected", decisions=[(None, "reject", "safe default", "sla")]),  # by the system
        card(6, status="expired", decisions=[]),
    ]
    figures = tally(candidate, cards)
    assert figures["matrix"]["auto_approve"] == {"approved": 1, "edited": 0, "rejected": 1}
    assert figures["matrix"]["ask"] == {"approved": 2, "edited": 0, "rejected": 0}
    assert figures["not_decided_by_person"] == {"expired": 1, "cancelled": 0, "by_system": 1}
    assert (figures["agreed"], figures["candidate_decided"], figures["agreement"]) == (1, 2, 0.5)
    assert figures["dangerous"]["cards"][0] | {} == {
        "card": 2, "run": "run-2", "workflow": "refund", "channel": "payments", "amount_minor": 1000,
        "currency": "EUR", "outcome": "rejected", "decided_by": ["rita"], "comment": "no", "reason": "wrong_amount",
    }  # fmt: skip
    assert figures["time_saved"] == {"cards": 2, "total_seconds": 40.0, "median_seconds": 20.0}
    assert [c["card"] for c in figures["quorum_short"]["cards"]] == [3]


def test_no_card_decided_by_a_person_is_an_empty_period():
    with pytest.raises(EmptyPeriod):
        tally(Candidate.parse({"otherwise": "ask"}), [card(6, status="expired", decisions=[])])
