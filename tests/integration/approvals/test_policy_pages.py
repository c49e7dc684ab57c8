"""The console's side of approval policies and delegation: the card page says where a card stands (stage, who
answered, who is still asked, the next escalation and when) and offers the decision only to whom the stage asks;
the inbox lists a card only to them; the Away page sets and clears a delegation, refusing bad ones."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.utils import timezone

from approvals.models import Delegation
from core.models import AuditEntry
from tests.integration.approvals.test_api_approvals import start_parked_run
from tests.integration.approvals.test_approval_policies import approver, make_policy


def shown(response) -> list[int]:
    return [int(pk) for pk in re.findall(rb'data-pk="(\d+)"', response.content)]


def text(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode()).replace("&#x27;", "'")


@pytest.fixture
def chain(demo):
    leads, finance = Group.objects.create(name="leads"), Group.objects.create(name="finance")
    lead, fin = approver("lead", leads), approver("fin", finance)
    make_policy(
        "lead-then-finance",
        [
            {"name": "team lead", "groups": [leads], "sla": timedelta(hours=1)},
            {"name": "managers", "purpose": "escalate", "users": [approver("boss")], "sla": timedelta(hours=1)},
            {"name": "finance", "groups": [finance], "sla": timedelta(hours=4)},
        ],
    )
    return lead, fin


def test_the_card_page_says_where_the_card_stands(client, demo, chain):
    lead, fin = chain
    _, card = start_parked_run(client, demo["agent"])

    client.force_login(lead)
    page = text(client.get(f"/approvals/{card.pk}/"))
    assert "Policy <strong>lead-then-finance</strong> v1: stage 1 of 3" in page
    assert '<strong data-testid="policy-stage">team lead</strong> (0 of 1 approvals)' in page
    assert "Answered: nobody yet." in page
    assert "Still asked: group leads." in page
    assert "Escalates to <strong>managers</strong> at" in page
    assert 'class="card-approve"' in page and "Not yours to decide now" not in page
    assert card.pk in shown(client.get("/"))

    client.force_login(fin)
    page = text(client.get(f"/approvals/{card.pk}/"))
    assert "Not yours to decide now" in page and 'class="card-approve"' not in page
    assert card.pk not in shown(client.get("/"))
    response = client.post(f"/approvals/{card.pk}/decide", {"decision": "approve", "version": card.version})
    assert response.status_code == 403

    client.force_login(lead)
    response = client.post(f"/approvals/{card.pk}/decide", {"decision": "approve", "version": card.version})
    assert response.status_code == 302
    page = text(client.get(f"/approvals/{card.pk}/"))
    assert "stage 3 of 3" in page and "Answered: lead (team lead)." in page
    assert "Still asked: group finance." in page and "Rejected (fail closed) at" in page
    assert card.pk not in shown(client.get("/"))
    client.force_login(fin)
    assert card.pk in shown(client.get("/"))


def test_a_cover_sees_whose_card_they_decide(client, demo):
    absent, cover = approver("absent"), approver("cover")
    make_policy("absent-alone", [{"name": "absent", "users": [absent]}])
    _, card = start_parked_run(client, demo["agent"])
    Delegation.set(absent, cover, timezone.now() + timedelta(hours=1))
    client.force_login(cover)
    assert card.pk in shown(client.get("/"))
    page = text(client.get(f"/approvals/{card.pk}/"))
    assert "You decide on behalf of absent" in page
    response = client.post(f"/approvals/{card.pk}/decide", {"decision": "approve", "version": card.version})
    assert response.status_code == 302
    assert "Answered: cover on behalf of absent (absent)." in text(client.get(f"/approvals/{card.pk}/"))


# --- the Away page -------------------------------------------------------------------------------------------


def _until(delta: timedelta) -> str:
    return timezone.localtime(timezone.now() + delta).strftime("%Y-%m-%dT%H:%M")


def test_the_away_page_sets_and_clears_a_delegation(client, demo):
    absent, cover = approver("absent"), approver("cover")
    client.force_login(absent)
    assert "You are not away" in text(client.get("/approvals/away/"))
    response = client.post("/approvals/away/", {"action": "set", "cover": "cover", "until": _until(timedelta(days=2))})
    assert response.status_code == 302
    delegation = Delegation.objects.get(user=absent)
    assert delegation.cover == cover
    assert "You are away until" in text(client.get("/approvals/away/"))
    (entry,) = AuditEntry.objects.filter(action="delegation.set")
    assert (entry.actor, entry.data["user"], entry.data["cover"]) == ("absent", "absent", "cover")

    response = client.post("/approvals/away/", {"action": "clear"})
    assert response.status_code == 302 and not Delegation.objects.exists()
    (entry,) = AuditEntry.objects.filter(action="delegation.clear")
    assert entry.actor == "absent"


@pytest.mark.parametrize(
    ("cover", "until", "error"),
    [
        ("absent", timedelta(days=1), "you cannot delegate to yourself"),
        ("dave", timedelta(days=1), "dave may not approve crm, email, payments"),
        ("cover", -timedelta(hours=1), "must be in the future"),
        ("nobody", timedelta(days=1), "Choose one of the listed users"),
        ("cover", None, "Say until when you are away"),
    ],
    ids=["self", "no-permission", "past", "unknown-user", "no-date"],
)
def test_a_bad_delegation_is_refused_and_nothing_changes(client, demo, dave, cover, until, error):
    absent = approver("absent")
    approver("cover")
    client.force_login(absent)
    audited = AuditEntry.objects.count()
    form = {"action": "set", "cover": cover, "until": _until(until) if until is not None else ""}
    response = client.post("/approvals/away/", form)
    assert response.status_code == 422
    assert error in text(response)
    assert not Delegation.objects.exists() and AuditEntry.objects.count() == audited
