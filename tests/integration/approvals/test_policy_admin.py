"""Approval policies in Django admin: a valid policy is saved and audited (before and after), each change raises its
version, deleting one is audited; an invalid one (quorum 0, a quorum above the people named, a stage naming
nobody, no stage, an escalation level first) is refused with a clear error and nothing is saved or audited."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command

from approvals.models import ApprovalPolicy, PolicyStage
from core.models import AuditEntry

ADD = "/admin/approvals/approvalpolicy/add/"


def _stage(i: int, **fields) -> dict:
    values = {"position": i, "name": f"stage {i + 1}", "purpose": "approve", "quorum": 1, "sla": ""}
    values.update(fields)
    form = {}
    for key, value in values.items():
        if key in ("users", "groups"):
            form[f"stages-{i}-{key}"] = [str(v) for v in value]
        elif key == "channel_approvers":
            if value:
                form[f"stages-{i}-{key}"] = "on"
        else:
            form[f"stages-{i}-{key}"] = value
    return form


def _form(payments, *stages: dict, **policy) -> dict:
    form = {
        "name": "payments-policy",
        "description": "",
        "channel": payments.pk,
        "applies_to": "",
        "at_end": "reject",
        "stages-TOTAL_FORMS": str(len(stages)),
        "stages-INITIAL_FORMS": "0",
        "stages-MIN_NUM_FORMS": "0",
        "stages-MAX_NUM_FORMS": "1000",
        **policy,
    }
    for stage in stages:
        form.update(stage)
    return form


@pytest.fixture
def people(db):
    return [User.objects.create_user(name) for name in ("ann", "ben", "cid")]


def test_a_valid_policy_is_saved_and_audited(admin_client, payments, people):
    ann, ben, cid = people
    response = admin_client.post(
        ADD,
        _form(
            payments,
            _stage(0, quorum=2, users=[ann.pk, ben.pk, cid.pk]),
            _stage(1, name="ops", purpose="escalate", channel_approvers=True, sla="02:00:00"),
        ),
    )
    assert response.status_code == 302, response.content.decode()[:3000]
    policy = ApprovalPolicy.objects.get()
    assert [(s.name, s.quorum) for s in policy.stages.all()] == [("stage 1", 2), ("ops", 1)]
    entry = AuditEntry.objects.get(action="policy.create")
    assert (entry.actor, entry.target, entry.channel) == ("alice", "policy:payments-policy", "payments")
    assert entry.data["before"] is None
    assert entry.data["after"]["stages"][0]["users"] == ["ann", "ben", "cid"]
    assert entry.data["after"]["stages"][1]["channel_approvers"] is True

    stage = policy.stages.get(name="stage 1")
    change = _form(payments, _stage(0, quorum=1, users=[ann.pk]), at_end="wait")
    change.update({"stages-0-id": str(stage.pk), "stages-0-policy": str(policy.pk)})
    ops = policy.stages.get(name="ops")
    change.update(_stage(1, name="ops", purpose="escalate", channel_approvers=True))
    change.update({"stages-1-id": str(ops.pk), "stages-1-policy": str(policy.pk)})
    change.update({"stages-TOTAL_FORMS": "2", "stages-INITIAL_FORMS": "2"})
    response = admin_client.post(f"/admin/approvals/approvalpolicy/{policy.pk}/change/", change)
    assert response.status_code == 302, response.content.decode()[:3000]
    policy.refresh_from_db()
    assert policy.version == 2 and policy.at_end == "wait"
    entry = AuditEntry.objects.get(action="policy.change")
    assert entry.data["before"]["at_end"] == "reject" and entry.data["after"]["at_end"] == "wait"
    assert entry.data["before"]["stages"][0]["users"] == ["ann", "ben", "cid"]
    assert entry.data["after"]["stages"][0]["users"] == ["ann"]
    assert entry.data["after"]["version"] == 2

    response = admin_client.post(f"/admin/approvals/approvalpolicy/{policy.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302 and not ApprovalPolicy.objects.exists()
    entry = AuditEntry.objects.get(action="policy.delete")
    assert entry.data["before"]["name"] == "payments-policy" and entry.data["after"] is None
    call_command("audit_verify", verbosity=0)


@pytest.mark.parametrize(
    ("stages", "error"),
    [
        (lambda p: [_stage(0, quorum=0, users=[p[0].pk])], "the quorum must be at least 1"),
        (lambda p: [_stage(0, quorum=3, users=[p[0].pk, p[1].pk])], "the quorum (3) is more than the 2 people"),
        (lambda p: [_stage(0, quorum=1)], "the stage names nobody"),
        (lambda p: [], "A policy needs at least one stage"),
        (
            lambda p: [_stage(0, purpose="escalate", users=[p[0].pk])],
            "The first stage must be one that approves",
        ),
    ],
    ids=["quorum-0", "quorum-above-people", "empty-stage", "no-stage", "escalation-first"],
)
def test_an_invalid_policy_is_refused_and_nothing_changes(admin_client, payments, people, stages, error):
    response = admin_client.post(ADD, _form(payments, *stages(people)))
    assert response.status_code == 200  # the form again, with its errors
    assert error in response.content.decode().replace("&#x27;", "'")
    assert not ApprovalPolicy.objects.exists() and not PolicyStage.objects.exists()
    assert not AuditEntry.objects.exists()


def test_a_group_counts_its_members_for_the_quorum(admin_client, payments, people):
    leads = Group.objects.create(name="leads")
    leads.user_set.add(people[0], people[1])
    response = admin_client.post(ADD, _form(payments, _stage(0, quorum=3, groups=[leads.pk], users=[people[1].pk])))
    assert "the quorum (3) is more than the 2 people" in response.content.decode().replace("&#x27;", "'")
    response = admin_client.post(ADD, _form(payments, _stage(0, quorum=2, groups=[leads.pk])))
    assert response.status_code == 302
