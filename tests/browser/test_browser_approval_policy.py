"""In Chromium: an ordered chain of two stages decided on the card page (the team lead, then finance); two of
three, escalated to its next level and decided there; and a delegation set on the Away page (a bad one refused
first), used by the cover on behalf of the absent person, then ended."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from playwright.sync_api import expect

from approvals import sla
from approvals.models import Approval, Decision, Delegation
from core.models import AuditEntry
from runs.models import Run
from tests.browser.test_browser_card import park
from tests.conftest import log_in, set_production_password
from tests.engine_helpers import REFUND
from tests.integration.approvals.test_approval_policies import approver, make_policy


def person(username: str, *groups: Group) -> User:
    user = approver(username, *groups)
    set_production_password(user)
    return user


@pytest.fixture
def as_user(browser, console_server):
    """A logged-in page per user (each its own browser context)."""
    contexts = []

    def open_as(username: str):
        context = browser.new_context()
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(10_000)
        log_in(page, console_server, username)
        return page

    yield open_as
    for context in contexts:
        context.close()


def test_an_ordered_chain_is_decided_stage_by_stage_on_the_card_page(console_server, reviewer, as_user):
    leads, finance = Group.objects.create(name="leads"), Group.objects.create(name="finance")
    person("lead", leads), person("fin", finance)
    make_policy(
        "lead-then-finance",
        [
            {"name": "team lead", "groups": [leads], "sla": timedelta(hours=1)},
            {"name": "finance", "groups": [finance], "sla": timedelta(hours=4)},
        ],
    )
    card = park()

    fin = as_user("fin")
    fin.goto(f"{console_server.url}/approvals/{card.pk}/")
    expect(fin.get_by_test_id("policy-stage")).to_have_text("team lead")
    expect(fin.get_by_test_id("policy-refusal")).to_be_visible()
    expect(fin.locator("button.card-button-approve")).to_have_count(0)

    lead = as_user("lead")
    lead.goto(f"{console_server.url}/approvals/{card.pk}/")
    section = lead.locator(f"#card-{card.pk}")
    expect(lead.get_by_test_id("policy-asked")).to_have_text("Still asked: group leads.")
    expect(lead.get_by_test_id("policy-next")).to_contain_text("Rejected (fail closed) at")
    section.locator("button.card-button-approve").click()
    expect(lead.get_by_test_id("policy-stage")).to_have_text("finance")  # the card, swapped in place
    expect(lead.get_by_test_id("policy-answered")).to_have_text("Answered: lead (team lead).")
    expect(lead.get_by_test_id("policy-refusal")).to_be_visible()
    expect(section).to_have_attribute("data-status", "pending")

    fin.reload()
    expect(fin.get_by_test_id("policy-asked")).to_have_text("Still asked: group finance.")
    fin.locator(f"#card-{card.pk} button.card-button-approve").click()
    expect(fin.locator(f"#card-{card.pk}")).to_have_attribute("data-status", "approved")

    card.refresh_from_db()
    assert card.status == Approval.Status.APPROVED
    assert Run.objects.get(pk=card.run_id).status == Run.Status.QUEUED
    audited = AuditEntry.objects.filter(approval_id=card.pk, action="approval.approve").order_by("id")
    assert [(e.actor, e.data["policy_stage"]["stage"]) for e in audited] == [("lead", "team lead"), ("fin", "finance")]


def test_a_delegation_set_on_the_away_page_lets_the_cover_decide(console_server, reviewer, as_user):
    absent = person("absent")
    person("cover")
    make_policy("absent-alone", [{"name": "absent", "users": [absent]}])
    card = park()

    page = as_user("absent")
    page.goto(f"{console_server.url}/approvals/away/")
    until = timezone.localtime(timezone.now() + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    page.fill("#id_until", until)
    page.select_option("#id_cover", "absent")  # to themselves: refused
    page.click("form.away-form button[type=submit]")
    expect(page.get_by_test_id("away-error")).to_contain_text("you cannot delegate to yourself")
    assert not Delegation.objects.exists()
    page.fill("#id_until", until)
    page.select_option("#id_cover", "cover")
    page.click("form.away-form button[type=submit]")
    expect(page.get_by_test_id("away-current")).to_contain_text("cover: cover")
    assert Delegation.objects.get(user=absent).cover.username == "cover"
    assert AuditEntry.objects.filter(action="delegation.set", actor="absent").count() == 1

    cover = as_user("cover")
    expect(cover.locator(f'[data-pk="{card.pk}"]').first).to_be_visible()  # in the cover's inbox
    cover.goto(f"{console_server.url}/approvals/{card.pk}/")
    expect(cover.get_by_test_id("policy-cover")).to_contain_text("on behalf of absent")
    cover.locator(f"#card-{card.pk} button.card-button-approve").click()
    expect(cover.locator(f"#card-{card.pk}")).to_have_attribute("data-status", "approved")
    decision = Decision.objects.get(approval=card)
    assert (decision.actor.username, decision.on_behalf_of.username) == ("cover", "absent")
    entry = AuditEntry.objects.get(approval_id=card.pk, action="approval.approve")
    assert entry.actor == "cover" and entry.data["on_behalf_of"] == "absent"

    # Back early: out of the window, the cover no longer may.
    page.click("form:has(input[value=clear]) button")
    expect(page.get_by_test_id("away-current")).to_contain_text("You are not away")
    assert AuditEntry.objects.filter(action="delegation.clear", actor="absent").count() == 1
    later = park({**REFUND, "customer_id": "cus_2002"})
    cover.goto(f"{console_server.url}/approvals/{later.pk}/")
    expect(cover.get_by_test_id("policy-refusal")).to_be_visible()
    expect(cover.locator("button.card-button-approve")).to_have_count(0)


def test_two_of_three_escalated_then_decided_on_the_card_page(console_server, reviewer, as_user):
    managers = Group.objects.create(name="managers")
    three = [person(name) for name in ("ann", "ben", "cid")]
    person("manager", managers)
    make_policy(
        "two-of-three",
        [
            {"name": "leads", "quorum": 2, "users": three, "sla": timedelta(minutes=30)},
            {"name": "managers", "purpose": "escalate", "quorum": 2, "groups": [managers], "users": three[1:]},
        ],
    )
    card = park()

    ann = as_user("ann")
    ann.goto(f"{console_server.url}/approvals/{card.pk}/")
    expect(ann.get_by_test_id("card-policy")).to_contain_text("(0 of 2 approvals)")
    expect(ann.get_by_test_id("policy-next")).to_contain_text("Escalates to managers at")
    ann.locator(f"#card-{card.pk} button.card-button-approve").click()
    expect(ann.get_by_test_id("card-policy")).to_contain_text("(1 of 2 approvals)")
    expect(ann.get_by_test_id("policy-answered")).to_have_text("Answered: ann (leads).")
    expect(ann.get_by_test_id("policy-asked")).to_have_text("Still asked: ben, cid.")
    expect(ann.locator("button.card-button-approve")).to_have_count(0)  # she counted already

    card.refresh_from_db()
    assert sla.apply_sla(card.pk, card.due_at + timedelta(seconds=1)) == "escalate"
    manager = as_user("manager")
    manager.goto(f"{console_server.url}/approvals/{card.pk}/")
    expect(manager.get_by_test_id("policy-stage")).to_have_text("managers")
    expect(manager.get_by_test_id("policy-next")).to_contain_text("Rejected (fail closed) at")
    expect(manager.locator(f"#card-{card.pk}")).to_have_attribute("data-status", "escalated")
    manager.locator(f"#card-{card.pk} button.card-button-approve").click()
    expect(manager.locator(f"#card-{card.pk}")).to_have_attribute("data-status", "approved")
    stages = [
        (e.actor, e.data["policy_stage"]["stage"])
        for e in AuditEntry.objects.filter(
            approval_id=card.pk, action__in=["approval.approve", "policy.escalate"]
        ).order_by("id")
    ]
    assert stages == [("ann", "leads"), ("system", "managers"), ("manager", "managers")]
