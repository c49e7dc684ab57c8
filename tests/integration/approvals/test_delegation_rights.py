"""Issue 24, defect 7: a delegation is bound to its delegator's live right. A cover decides on an absent person's
behalf only while that person is active and still holds `approve_channel` on the card's channel (checked when
the cover decides, and by the inbox and the API's list of cards to decide); and nobody is away for more than 90
days (approvals.models.Delegation.refusal: the model and the Away page refuse it)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from approvals.models import Decision, Delegation, DelegationRefused
from core.models import AuditEntry, Channel
from tests.integration.approvals.test_api_approvals import decide, snapshot, start_parked_run
from tests.integration.approvals.test_approval_policies import approver, listed, make_policy
from tests.integration.approvals.test_policy_pages import _until, shown, text


@pytest.fixture
def away(demo):
    """`absent` is the only person the payments policy names; `cover` covers for them for two hours."""
    absent, cover = approver("absent"), approver("cover")
    make_policy("absent-alone", [{"name": "absent", "users": [absent]}])
    Delegation.set(absent, cover, timezone.now() + timedelta(hours=2))
    return absent, cover


def _withdrawn(absent, how: str) -> None:
    if how == "deactivated":
        absent.is_active = False
        absent.save(update_fields=["is_active"])
    else:  # their approve_channel on payments, the card's channel, was removed (they keep it elsewhere)
        remove_perm("core.approve_channel", absent, Channel.objects.get(name="payments"))


@pytest.mark.parametrize("how", ["deactivated", "approve_channel removed"])
def test_a_cover_may_not_decide_for_someone_who_lost_the_right(client, demo, away, how):
    absent, cover = away
    _, card = start_parked_run(client, demo["agent"])
    assert card.pk in listed(client, cover)  # while the absent person holds the right, the cover decides
    _withdrawn(absent, how)

    before = snapshot(card)
    response = decide(client, cover, card, decision="approve")
    assert response.status_code == 403, response.content
    assert snapshot(card) == before
    assert not AuditEntry.objects.filter(approval_id=card.pk, action__startswith="approval.").exists()
    assert not Decision.objects.filter(approval=card).exists()
    # Nor is it listed to them: the API's list and the inbox's page.
    assert card.pk not in listed(client, cover)
    client.force_login(cover)
    assert card.pk not in shown(client.get("/"))
    page = text(client.get(f"/approvals/{card.pk}/"))
    assert "Not yours to decide now" in page and 'class="card-approve"' not in page


def test_the_right_is_read_when_the_cover_decides_and_comes_back_with_it(client, demo, away):
    absent, cover = away
    _, card = start_parked_run(client, demo["agent"])
    payments = Channel.objects.get(name="payments")
    remove_perm("core.approve_channel", absent, payments)
    assert decide(client, cover, card, decision="approve").status_code == 403
    # Given back (the delegation itself never changed): the cover decides on their behalf again.
    assign_perm("core.approve_channel", absent, payments)
    assert card.pk in listed(client, cover)
    response = decide(client, cover, card, decision="approve")
    assert response.status_code == 200, response.content
    assert Decision.objects.get(approval=card).on_behalf_of == absent


def test_a_delegators_right_through_a_group_counts(client, demo, away):
    """approve_channel held through a group (guardian's group object permission) is a right like any other."""
    absent, cover = away
    payments = Channel.objects.get(name="payments")
    remove_perm("core.approve_channel", absent, payments)
    approvers = Group.objects.create(name="payments-approvers")
    assign_perm("core.approve_channel", approvers, payments)
    absent.groups.add(approvers)
    _, card = start_parked_run(client, demo["agent"])
    assert card.pk in listed(client, cover)
    assert decide(client, cover, card, decision="approve").status_code == 200


# --- at most 90 days ------------------------------------------------------------------------------------------


def test_a_delegation_is_at_most_90_days(demo):
    absent, cover = approver("absent"), approver("cover")
    audited = AuditEntry.objects.count()
    with pytest.raises(DelegationRefused, match="at most 90 days"):
        Delegation.set(absent, cover, timezone.now() + timedelta(days=90, minutes=1))
    assert not Delegation.objects.exists() and AuditEntry.objects.count() == audited
    Delegation.set(absent, cover, timezone.now() + timedelta(days=89, hours=23))
    assert Delegation.objects.get(user=absent).cover == cover


def test_the_away_page_refuses_more_than_90_days(client, demo):
    absent = approver("absent")
    approver("cover")
    client.force_login(absent)
    audited = AuditEntry.objects.count()
    response = client.post("/approvals/away/", {"action": "set", "cover": "cover", "until": _until(timedelta(days=91))})
    assert response.status_code == 422
    assert "at most 90 days" in text(response)
    assert not Delegation.objects.exists() and AuditEntry.objects.count() == audited
