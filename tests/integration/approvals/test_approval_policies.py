"""Approval policies (approvals.models.ApprovalPolicy) through the API: N of M named people, an ordered chain of
two stages, escalation through two levels to the fail-closed end (and to "keep waiting, alert ops"), delegation in
and out of its window; each with its audit entries. The admin's side (validation, audit): test_policy_admin.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from guardian.shortcuts import assign_perm

import tests.workflows  # noqa: F401 - registers test_named_policy
from approvals import evidence, inbox, sla
from approvals.errors import NotAllowed
from approvals.models import Approval, ApprovalPolicy, Decision, Delegation, Notification, PolicyStage
from approvals.tasks import send_notification
from core.models import AuditEntry, Channel
from runs import submission
from runs.models import Run
from tests.engine_helpers import drive, queued_jobs
from tests.integration.approvals.test_api_approvals import bearer, decide, snapshot, start_parked_run


def approver(username: str, *groups: Group) -> User:
    """A user who may approve every demo channel, in `groups`."""
    user = User.objects.create_user(username)
    for channel in Channel.objects.all():
        assign_perm("core.approve_channel", user, channel)
    user.groups.add(*groups)
    return user


def make_policy(name: str, stages: list[dict], *, at_end: str = "reject", applies_to: str = "") -> ApprovalPolicy:
    """A policy on payments; each stage {name, purpose, quorum, sla, users, groups, anyone}."""
    policy = ApprovalPolicy.objects.create(
        name=name, channel=Channel.objects.get(name="payments"), at_end=at_end, applies_to=applies_to
    )
    for position, spec in enumerate(stages):
        stage = PolicyStage.objects.create(
            policy=policy,
            position=position,
            name=spec["name"],
            purpose=spec.get("purpose", "approve"),
            quorum=spec.get("quorum", 1),
            sla=spec.get("sla"),
            channel_approvers=spec.get("anyone", False),
        )
        stage.users.set(spec.get("users", []))
        stage.groups.set(spec.get("groups", []))
    return policy


def listed(client, user) -> list[int]:
    response = client.get("/api/approvals?status=all", headers=bearer(user))
    assert response.status_code == 200
    return [card["id"] for card in response.json()]


def entries(card: Approval, action: str) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(approval_id=card.pk, action=action).order_by("id"))


# --- 2 of 3 --------------------------------------------------------------------------------------------------


@pytest.fixture
def three(demo):
    return [approver(name) for name in ("ann", "ben", "cid")]


def test_two_of_three_named_people(client, demo, three):
    ann, ben, cid = three
    make_policy("two-of-three", [{"name": "leads", "quorum": 2, "users": three}])
    run, card = start_parked_run(client, demo["agent"])
    assert card.policy["name"] == "two-of-three" and card.asked_users == sorted(u.pk for u in three)

    # The demo's reviewer may approve payments, but the policy does not name them: they see it, may not decide it,
    # and their inbox does not list it.
    before = snapshot(card)
    response = decide(client, demo["reviewer"], card, decision="approve")
    assert response.status_code == 403 and "does not ask you" in response.json()["detail"]
    assert snapshot(card) == before
    assert card.pk not in listed(client, demo["reviewer"]) and card.pk in listed(client, ann)

    response = decide(client, ann, card, decision="approve")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "pending" and body["policy_stage"]["stage"] == "leads"
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_HUMAN and queued_jobs(run) == 0

    # One person counts once.
    card.refresh_from_db()
    assert decide(client, ann, card, decision="approve").status_code == 409

    response = decide(client, ben, card, decision="approve")
    assert response.status_code == 200 and response.json()["status"] == "approved"
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED and queued_jobs(run) == 1
    first, second = entries(card, "approval.approve")
    assert (first.actor, first.data["approvals"], first.data["required"]) == ("ann", 1, 2)
    assert (second.actor, second.data["approvals"], second.data["required"]) == ("ben", 2, 2)
    assert second.data["policy_stage"] == {
        "policy": "two-of-three",
        "version": 1,
        "stage": "leads",
        "position": 1,
        "of": 1,
    }
    assert list(Decision.objects.filter(approval=card).values_list("stage_name", flat=True)) == ["leads", "leads"]
    # cid was never needed: the card is decided.
    card.refresh_from_db()
    assert decide(client, cid, card, decision="approve").status_code == 409


def test_a_rejection_by_one_of_them_ends_it(client, demo, three):
    make_policy("two-of-three", [{"name": "leads", "quorum": 2, "users": three}])
    _, card = start_parked_run(client, demo["agent"])
    response = decide(client, three[2], card, decision="reject", comment="not this one")
    assert response.status_code == 200 and response.json()["status"] == "rejected"


def test_the_runs_creator_never_decides_even_when_named(client, demo, three):
    make_policy("two-of-three", [{"name": "leads", "quorum": 2, "users": three}])
    _, card = start_parked_run(client, three[0])
    response = decide(client, three[0], card, decision="approve")
    assert response.status_code == 403 and "started this run" in response.json()["detail"]


def test_an_edit_restarts_the_count(client, demo, three):
    ann, ben, cid = three
    make_policy("two-of-three", [{"name": "leads", "quorum": 2, "users": three}])
    _, card = start_parked_run(client, demo["agent"])
    assert decide(client, ann, card, decision="approve").status_code == 200
    card.refresh_from_db()
    edited = {**card.proposed}
    edited["refund"] = {**edited["refund"], "amount_cents": 10_000}
    response = decide(client, ben, card, decision="edit", payload=edited, comment="less")
    assert response.status_code == 200 and response.json()["status"] == "pending", response.content
    card.refresh_from_db()
    # ann's approval was of the proposal: she approves the edit as a second person.
    response = decide(client, ann, card, decision="approve")
    assert response.status_code == 200 and response.json()["status"] == "edited"


# --- an ordered chain ----------------------------------------------------------------------------------------


@pytest.fixture
def chain(demo):
    leads, finance = Group.objects.create(name="leads"), Group.objects.create(name="finance")
    lead, fin, both = approver("lead", leads), approver("fin", finance), approver("both", leads, finance)
    make_policy(
        "lead-then-finance",
        [
            {"name": "team lead", "groups": [leads], "sla": timedelta(hours=1)},
            {"name": "finance", "groups": [finance], "sla": timedelta(hours=4)},
        ],
    )
    return lead, fin, both


def test_an_ordered_chain_of_two_stages(client, demo, chain):
    lead, fin, _ = chain
    run, card = start_parked_run(client, demo["agent"])
    assert card.pk in listed(client, lead) and card.pk not in listed(client, fin)
    before = snapshot(card)
    assert decide(client, fin, card, decision="approve").status_code == 403  # not yet finance's turn
    assert snapshot(card) == before

    started = timezone.now()
    response = decide(client, lead, card, decision="approve")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "pending" and body["policy_stage"]["stage"] == "finance"
    assert body["asked"] == {"anyone_on_channel": False, "users": [], "groups": ["finance"]}
    card.refresh_from_db()
    # The finance stage's own SLA, from the moment it began.
    assert started + timedelta(hours=4) <= card.due_at <= timezone.now() + timedelta(hours=4)
    assert card.pk not in listed(client, lead) and card.pk in listed(client, fin)
    assert decide(client, lead, card, decision="approve").status_code == 403
    (entry,) = entries(card, "approval.approve")
    assert entry.data["policy_stage"]["stage"] == "team lead" and entry.data["next_stage"]["stage"] == "finance"
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_HUMAN

    response = decide(client, fin, card, decision="approve")
    assert response.status_code == 200 and response.json()["status"] == "approved"
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    assert [(e.actor, e.data["policy_stage"]["stage"]) for e in entries(card, "approval.approve")] == [
        ("lead", "team lead"),
        ("fin", "finance"),
    ]


def test_one_person_counts_once_across_stages(client, demo, chain):
    _, _, both = chain
    _, card = start_parked_run(client, demo["agent"])
    assert decide(client, both, card, decision="approve").status_code == 200
    card.refresh_from_db()
    before = snapshot(card)
    response = decide(client, both, card, decision="approve")
    assert response.status_code == 409 and "once" in response.json()["detail"]
    assert snapshot(card) == before


def test_an_open_card_keeps_the_policy_it_opened_under(client, demo, chain):
    lead, fin, _ = chain
    _, card = start_parked_run(client, demo["agent"])
    # An admin makes it a one-stage policy of finance alone: the open card still asks the team lead first.
    ApprovalPolicy.objects.get().stages.get(name="team lead").delete()
    assert decide(client, fin, card, decision="approve").status_code == 403
    assert decide(client, lead, card, decision="approve").status_code == 200


def test_a_step_or_tool_policy_overrides_the_channels(client, demo, three):
    ann, ben, _ = three
    make_policy("channel-wide", [{"name": "leads", "quorum": 2, "users": three}])
    make_policy("refund-step", [{"name": "ben alone", "users": [ben]}], applies_to="approve_refund")
    _, card = start_parked_run(client, demo["agent"])
    assert card.policy["name"] == "refund-step"
    assert decide(client, ann, card, decision="approve").status_code == 403
    assert decide(client, ben, card, decision="approve").json()["status"] == "approved"


# --- escalation through two levels to the end ------------------------------------------------------------------


@pytest.fixture
def escalating(demo):
    ops = Group.objects.get_or_create(name="ops")[0]
    level1, level2 = Group.objects.create(name="managers"), Group.objects.create(name="directors")
    people = approver("lead"), approver("manager", level1), approver("director", level2)
    stages = [
        {"name": "lead", "users": [people[0]], "sla": timedelta(minutes=30)},
        {"name": "managers", "purpose": "escalate", "groups": [level1], "sla": timedelta(hours=1)},
        {"name": "directors", "purpose": "escalate", "groups": [level2], "sla": timedelta(hours=2)},
    ]
    return people, stages, ops


def test_escalation_through_two_levels_to_the_fail_closed_end(client, demo, escalating, settings):
    settings.NOTIFY_BACKENDS = ["email"]
    (lead, manager, director), stages, _ = escalating
    make_policy("escalating", stages, at_end="reject")
    run, card = start_parked_run(client, demo["agent"])
    assert card.pk not in listed(client, manager)

    now = card.due_at + timedelta(seconds=1)
    assert sla.apply_sla(card.pk, now) == "escalate"
    card.refresh_from_db()
    assert card.status == "escalated" and card.stage == 1 and card.assigned_group.name == "managers"
    assert card.due_at == now - timedelta(seconds=1) + timedelta(hours=1)
    # Escalation adds people: the lead may still answer, the managers now may, the directors not yet.
    assert card.pk in listed(client, lead) and card.pk in listed(client, manager)
    assert card.pk not in listed(client, director)
    (escalated,) = entries(card, "policy.escalate")
    assert escalated.actor == "system"
    assert escalated.data["from"]["stage"] == "lead" and escalated.data["policy_stage"]["stage"] == "managers"
    assert escalated.data["asked"]["groups"] == ["managers"] and escalated.data["asked"]["users"] == ["lead"]
    notification = Notification.objects.get(approval=card)
    assert notification.event == "policy.escalate" and notification.group.name == "managers"
    assert sla.apply_sla(card.pk, now) is None  # the same deadline again (the sweep behind the timer): nothing

    now = card.due_at + timedelta(seconds=1)
    assert sla.apply_sla(card.pk, now) == "escalate"
    card.refresh_from_db()
    assert card.stage == 2 and card.assigned_group.name == "directors"
    assert card.pk in listed(client, director)
    assert [e.data["policy_stage"]["stage"] for e in entries(card, "policy.escalate")] == ["managers", "directors"]

    now = card.due_at + timedelta(seconds=1)
    assert sla.apply_sla(card.pk, now) == "safe_default"
    card.refresh_from_db()
    assert card.status == "rejected"
    (closed,) = entries(card, "sla.safe_default")
    assert closed.data["comment"] == sla.FAIL_CLOSED_COMMENT and closed.data["policy_stage"]["stage"] == "directors"
    decision = Decision.objects.get(approval=card)
    assert decision.actor is None and decision.stage_name == "directors"
    (record,) = evidence.records([closed])
    assert record["decision"] == "reject" and record["policy_stage"]["stage"] == "directors"
    assert record["database"]["agrees_with_the_entry"], record["database"]["disagreements"]
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    # Nobody decides it afterwards.
    assert decide(client, director, card, decision="approve").status_code == 409


def test_an_escalation_emails_the_people_its_level_names_users_and_groups(client, demo, mailoutbox, settings):
    """A level may name users as well as groups (or only users): each person it asks gets one email with links of
    their own; nobody else (an earlier stage, a person without an address or inactive, the run's creator)."""
    settings.NOTIFY_BACKENDS = ["email"]
    managers = Group.objects.create(name="managers")
    lead, cfo = approver("lead"), approver("cfo")
    manager, both, _mute, gone = (approver(name, managers) for name in ("manager", "both", "mute", "gone"))
    for user in (lead, cfo, manager, both, gone):  # mute has no address
        User.objects.filter(pk=user.pk).update(email=f"{user.username}@x")
    User.objects.filter(pk=gone.pk).update(is_active=False)
    demo["agent"].groups.add(managers)  # the run's creator, in the group: never asked
    User.objects.filter(pk=demo["agent"].pk).update(email="agent@x")
    make_policy(
        "named-people",
        [
            {"name": "lead", "users": [lead], "sla": timedelta(minutes=30)},
            {"name": "finance", "purpose": "escalate", "users": [cfo, both], "groups": [managers]},
        ],
    )
    _, card = start_parked_run(client, demo["agent"])
    assert sla.apply_sla(card.pk, card.due_at + timedelta(seconds=1)) == "escalate"
    notification = Notification.objects.get(approval=card)
    assert send_notification(notification_id=notification.pk) == "sent"
    assert sorted(m.to[0] for m in mailoutbox) == ["both@x", "cfo@x", "manager@x"]
    assert all(m.body.count("/approvals/email/") == 2 for m in mailoutbox)  # their own approve and reject links


def test_an_escalation_to_users_alone_emails_them(client, demo, mailoutbox, settings):
    settings.NOTIFY_BACKENDS = ["email"]
    lead, cfo = approver("lead"), approver("cfo")
    User.objects.filter(pk=cfo.pk).update(email="cfo@x")
    make_policy(
        "users-only",
        [
            {"name": "lead", "users": [lead], "sla": timedelta(minutes=30)},
            {"name": "cfo", "purpose": "escalate", "users": [cfo]},
        ],
    )
    _, card = start_parked_run(client, demo["agent"])
    assert sla.apply_sla(card.pk, card.due_at + timedelta(seconds=1)) == "escalate"
    card.refresh_from_db()
    assert card.assigned_group is None  # no group to send to: before, the email was skipped
    assert send_notification(notification_id=Notification.objects.get(approval=card).pk) == "sent"
    assert [m.to for m in mailoutbox] == [["cfo@x"]]


def test_a_decision_after_an_escalation_counts_at_the_new_level(client, demo, escalating):
    (lead, manager, _), stages, _ = escalating
    make_policy("escalating", stages)
    _, card = start_parked_run(client, demo["agent"])
    assert sla.apply_sla(card.pk, card.due_at + timedelta(seconds=1)) == "escalate"
    card.refresh_from_db()
    response = decide(client, manager, card, decision="approve")  # the version is unchanged by the escalation
    assert response.status_code == 200 and response.json()["status"] == "approved"
    (entry,) = entries(card, "approval.approve")
    assert entry.data["policy_stage"]["stage"] == "managers"


def test_at_the_end_a_wait_policy_keeps_the_card_and_alerts_ops(client, demo, escalating, settings):
    settings.NOTIFY_BACKENDS = ["email"]
    (_, _, director), stages, ops = escalating
    make_policy("escalating", stages[:2], at_end="wait")
    _, card = start_parked_run(client, demo["agent"])
    sla.apply_sla(card.pk, card.due_at + timedelta(seconds=1))
    card.refresh_from_db()
    missed = card.due_at
    assert sla.apply_sla(card.pk, missed + timedelta(seconds=1)) == "alert_ops"
    card.refresh_from_db()
    assert card.status == "escalated" and card.stage == 1 and card.due_at > missed
    (alert,) = entries(card, "policy.exhausted")
    assert alert.actor == "system" and alert.data["policy_stage"]["stage"] == "managers"
    assert Notification.objects.filter(approval=card, event="policy.exhausted", group=ops).count() == 1
    assert not Decision.objects.filter(approval=card).exists()


# --- delegation ----------------------------------------------------------------------------------------------


@pytest.fixture
def away(demo):
    absent, cover = approver("absent"), approver("cover")
    make_policy("absent-alone", [{"name": "absent", "users": [absent]}])
    return absent, cover


def test_a_cover_decides_in_the_window_on_behalf_of_the_absent(client, demo, away):
    absent, cover = away
    _, card = start_parked_run(client, demo["agent"])
    assert card.pk not in listed(client, cover)
    Delegation.set(absent, cover, timezone.now() + timedelta(hours=2))
    (entry,) = AuditEntry.objects.filter(action="delegation.set")
    assert entry.actor == "absent" and entry.data["cover"] == "cover" and entry.data["before"] is None
    assert card.pk in listed(client, cover)

    response = decide(client, cover, card, decision="approve")
    assert response.status_code == 200 and response.json()["status"] == "approved"
    decision = Decision.objects.get(approval=card)
    assert decision.actor == cover and decision.on_behalf_of == absent
    (approved,) = entries(card, "approval.approve")
    assert approved.actor == "cover" and approved.data["on_behalf_of"] == "absent"
    # The evidence export says under which policy stage, and for whom, and the database agrees with the entry.
    (record,) = evidence.records([approved])
    assert record["on_behalf_of"] == "absent" and record["policy_stage"]["stage"] == "absent"
    assert record["database"]["decision_row"]["on_behalf_of"] == "absent"
    assert record["database"]["decision_row"]["policy_stage"] == "absent"
    assert record["database"]["card"]["policy"]["name"] == "absent-alone"
    assert record["database"]["agrees_with_the_entry"], record["database"]["disagreements"]


def test_outside_the_window_the_cover_may_not(client, demo, away):
    absent, cover = away
    _, card = start_parked_run(client, demo["agent"])
    Delegation.set(absent, cover, timezone.now() + timedelta(hours=2))
    Delegation.objects.filter(user=absent).update(until=timezone.now() - timedelta(seconds=1))  # the window ended
    before = snapshot(card)
    response = decide(client, cover, card, decision="approve")
    assert response.status_code == 403
    assert snapshot(card) == before and card.pk not in listed(client, cover)
    # Cleared early: the same.
    Delegation.set(absent, cover, timezone.now() + timedelta(hours=2))
    assert Delegation.clear(absent)
    assert decide(client, cover, card, decision="approve").status_code == 403
    (cleared,) = AuditEntry.objects.filter(action="delegation.clear")
    assert cleared.actor == "absent" and cleared.data["cover"] == "cover"
    # The absent person still decides their own cards.
    assert decide(client, absent, card, decision="approve").status_code == 200


@pytest.mark.parametrize(
    ("who", "until", "error"),
    [
        ("self", timedelta(hours=1), "yourself"),
        ("dave", timedelta(hours=1), "may not approve"),
        ("cover", -timedelta(minutes=1), "in the future"),
    ],
)
def test_a_delegation_that_may_not_be_set_changes_nothing(demo, away, dave, who, until, error):
    absent, cover = away
    target = {"self": absent, "dave": dave, "cover": cover}[who]
    audited = AuditEntry.objects.count()
    with pytest.raises(ValueError, match=error):
        Delegation.set(absent, target, timezone.now() + until)
    assert not Delegation.objects.exists() and AuditEntry.objects.count() == audited


def test_an_edit_in_a_chain_sends_the_card_back_to_its_first_stage(client, demo, chain):
    lead, fin, _ = chain
    _, card = start_parked_run(client, demo["agent"])
    assert decide(client, lead, card, decision="approve").status_code == 200
    card.refresh_from_db()
    edited = {**card.proposed, "refund": {**card.proposed["refund"], "amount_cents": 9_000}}
    response = decide(client, fin, card, decision="edit", payload=edited, comment="less")
    assert response.status_code == 200, response.content
    # The lead approved the proposal, not the edit: the team lead stage asks again; finance's edit counts for
    # finance once the card is back there.
    assert response.json()["policy_stage"]["stage"] == "team lead" and response.json()["status"] == "pending"
    card.refresh_from_db()
    response = decide(client, lead, card, decision="approve")
    assert response.status_code == 200 and response.json()["status"] == "edited"
    assert response.json()["to_execute"]["refund"]["amount_cents"] == 9_000
    stages = [
        (e.actor, e.action, e.data["policy_stage"]["stage"])
        for e in AuditEntry.objects.filter(approval_id=card.pk, action__startswith="approval.").order_by("id")
    ]
    assert stages == [
        ("lead", "approval.approve", "team lead"),
        ("fin", "approval.edit", "finance"),
        ("lead", "approval.approve", "team lead"),
    ]


def test_a_gate_may_name_its_policy_in_code(demo, three):
    ann, ben, _ = three
    make_policy("channel-wide", [{"name": "leads", "quorum": 2, "users": three}])
    make_policy("declared-in-code", [{"name": "ann alone", "users": [ann]}], applies_to="unused")
    run = drive(submission.submit(workflow="test_named_policy", input={})[0])
    card = Approval.objects.get(run=run)
    assert card.policy["name"] == "declared-in-code"
    with pytest.raises(NotAllowed):
        card.decide(ben, "approve", version=card.version)
    assert card.decide(ann, "approve", version=card.version).status == "approved"


def test_a_gate_naming_a_policy_that_does_not_exist_fails_closed(demo, three):
    make_policy("channel-wide", [{"name": "leads", "users": three}])  # not a fallback: the gate named another
    run = drive(submission.submit(workflow="test_named_policy", input={})[0])
    card = Approval.objects.get(run=run)
    assert card.policy["stages"][0]["name"] == "policy declared-in-code does not exist"
    assert not card.asked_anyone and card.asked_users == [] and card.asked_groups == []
    with pytest.raises(NotAllowed):
        card.decide(demo["reviewer"], "approve", version=card.version)
    assert sla.apply_sla(card.pk, card.due_at + timedelta(seconds=1)) == "safe_default"
    card.refresh_from_db()
    assert card.status == "rejected"


def test_a_bulk_decision_follows_the_policy_too(client, demo, three):
    make_policy("two-of-three", [{"name": "leads", "quorum": 2, "users": three}])
    _, card = start_parked_run(client, demo["agent"])
    # A card whose row shows everything that runs, so that the policy is what decides (a refund card's email is not
    # in its row: approvals.inbox.row_shows refuses its bulk approval first).
    proposal = {"refund": {"amount_cents": card.amount_minor, "currency": card.currency}}
    Approval.objects.filter(pk=card.pk).update(proposed=proposal, current=None)
    card.refresh_from_db()
    before = snapshot(card)
    (refused,) = inbox.decide_cards(demo["reviewer"], {card.pk: card.version}, "approve", "", "")
    assert refused.status == 403 and "does not ask you" in refused.detail
    assert snapshot(card) == before
    (counted,) = inbox.decide_cards(three[0], {card.pk: card.version}, "approve", "", "")
    assert counted.status == 200
    card.refresh_from_db()
    assert card.status == "pending" and Decision.objects.get(approval=card).stage_name == "leads"
