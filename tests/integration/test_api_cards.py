"""Issue 24's smaller items of the approvals API: the list's `pending` (cards waiting for a decision, escalated ones
included), `GET /api/approvals/{id}`, the card's `action`, the decision's reason taxonomy and the 422's field names."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth.models import Group

from approvals import policy
from approvals.models import Approval
from core.models import Channel
from tests.engine_helpers import REFUND
from tests.integration.test_api_approvals import bearer, start_parked_run


def escalate(card: Approval) -> Approval:
    """The card's SLA runs out on a channel whose policy escalates (approvals.policy, as the timer applies it)."""
    group, _ = Group.objects.get_or_create(name="payments-leads")
    Channel.objects.filter(pk=card.channel_id).update(escalation_policy="escalate", escalation_group=group)
    assert policy.apply_sla(card.pk, card.due_at + timedelta(seconds=1)) == "escalate"
    card.refresh_from_db()
    assert card.status == Approval.Status.ESCALATED
    return card


# GET /api/approvals?status=pending: every card waiting for a decision


def test_pending_lists_escalated_cards_too_each_with_its_own_status(client, demo):
    _, waiting = start_parked_run(client, demo["agent"])
    _, overdue = start_parked_run(client, demo["agent"], {**REFUND, "customer_id": "cus_2001"})
    escalate(overdue)
    reviewer = bearer(demo["reviewer"])

    listed = client.get("/api/approvals?status=pending", headers=reviewer).json()
    default = client.get("/api/approvals", headers=reviewer).json()

    assert {(c["id"], c["status"]) for c in listed} == {(waiting.pk, "pending"), (overdue.pk, "escalated")}
    assert default == listed
    only_escalated = client.get("/api/approvals?status=escalated", headers=reviewer).json()
    assert [c["id"] for c in only_escalated] == [overdue.pk]
