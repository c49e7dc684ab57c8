"""The rules of a decision (approvals.rules), on cards and decisions as plain values: what a decision must carry,
the count of a policy's stages (the two-person rule being a channel's one-stage policy), the outcome it gives the
engine and the SLA state. Who may decide, read through guardian's permissions, and that Approval.decide applies
all of it under its locks, once, whoever races it: tests/integration/approvals (test_two_person.py,
test_approval_policies.py, test_policy_races.py, test_decide_permission.py, test_sla.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from approvals import rules
from approvals.rules import AtEnd, DecisionKind, PolicyCount, SlaState, StagePurpose
from runs.gates import Kind, Outcome

NOW = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
APPROVE, EDIT, REJECT = DecisionKind.APPROVE, DecisionKind.EDIT, DecisionKind.REJECT


def person(pk: int) -> SimpleNamespace:
    return SimpleNamespace(pk=pk)


def decision(kind: str, actor: int | None, *, stage: int | None = 0, on_behalf_of: int | None = None):
    """A Decision as the count reads it."""
    return SimpleNamespace(decision=kind, actor_id=actor, on_behalf_of_id=on_behalf_of, stage=stage)


def stage(name: str, quorum: int = 1, *, purpose=StagePurpose.APPROVE, anyone=False, users=(), groups=()) -> dict:
    return {
        "name": name,
        "purpose": purpose,
        "quorum": quorum,
        "sla": 3600,
        "anyone": anyone,
        "users": list(users),
        "groups": list(groups),
    }


# An admin's policy: a team lead (user 10), escalated to user 11 then to user 12; then finance, two of users 20-22.
POLICY = {
    "id": 7,
    "name": "refunds",
    "version": 3,
    "at_end": AtEnd.REJECT,
    "stages": [
        stage("team lead", users=[10]),
        stage("lead's deputy", purpose=StagePurpose.ESCALATE, users=[11]),
        stage("head of support", purpose=StagePurpose.ESCALATE, users=[12]),
        stage("finance", 2, users=[20, 21, 22]),
        stage("finance director", purpose=StagePurpose.ESCALATE, users=[23]),
    ],
}


def channel(required_approvals: int = 1, escalation_policy: str = "escalate") -> SimpleNamespace:
    return SimpleNamespace(
        name="payments",
        required_approvals=required_approvals,
        sla=timedelta(hours=4),
        escalation_policy=escalation_policy,
    )


def card(policy: dict | None, row: int = 0, *, kind=Kind.ACTION, creator: int = 99, on=None) -> SimpleNamespace:
    """A card as the rules read it; under its channel's rule when `policy` is None (Approval.rule)."""
    on = on or channel()
    return SimpleNamespace(
        policy=policy,
        rule=policy if not rules.is_channel_rule(policy) else rules.channel_rule_now(policy, on),
        stage=row,
        kind=kind,
        channel=None,  # who still holds approve_channel is guardian's (the database's): not asked here
        run_created_by_id=creator,
    )


# --- what a decision carries -----------------------------------------------------------------------------------


def test_a_decision_is_approve_edit_or_reject():
    with pytest.raises(rules.InvalidDecision, match="decision must be approve, edit or reject, not 'maybe'"):
        rules.Asked.of("maybe")


@pytest.mark.parametrize("comment", ["", "   \n"])
def test_a_rejection_says_why(comment):
    with pytest.raises(rules.InvalidDecision, match="a rejection needs a comment"):
        rules.Asked.of("reject", comment=comment)
    assert rules.Asked.of("reject", comment="  wrong customer ").comment == "wrong customer"


@pytest.mark.parametrize("payload", [None, [], "amount: 5"])
def test_an_edit_brings_its_payload_as_an_object(payload):
    with pytest.raises(rules.InvalidDecision, match="an edit needs the new payload"):
        rules.Asked.of("edit", payload=payload)


def test_only_an_edit_keeps_a_payload():
    assert rules.Asked.of("edit", payload={"amount": 5}).payload == {"amount": 5}
    assert rules.Asked.of("approve", payload={"amount": 5}).payload is None


def test_a_shadow_cards_answer_is_agree_or_disagree_and_what_was_done_by_hand_is_bounded():
    asked = rules.Asked.of("approve", agreement="agree", done_by_hand="  refunded by hand ")
    assert (asked.agreement, asked.done_by_hand) == ("agree", "refunded by hand")
    with pytest.raises(rules.InvalidDecision, match="agreement must be agree or disagree"):
        rules.Asked.of("approve", agreement="perhaps")
    rules.Asked.of("approve", done_by_hand="x" * rules.DONE_BY_HAND_MAX)
    with pytest.raises(rules.InvalidDecision, match=f"longer than {rules.DONE_BY_HAND_MAX} characters"):
        rules.Asked.of("approve", done_by_hand="x" * (rules.DONE_BY_HAND_MAX + 1))


# --- the count and the outcome ----------------------------------------------------------------------------------


def test_what_counts_toward_an_approval_is_given_since_the_last_edit():
    a, e, b, r = decision(APPROVE, 1), decision(EDIT, 2), decision(APPROVE, 3), decision(REJECT, 4)
    assert rules.counted([a, e, b, r], APPROVE) == [e, b]  # the edit restarts the count, its author counting
    assert rules.counted([a, r], APPROVE) == [a]
    assert rules.counted([a, e, b, r], REJECT) == [r]
    assert rules.counted([a, e, b, r], Outcome.REJECTED) == [r]
    assert rules.counted([a, e, b, r], EDIT) == []  # a new edit restarts it


def test_the_outcome_the_engine_is_told():
    assert rules.outcome(REJECT, [decision(EDIT, 1)]) == Outcome.REJECTED
    assert rules.outcome(EDIT, []) == Outcome.EDITED
    assert rules.outcome(APPROVE, [decision(EDIT, 1)]) == Outcome.EDITED  # the pending edit a second person approved
    assert rules.outcome(APPROVE, [decision(APPROVE, 1)]) == Outcome.APPROVED


# --- the SLA ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sla", "window"),
    [
        (timedelta(hours=4), timedelta(hours=1)),  # a quarter of it
        (timedelta(minutes=20), timedelta(minutes=5)),  # the floor
        (timedelta(minutes=10), timedelta(minutes=5)),
    ],
)
def test_a_card_is_due_soon_in_the_last_quarter_of_its_sla_or_its_last_five_minutes(sla, window):
    assert rules.due_soon_window(sla) == window


def test_the_sla_state_of_a_card():
    sla = timedelta(hours=4)  # due soon in its last hour
    state = rules.sla_state
    assert state(NOW + timedelta(hours=2), sla, NOW) == SlaState.ON_TIME
    assert state(NOW + timedelta(hours=1), sla, NOW) == SlaState.ON_TIME  # exactly the window: not yet
    assert state(NOW + timedelta(minutes=59), sla, NOW) == SlaState.DUE_SOON
    assert state(NOW + timedelta(seconds=1), sla, NOW) == SlaState.DUE_SOON
    assert state(NOW, sla, NOW) == SlaState.BREACHED  # the deadline itself
    assert state(NOW - timedelta(days=1), sla, NOW) == SlaState.BREACHED
    assert state(NOW - timedelta(days=1), sla, NOW, is_open=False) == SlaState.DECIDED
    assert set(rules.OPEN_SLA_STATES) == set(SlaState) - {SlaState.DECIDED}


def test_the_sla_ranges_are_the_sla_state():
    """The inbox's counts read each state as a range of due_at per channel (rules.sla_ranges): the same rule, to the
    microsecond at each boundary."""
    channels = [SimpleNamespace(name="slow", sla=timedelta(hours=4)), SimpleNamespace(name="fast", sla=timedelta(0))]
    tick = timedelta(microseconds=1)
    for channel in channels:
        ranges = [r for r in rules.sla_ranges(channels, NOW) if r.channel is channel]
        assert [r.state for r in ranges] == [SlaState.BREACHED, SlaState.DUE_SOON, SlaState.ON_TIME]
        window = rules.due_soon_window(channel.sla)
        for due_at in (
            NOW - timedelta(days=400),
            NOW - tick,
            NOW,
            NOW + tick,
            NOW + window - tick,
            NOW + window,
            NOW + window + tick,
            NOW + timedelta(days=400),
        ):
            inside = [r.state for r in ranges if r.after < due_at < r.before]
            assert inside == [rules.sla_state(due_at, channel.sla, NOW)], due_at


# --- a policy's shape -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("anyone", "quorum", "people", "errors"),
    [
        (False, 2, 3, []),
        (True, 5, 0, []),  # anyone with approve_channel: the channel's approvers
        (False, 0, 3, ["the quorum must be at least 1"]),
        (True, None, 0, ["the quorum must be at least 1"]),
        (False, 1, 0, ["the stage names nobody: tick 'the channel's approvers' or name groups or users"]),
        (False, 4, 3, ["the quorum (4) is more than the 3 people the stage names"]),
    ],
)
def test_what_is_wrong_with_a_stage(anyone, quorum, people, errors):
    assert rules.stage_errors(anyone=anyone, quorum=quorum, people=people) == errors


def test_a_policy_starts_with_a_stage_that_approves():
    assert rules.policy_errors([StagePurpose.APPROVE, StagePurpose.ESCALATE]) == []
    assert rules.policy_errors([]) == ["a policy needs at least one stage"]
    assert rules.policy_errors([StagePurpose.ESCALATE, StagePurpose.APPROVE])[0].startswith("the first stage must")


def test_the_rows_of_a_policy_stages_and_their_escalation_levels():
    assert [rules.stage_of_level(POLICY, row) for row in range(5)] == [0, 0, 0, 3, 3]
    assert [rules.next_level(POLICY, row) for row in range(5)] == [1, 2, None, 4, None]
    assert [rules.next_stage(POLICY, row) for row in range(5)] == [3, 3, 3, None, None]


# --- a channel's own rule -----------------------------------------------------------------------------------------


def test_a_channels_rule_is_a_one_stage_policy_of_anyone_who_may_approve_it():
    rule = rules.channel_rule(channel(required_approvals=2))
    assert rule == {
        "id": None,
        "name": "payments channel rule",
        "version": 0,
        "channel_rule": True,
        "escalation_policy": "escalate",
        "at_end": AtEnd.WAIT,
        "stages": [stage("approvers of payments", 2, anyone=True) | {"sla": 4 * 3600}],
    }
    assert rules.channel_rule(channel(escalation_policy="safe_default"))["at_end"] == AtEnd.REJECT
    assert rules.is_channel_rule(rule) and rules.is_channel_rule(None) and not rules.is_channel_rule(POLICY)


def test_a_channel_raising_its_approvals_applies_to_open_cards_and_lowering_them_does_not():
    carried = rules.channel_rule(channel(required_approvals=2))
    raised = rules.channel_rule_now(carried, channel(required_approvals=3))
    assert raised["stages"][0]["quorum"] == 3 and carried["stages"][0]["quorum"] == 2  # a copy
    assert rules.channel_rule_now(carried, channel(required_approvals=1)) is carried
    # A card opened before cards carried their rule reads the channel's now.
    assert rules.channel_rule_now(None, channel(required_approvals=2)) == carried


# --- who a card asks ----------------------------------------------------------------------------------------------


def test_an_escalation_adds_people_and_those_asked_before_may_still_answer():
    policy = {**POLICY, "stages": [*POLICY["stages"][:3], stage("finance", 2, users=[20], groups=[5])]}
    assert rules.Asking.at(policy, 0) == rules.Asking(False, frozenset({10}), frozenset())
    assert rules.Asking.at(policy, 2) == rules.Asking(False, frozenset({10, 11, 12}), frozenset())
    assert rules.Asking.at(policy, 3) == rules.Asking(False, frozenset({20}), frozenset({5}))
    assert rules.Asking.at(rules.channel_rule(channel()), 0).anyone


def test_who_is_asked_by_name():
    asking = rules.Asking.at(POLICY, 1)
    assert asking.includes(person(11)) and asking.includes(person(10)) and not asking.includes(person(12))
    assert rules.Asking(True, frozenset(), frozenset()).includes(person(1))


def test_a_cover_decides_for_the_first_absent_person_the_stage_names_never_the_runs_creator():
    asking = rules.Asking.at(POLICY, 2)  # users 10, 11, 12
    assert asking.covered([30, 11, 12], creator_id=99) == 11
    assert asking.covered([30, 31], creator_id=99) is None
    assert asking.covered([10, 11], creator_id=10) == 11


# --- the one count: PolicyCount ---------------------------------------------------------------------------------


def test_a_channel_rule_of_one_approval_needs_no_count():
    count = PolicyCount.of(card(None), person(1), APPROVE, [])
    assert (count.applies, count.complete, count.to_stage, count.channel_rule) == (False, True, None, True)
    assert (count.given, count.required, count.stage_name) == (1, 1, "approvers of payments")


def test_the_two_person_rule_needs_a_second_person():
    two = card(None, on=channel(required_approvals=2))
    first = PolicyCount.of(two, person(1), APPROVE, [])
    assert (first.applies, first.complete, first.to_stage, first.given, first.required) == (True, False, 0, 1, 2)
    second = PolicyCount.of(two, person(2), APPROVE, [decision(APPROVE, 1, stage=None)])
    assert (second.complete, second.to_stage, second.given) == (True, None, 2)
    second.check(person(2))
    again = PolicyCount.of(two, person(1), APPROVE, [decision(APPROVE, 1, stage=None)])
    with pytest.raises(rules.SecondApproverNeeded, match="the two-person rule needs a different person"):
        again.check(person(1))


def test_an_edit_counts_as_its_authors_approval_and_restarts_the_count():
    two = card(None, on=channel(required_approvals=2))
    edit = PolicyCount.of(two, person(1), EDIT, [decision(APPROVE, 2, stage=None)])
    assert (edit.complete, edit.given, edit.counted) == (False, 1, ())  # the approval before it no longer counts
    after = PolicyCount.of(two, person(2), APPROVE, [decision(APPROVE, 2, stage=None), decision(EDIT, 1, stage=None)])
    assert (after.complete, after.given) == (True, 2)
    # The edit's author may not approve their own edit as the second person.
    with pytest.raises(rules.SecondApproverNeeded):
        PolicyCount.of(two, person(1), APPROVE, [decision(EDIT, 1, stage=None)]).check(person(1))


def test_a_rejection_ends_the_card_at_once():
    count = PolicyCount.of(card(None, on=channel(required_approvals=2)), person(1), REJECT, [decision(APPROVE, 2)])
    assert (count.applies, count.complete, count.to_stage, count.counted) == (False, True, None, ())
    under_policy = PolicyCount.of(card(POLICY, 3), person(20), REJECT, [])
    assert (under_policy.applies, under_policy.complete, under_policy.stage_name) == (True, True, "finance")


def test_on_a_reconcile_card_it_did_not_happen_needs_the_quorums_too():
    reconcile = card(None, kind=Kind.RECONCILE, on=channel(required_approvals=2))
    first = PolicyCount.of(reconcile, person(1), REJECT, [])
    assert (first.complete, first.given, first.required) == (False, 1, 2)
    assert PolicyCount.of(reconcile, person(2), REJECT, [decision(REJECT, 1, stage=None)]).complete


def test_a_policy_moves_stage_by_stage_to_its_end():
    lead = PolicyCount.of(card(POLICY, 0), person(10), APPROVE, [])
    # The team lead's quorum is met: the card goes to finance, where none of its two have answered yet.
    assert (lead.complete, lead.to_stage, lead.given, lead.required, lead.applies) == (False, 3, 0, 2, True)
    earlier = [decision(APPROVE, 10, stage=0)]
    finance = PolicyCount.of(card(POLICY, 3), person(20), APPROVE, earlier)
    assert (finance.complete, finance.to_stage, finance.given, finance.required) == (False, 3, 1, 2)
    last = PolicyCount.of(card(POLICY, 3), person(21), APPROVE, [*earlier, decision(APPROVE, 20, stage=3)])
    assert (last.complete, last.to_stage, last.given, last.stage_name) == (True, None, 2, "finance")


def test_a_decision_at_an_escalation_level_counts_toward_its_stage():
    deputy = PolicyCount.of(card(POLICY, 1), person(11), APPROVE, [])
    assert (deputy.stage, deputy.stage_name, deputy.to_stage, deputy.given) == (1, "lead's deputy", 3, 0)
    director = PolicyCount.of(
        card(POLICY, 4), person(23), APPROVE, [decision(APPROVE, 10, stage=0), decision(APPROVE, 20, stage=3)]
    )
    assert director.complete and director.given == 2


def test_an_edit_at_a_later_stage_sends_the_card_back_to_the_first():
    earlier = [decision(APPROVE, 10, stage=0)]
    edit = PolicyCount.of(card(POLICY, 3), person(20), EDIT, earlier)
    assert (edit.stage, edit.to_stage, edit.given, edit.complete) == (3, 0, 0, False)


def test_a_person_counts_once_across_the_stages_of_a_policy():
    both = {**POLICY, "stages": [stage("team lead", users=[10]), stage("finance", 2, users=[10, 20])]}
    count = PolicyCount.of(card(both, 1), person(10), APPROVE, [decision(APPROVE, 10, stage=0)])
    with pytest.raises(rules.SecondApproverNeeded, match="its policy counts each person once, across its stages"):
        count.check(person(10))
    count.check(None)  # the system (the SLA policy) is never refused


def test_a_cover_decides_on_behalf_of_the_absent_person_and_counts_as_them():
    count = PolicyCount.of(card(POLICY, 3), person(40), APPROVE, [], covering=[21])
    assert count.on_behalf_of == 21
    # The absent person already answered: their cover cannot answer for them again.
    with pytest.raises(rules.SecondApproverNeeded):
        PolicyCount.of(card(POLICY, 3), person(40), APPROVE, [decision(APPROVE, 21, stage=3)], covering=[21]).check(
            person(40)
        )


def test_a_stage_that_does_not_ask_someone_refuses_them_naming_itself():
    assert rules.policy_refusal(person(10), card(POLICY, 0)) == ""
    assert rules.policy_refusal(None, card(POLICY, 0)) == ""
    refusal = rules.policy_refusal(person(20), card(POLICY, 0))
    assert refusal == "this card is at stage 'team lead' of its policy, which does not ask you"
    assert rules.policy_refusal(person(40), card(POLICY, 0), covering=[10]) == ""  # covering for the team lead
    assert rules.on_behalf_of(person(40), card(POLICY, 0), covering=[10]) == 10
    assert rules.on_behalf_of(person(10), card(POLICY, 0), covering=[10]) is None  # asked themselves
