"""Approval.decide checks the actor's right to decide the card's channel itself (`core.approve_channel`, a
django-guardian object permission; a superuser holds every permission), whichever code calls it: a person without
it gets NotAllowed (403) and nothing is written. The system (no actor: approvals.sla) still decides."""

from __future__ import annotations

import copy

import pytest
from django.contrib.auth.models import Group, User
from guardian.shortcuts import assign_perm

from approvals.errors import NotAllowed
from approvals.models import Approval, Decision
from core.models import AuditEntry, Channel
from runs import submission
from runs.models import Run
from tests.engine_helpers import REFUND, drive, queued_jobs


@pytest.fixture
def card(demo) -> Approval:
    run = drive(submission.submit(workflow="refund", input=REFUND, created_by=demo["agent"])[0])
    assert run.status == Run.Status.WAITING_HUMAN
    return Approval.objects.get(run=run)


def everything(card: Approval) -> tuple:
    """What a refused decision must leave as it was."""
    card = Approval.objects.get(pk=card.pk)
    run = Run.objects.get(pk=card.run_id)
    return (
        card.status,
        card.version,
        card.decided_at,
        card.amount_minor,
        Decision.objects.count(),
        AuditEntry.objects.filter(action__startswith="approval.").count(),
        run.status,
        run.updated_at,
        queued_jobs(run),
    )


def reviewer_of_email_only() -> User:
    user = User.objects.create_user("erin")
    assign_perm("core.approve_channel", user, Channel.objects.get(name="email"))
    return user


def deactivated_reviewer() -> User:
    user = User.objects.create_user("rita", is_active=False)
    assign_perm("core.approve_channel", user, Channel.objects.get(name="payments"))
    return user


def operator_of_payments() -> User:
    user = User.objects.get(username="ops")  # operate_channel on every channel, approve_channel on none
    assert user.has_perm("core.operate_channel", Channel.objects.get(name="payments"))
    return user


DECISIONS = {
    "approve": {},
    "reject": {"comment": "no", "reason": "policy"},
    "edit": {"payload": None},  # filled with a valid edit below
}


@pytest.mark.parametrize("decision", DECISIONS)
@pytest.mark.parametrize(
    "who",
    [
        lambda: User.objects.get(username="outsider"),
        operator_of_payments,
        reviewer_of_email_only,
        deactivated_reviewer,
    ],
    ids=["outsider", "ops", "reviewer_of_another_channel", "deactivated_reviewer"],
)
def test_it_refuses_a_person_without_approve_channel_and_writes_nothing(card, who, decision):
    actor = who()
    options = dict(DECISIONS[decision])
    if decision == "edit":
        options["payload"] = copy.deepcopy(card.proposed)
        options["payload"]["refund"]["amount_cents"] = 100
    before = everything(card)

    with pytest.raises(NotAllowed, match="approve_channel") as refused:
        card.decide(actor, decision, version=card.version, **options)

    assert refused.value.status == 403
    assert everything(card) == before


def test_a_reviewer_of_the_channel_decides(card, demo):
    card.decide(demo["reviewer"], "approve", version=card.version)
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.APPROVED


def test_a_superuser_decides(card, demo):
    card.decide(demo["admin"], "approve", version=card.version)
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.APPROVED


def test_a_member_of_a_group_that_may_approve_the_channel_decides(card):
    group = Group.objects.create(name="payments-reviewers")
    assign_perm("core.approve_channel", group, Channel.objects.get(name="payments"))
    user = User.objects.create_user("gina")
    user.groups.add(group)
    card.decide(user, "approve", version=card.version)
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.APPROVED


def test_the_system_decides_without_a_person(card):
    """The SLA policy's safe default decides with no actor: no permission applies."""
    card.decide(None, "reject", comment="SLA expired", reason="policy", version=card.version)
    card.refresh_from_db()
    assert card.status == Approval.Status.REJECTED
    assert Decision.objects.get(approval=card).actor is None
