"""Races under an approval policy, in real concurrent transactions on PostgreSQL (threads, each its own
connection, released together; the decisions through the API):

- two people of one stage approve at once: one count each, nothing lost, the stage (here the card) completes
  once and the run is resumed once;
- a decision lands as the stage's deadline escalates it, or as the end of the chain rejects it (fail closed):
  exactly one outcome, each audited, the decision never lost silently (it counts, or is answered 409)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection, transaction
from django.test import Client

from approvals import sla
from approvals.models import Approval, Decision
from core.models import AuditEntry
from runs.models import Run
from tests.engine_helpers import queued_jobs
from tests.integration.approvals.test_api_approvals import bearer, decide, race, start_parked_run
from tests.integration.approvals.test_approval_policies import approver, make_policy

ROUNDS = 5


@pytest.fixture
def agent(transactional_db, demo):
    return User.objects.get(username="agent")


def test_two_people_of_one_stage_approving_at_once_both_count_and_it_completes_once(agent):
    people = [approver(name) for name in ("ann", "ben", "cid")]
    make_policy("two-of-three", [{"name": "leads", "quorum": 2, "users": people}])
    tokens = [bearer(people[0]), bearer(people[1])]
    for _ in range(ROUNDS):
        run, card = start_parked_run(Client(), agent)

        answers = race(2, lambda i, card=card: decide(Client(), tokens[i], card, decision="approve"))

        assert [a.status_code for a in answers] == [200, 200], [a.content for a in answers]
        card.refresh_from_db()
        assert card.status == Approval.Status.APPROVED
        deciders = Decision.objects.filter(approval=card).values_list("actor__username", flat=True)
        assert sorted(deciders) == ["ann", "ben"]
        given = AuditEntry.objects.filter(approval_id=card.pk, action="approval.approve").values_list("data", flat=True)
        assert sorted(d["approvals"] for d in given) == [1, 2]
        run.refresh_from_db()
        assert run.status == Run.Status.QUEUED and queued_jobs(run) == 1  # resumed once


def against_the_deadline(card: Approval, token: dict) -> list:
    """The person's approval (its HTTP status) and the card's deadline (apply_sla's answer) at the same moment."""
    late = card.due_at + timedelta(seconds=1)

    def work(i: int):
        if i == 0:
            return decide(Client(), token, card, decision="approve").status_code
        return sla.apply_sla(card.pk, late)

    return race(2, work)


@pytest.fixture
def escalating(agent):
    managers = Group.objects.create(name="managers")
    lead, manager = approver("lead"), approver("manager", managers)
    return lead, manager, managers


def test_a_decision_landing_as_the_stage_escalates(agent, escalating):
    lead, _, managers = escalating
    make_policy(
        "escalating",
        [
            {"name": "lead", "users": [lead], "sla": timedelta(minutes=30)},
            {"name": "managers", "purpose": "escalate", "groups": [managers], "sla": timedelta(hours=1)},
        ],
    )
    token, seen = bearer(lead), set()
    for _ in range(ROUNDS * 2):
        run, card = start_parked_run(Client(), agent)

        answer, escalation = against_the_deadline(card, token)

        # The lead's decision always counts: before the escalation (which then finds the card decided and does
        # nothing) or after it (the lead is still asked at the managers' level, which it completes).
        assert answer == 200
        card.refresh_from_db()
        assert card.status == Approval.Status.APPROVED
        decision = Decision.objects.get(approval=card)
        escalated = AuditEntry.objects.filter(approval_id=card.pk, action="policy.escalate").count()
        if escalation == "escalate":
            assert escalated == 1 and decision.stage_name == "managers"
            seen.add("escalated first")
        else:
            assert escalation is None and escalated == 0 and decision.stage_name == "lead"
            seen.add("decided first")
        assert AuditEntry.objects.filter(approval_id=card.pk, action="approval.approve").count() == 1
        run.refresh_from_db()
        assert run.status == Run.Status.QUEUED and queued_jobs(run) == 1
    print("orders seen:", sorted(seen))  # noqa: T201 - which interleavings the rounds met


def test_a_decision_landing_as_the_chain_ends_fail_closed(agent, escalating):
    lead, _, _ = escalating
    make_policy("lead-alone", [{"name": "lead", "users": [lead], "sla": timedelta(minutes=30)}], at_end="reject")
    token, seen = bearer(lead), set()
    for _ in range(ROUNDS * 2):
        run, card = start_parked_run(Client(), agent)

        answer, closed = against_the_deadline(card, token)

        card.refresh_from_db()
        decisions = list(Decision.objects.filter(approval=card).values_list("actor__username", "decision"))
        approved = AuditEntry.objects.filter(approval_id=card.pk, action="approval.approve").count()
        rejected = AuditEntry.objects.filter(approval_id=card.pk, action="sla.safe_default").count()
        if answer == 200:
            assert closed is None and card.status == Approval.Status.APPROVED
            assert decisions == [("lead", "approve")] and (approved, rejected) == (1, 0)
            seen.add("decided first")
        else:
            assert answer == 409 and closed == "safe_default" and card.status == Approval.Status.REJECTED
            assert decisions == [(None, "reject")] and (approved, rejected) == (0, 1)
            seen.add("fail-closed first")
        run.refresh_from_db()
        assert run.status == Run.Status.QUEUED and queued_jobs(run) == 1
    print("orders seen:", sorted(seen))  # noqa: T201 - which interleavings the rounds met


@pytest.mark.parametrize("end", ["escalate", "reject"])
def test_a_deadline_waits_for_a_decision_in_progress_and_then_does_nothing(agent, escalating, end):
    """The same race, one order forced: the deadline arrives while a decision holds the card (its transaction
    not yet committed). The SLA's compare-and-swap waits for it, then finds the card decided."""
    lead, _, managers = escalating
    stages = [{"name": "lead", "users": [lead], "sla": timedelta(minutes=30)}]
    if end == "escalate":
        stages.append({"name": "managers", "purpose": "escalate", "groups": [managers]})
    make_policy("racing", stages, at_end="reject")
    run, card = start_parked_run(Client(), agent)
    late = card.due_at + timedelta(seconds=1)
    results: list = []
    deadline = threading.Thread(target=lambda: (results.append(sla.apply_sla(card.pk, late)), connection.close()))
    with transaction.atomic():
        card.decide(lead, "approve", version=card.version)
        deadline.start()
        deadline.join(1.0)
        assert deadline.is_alive(), "the deadline did not wait for the decision holding the card"
    deadline.join(30)
    assert results == [None]
    card.refresh_from_db()
    assert card.status == Approval.Status.APPROVED and card.stage == 0
    assert not AuditEntry.objects.filter(approval_id=card.pk, action__in=["policy.escalate", "sla.safe_default"])
    assert list(Decision.objects.filter(approval=card).values_list("actor__username", flat=True)) == ["lead"]
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED and queued_jobs(run) == 1
