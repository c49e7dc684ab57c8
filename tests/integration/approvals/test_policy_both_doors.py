"""One door for cards (approvals.cards): a workflow's gate and an external agent's request on the same channel, under
the same approval policy, behave the same. Each scenario of the policy suite (a quorum of named people, an ordered
chain, a stage naming only one person, escalation to the fail-closed end, delegation, a decision past the deadline)
runs over both kinds of card, driven through the API as reviewers and agents use it.

Before the one door, an external request's card carried no policy: one approval by any reviewer of the channel
made it `approved`, whatever the policy said (issue 24, defect 1)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.utils import timezone

from approvals import rules, sla
from approvals.models import Approval, Decision, Delegation
from core.models import AuditEntry, Channel
from runs.models import Run
from tests.integration.approvals.test_api_approvals import bearer, decide, start_parked_run
from tests.integration.approvals.test_approval_policies import approver, make_policy

ARGUMENTS = {"order_id": "ord_9", "amount_cents": 4_200}


@dataclass
class Card:
    """A card of either kind, and how its outcome reads: the gate's run, or the external request's state."""

    kind: str
    card: Approval
    request_id: str | None = None

    def refresh(self) -> Approval:
        self.card.refresh_from_db()
        return self.card

    def outcome(self, client, agent) -> str:
        """approved, pending, or closed (nothing runs): the engine's or the agent's view of it."""
        if self.kind == "gate":
            card, run = self.refresh(), Run.objects.get(pk=self.card.run_id)
            if card.status in Approval.OPEN:
                assert run.status == Run.Status.WAITING_HUMAN
                return "pending"
            assert run.status == Run.Status.QUEUED  # resumed: the step reads the decision
            return "approved" if card.status in (Approval.Status.APPROVED, Approval.Status.EDITED) else "closed"
        response = client.get(f"/api/approval-requests/{self.request_id}", headers=bearer(agent))
        status = response.json()["status"]
        return {"pending": "pending", "approved": "approved"}.get(status, "closed")


def open_card(kind: str, client, demo) -> Card:
    if kind == "gate":
        _, card = start_parked_run(client, demo["agent"])
        return Card(kind, card)
    response = client.post(
        "/api/approval-requests",
        json.dumps({"channel": "payments", "action": "refund", "arguments": ARGUMENTS, "idempotency_key": "k1"}),
        content_type="application/json",
        headers=bearer(demo["agent"]),
    )
    assert response.status_code == 202, response.content
    body = response.json()
    return Card(kind, Approval.objects.get(pk=body["card_id"]), body["id"])


KINDS = pytest.mark.parametrize("kind", ["gate", "external"])


def yes(client, user, card: Card):
    return decide(client, user, card.refresh(), decision="approve", comment="ok")


@pytest.fixture
def three(demo):
    return [approver(name) for name in ("ann", "ben", "cid")]


@KINDS
def test_a_quorum_of_named_people(kind, client, demo, three):
    ann, ben, _ = three
    make_policy("two-of-three", [{"name": "leads", "quorum": 2, "users": three}])
    card = open_card(kind, client, demo)
    assert card.card.policy["name"] == "two-of-three"
    assert yes(client, demo["reviewer"], card).status_code == 403  # the policy does not name them
    assert yes(client, ann, card).status_code == 200
    assert card.outcome(client, demo["agent"]) == "pending"
    assert yes(client, ann, card).status_code == 409  # one person counts once
    assert yes(client, ben, card).status_code == 200
    assert card.outcome(client, demo["agent"]) == "approved"


@KINDS
def test_an_ordered_chain(kind, client, demo, three):
    ann, ben, _ = three
    make_policy("chain", [{"name": "lead", "users": [ann]}, {"name": "finance", "users": [ben]}])
    card = open_card(kind, client, demo)
    assert yes(client, ben, card).status_code == 403  # not their stage yet
    assert yes(client, ann, card).status_code == 200
    assert card.refresh().stage == 1 and card.outcome(client, demo["agent"]) == "pending"
    assert yes(client, ben, card).status_code == 200
    assert card.outcome(client, demo["agent"]) == "approved"


@KINDS
def test_a_policy_naming_only_admin(kind, client, demo):
    make_policy("admin-only", [{"name": "admin", "users": [demo["admin"]]}])
    card = open_card(kind, client, demo)
    assert yes(client, demo["reviewer"], card).status_code == 403
    assert card.outcome(client, demo["agent"]) == "pending"
    assert yes(client, demo["admin"], card).status_code == 200
    assert card.outcome(client, demo["agent"]) == "approved"


@KINDS
def test_escalation_to_the_fail_closed_end(kind, client, demo, three):
    ann, ben, cid = three
    seniors = Group.objects.create(name="seniors")
    ben.groups.add(seniors)
    make_policy(
        "escalating",
        [
            {"name": "lead", "users": [ann], "sla": timedelta(minutes=5)},
            {"name": "seniors", "purpose": "escalate", "groups": [seniors], "sla": timedelta(minutes=5)},
        ],
    )
    card = open_card(kind, client, demo)
    first_due = card.refresh().due_at
    assert sla.apply_sla(card.card.pk, first_due + timedelta(seconds=1)) == "escalate"
    assert card.refresh().status == Approval.Status.ESCALATED
    assert card.refresh().stage == 1
    assert yes(client, cid, card).status_code == 403  # asked: the lead and now the seniors, not cid
    assert card.outcome(client, demo["agent"]) == "pending"
    assert sla.apply_sla(card.card.pk, card.refresh().due_at + timedelta(seconds=1)) in ("safe_default", "expire")
    assert card.outcome(client, demo["agent"]) == "closed"
    assert yes(client, ben, card).status_code == 409


@KINDS
def test_delegation(kind, client, demo, three):
    ann, _, cid = three
    make_policy("ann-only", [{"name": "ann", "users": [ann]}])
    Delegation.set(ann, cid, timezone.now() + timedelta(days=1))
    card = open_card(kind, client, demo)
    assert yes(client, cid, card).status_code == 200
    assert card.outcome(client, demo["agent"]) == "approved"
    (decision,) = Decision.objects.filter(approval=card.card)
    assert (decision.actor, decision.on_behalf_of) == (cid, ann)


@KINDS
def test_a_decision_after_the_deadline_is_refused_and_the_expiry_applies_at_once(kind, client, demo, three):
    """No timer job ran (none runs in this test): the person's decision itself finds the deadline passed."""
    ann, ben, _ = three
    make_policy("lead", [{"name": "lead", "users": [ann, ben]}], at_end="reject")
    card = open_card(kind, client, demo)
    Approval.objects.filter(pk=card.card.pk).update(due_at=timezone.now() - timedelta(seconds=5))
    response = yes(client, ann, card)
    assert response.status_code == 409 and response.json()["error"] == "expired", response.content
    assert card.refresh().status not in Approval.OPEN
    assert not Decision.objects.filter(approval=card.card, actor__isnull=False).exists()
    assert card.outcome(client, demo["agent"]) == "closed"
    assert yes(client, ben, card).status_code == 409


def channel_rule_of(channel: Channel) -> dict:
    """What a card on `channel` carries when the channel has no approval policy: its own rule as one stage."""
    stage = {"name": f"approvers of {channel.name}", "purpose": "approve", "quorum": channel.required_approvals}
    stage |= {"sla": int(channel.sla.total_seconds()), "anyone": True, "users": [], "groups": []}
    return {
        "id": None,
        "name": f"{channel.name} channel rule",
        "version": 0,
        "channel_rule": True,
        "escalation_policy": channel.escalation_policy,
        "at_end": "reject" if channel.escalation_policy == "safe_default" else "wait",
        "stages": [stage],
    }


@KINDS
def test_the_channels_own_rule_without_a_policy(kind, client, demo):
    """No policy: the card carries the channel's rule (one approval on the demo's channels) as a one-stage policy,
    for both kinds; the API names no admin policy for it."""
    card = open_card(kind, client, demo)
    assert card.card.policy == channel_rule_of(Channel.objects.get(name="payments"))
    assert card.card.asked_anyone and card.card.asked_users == [] and card.card.asked_groups == []
    body = client.get(f"/api/approvals/{card.card.pk}", headers=bearer(demo["reviewer"])).json()
    assert body["policy_stage"] is None and body["asked"] is None
    client.force_login(demo["reviewer"])
    page = client.get(f"/approvals/{card.card.pk}/").content.decode()
    assert 'data-testid="card-policy"' not in page  # no admin's policy named it
    client.logout()
    assert yes(client, demo["reviewer"], card).status_code == 200
    assert card.outcome(client, demo["agent"]) == "approved"
    decision = Decision.objects.get(approval=card.card)
    assert decision.stage is None and decision.stage_name == ""  # no admin policy's stage: as before


@KINDS
@pytest.mark.parametrize("stored", ["snapshot", "none"])
def test_the_two_person_rule_is_the_one_count_of_the_channels_one_stage_policy(kind, stored, client, demo, three):
    """The two-person rule of a channel without a policy: its cards carry it as one stage of quorum 2 and
    Approval.decide counts it with the one count (PolicyCount), keeping the rule's messages, 409s, versions and
    audit fields; a card opened before cards carried it (`policy` null, as left in a database) counts the same."""
    Channel.objects.filter(name="payments").update(required_approvals=2)
    ann, ben, _ = three
    card = open_card(kind, client, demo)
    assert card.card.policy == channel_rule_of(Channel.objects.get(name="payments"))
    assert card.card.policy["stages"][0]["quorum"] == 2
    if stored == "none":
        Approval.objects.filter(pk=card.card.pk).update(policy=None)
    count = rules.PolicyCount.of(card.refresh(), ann, "approve", [])
    assert count.channel_rule and count.applies and (count.given, count.required, count.complete) == (1, 2, False)

    assert yes(client, ann, card).status_code == 200
    assert card.outcome(client, demo["agent"]) == "pending"
    assert card.refresh().version == 2  # every decision under the two-person rule changes the version, as before
    first = AuditEntry.objects.get(approval_id=card.card.pk, action="approval.approve")
    assert first.data["approvals"] == 1 and first.data["required"] == 2 and "policy_stage" not in first.data

    again = yes(client, ann, card)
    assert again.status_code == 409, again.content
    assert "the two-person rule needs a different person" in again.json()["detail"]

    assert yes(client, ben, card).status_code == 200
    assert card.outcome(client, demo["agent"]) == "approved"
    assert card.refresh().version == 3
    second = AuditEntry.objects.filter(approval_id=card.card.pk, action="approval.approve").order_by("pk").last()
    assert second.data["approvals"] == 2 and second.data["required"] == 2


@KINDS
def test_a_rejection_under_the_channels_rule_ends_the_card_with_no_count(kind, client, demo, three):
    """Under the two-person rule one rejection ends a card (nothing runs), and its audit entry carries no count."""
    Channel.objects.filter(name="payments").update(required_approvals=2)
    card = open_card(kind, client, demo)
    response = decide(client, three[0], card.refresh(), decision="reject", comment="no", reason="policy")
    assert response.status_code == 200, response.content
    assert card.outcome(client, demo["agent"]) == "closed"
    entry = AuditEntry.objects.get(approval_id=card.card.pk, action="approval.reject")
    assert "approvals" not in entry.data and "required" not in entry.data


@KINDS
def test_the_channels_rule_keeps_the_channels_deadline(kind, client, demo):
    """The deadline of a card under its channel's rule is the channel's SLA policy: escalate to its escalation group
    (an `sla.escalate` entry), as before cards carried the rule; an external request (on_expiry: reject) expires."""
    group = Group.objects.create(name="payments-leads")
    Channel.objects.filter(name="payments").update(escalation_policy="escalate", escalation_group=group)
    card = open_card(kind, client, demo)
    done = sla.apply_sla(card.card.pk, card.refresh().due_at + timedelta(seconds=1))
    if kind == "gate":
        assert done == "escalate"
        assert card.refresh().status == Approval.Status.ESCALATED and card.card.assigned_group == group
        assert AuditEntry.objects.filter(approval_id=card.card.pk, action="sla.escalate").exists()
    else:
        assert done == "expire" and card.refresh().status == Approval.Status.EXPIRED


def test_a_tool_policy_applies_to_the_external_action_of_that_name(client, demo, three):
    ann, _, _ = three
    make_policy("refund-tool", [{"name": "ann", "users": [ann]}], applies_to="tool:refund")
    card = open_card("external", client, demo)
    assert card.card.policy["name"] == "refund-tool"
    assert yes(client, demo["reviewer"], card).status_code == 403
    assert yes(client, ann, card).status_code == 200


@KINDS
def test_lowering_the_channels_rule_does_not_loosen_an_open_card(kind, client, demo, three):
    """A card opened under the two-person rule keeps it when the channel is lowered to one approval (it carries
    its rule); raising a channel's rule applies to its open cards (test_card_view, test_slack), as it always did."""
    Channel.objects.filter(name="payments").update(required_approvals=2)
    card = open_card(kind, client, demo)
    Channel.objects.filter(name="payments").update(required_approvals=1)
    assert yes(client, three[0], card).status_code == 200
    assert card.outcome(client, demo["agent"]) == "pending"
    assert yes(client, three[1], card).status_code == 200
    assert card.outcome(client, demo["agent"]) == "approved"
