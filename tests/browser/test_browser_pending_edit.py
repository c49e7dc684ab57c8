"""In Chromium, under the two-person rule: rita edits a refund down to 123.45 EUR, and the reviewer who gives the
second approval sees that edit (the amount, its diffs, who made it) wherever they look, cannot approve the version
from before it, cannot approve it in bulk or with the inbox's `a` key without opening it, and what is paid is the
edited amount they approved."""

from __future__ import annotations

import copy

import pytest
from django.contrib.auth.models import User
from guardian.shortcuts import assign_perm
from playwright.sync_api import expect

from approvals.models import Approval, Decision
from core.models import Channel
from demo.models import SandboxCall
from runs import submission
from runs.models import Run
from tests.conftest import log_in
from tests.engine_helpers import REFUND, drive

EDITED_CENTS = 12_345  # the agent proposes 12 500; the refund gate allows lowering it


@pytest.fixture
def rita(reviewer):
    """The first of the two people; the demo's reviewer (logged in to the browser) is the second."""
    Channel.objects.filter(name="payments").update(required_approvals=2)
    user = User.objects.create_user("rita")
    assign_perm("core.approve_channel", user, Channel.objects.get(name="payments"))
    return user


def park(amount: int = REFUND["amount_cents"]) -> Approval:
    run, _ = submission.submit(
        workflow="refund", input={**REFUND, "amount_cents": amount}, created_by=User.objects.get(username="agent")
    )
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN
    return Approval.objects.get(run=run)


def edit(card: Approval, by: User) -> Approval:
    payload = copy.deepcopy(card.proposed)
    payload["refund"]["amount_cents"] = EDITED_CENTS
    return card.decide(by, "edit", payload=payload, comment="partial refund", version=card.version)


def test_an_approval_of_the_card_as_it_was_before_the_edit_is_refused_then_the_edit_is_approved_and_paid(
    console_server, page, reviewer, rita
):
    card = park()
    log_in(page, console_server)
    page.goto(f"{console_server.url}/approvals/{card.pk}/")
    section = page.locator(f"#card-{card.pk}")
    expect(section.locator(".card-amount")).to_have_text("125.00 EUR")
    expect(section.locator(".card-pending-edit")).to_have_count(0)

    edit(card, rita)  # while the reviewer reads the proposal
    section.locator("button.card-button-approve").click()

    section = page.locator(f"#card-{card.pk}")
    expect(section.locator(".card-conflict")).to_contain_text("changed since you opened it")
    expect(section).to_have_attribute("data-version", "2")
    assert Decision.objects.filter(approval=card).count() == 1  # rita's edit alone
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.PENDING
    pending = section.locator(".card-pending-edit")
    expect(pending).to_have_attribute("data-edited-by", "rita")
    expect(pending).to_contain_text("partial refund")
    amount_vs_proposed = pending.locator('.card-edit-vs-proposed tr[data-path="refund.amount_cents"]')
    expect(amount_vs_proposed.locator(".diff-old")).to_have_text("12500")
    expect(amount_vs_proposed.locator(".diff-new")).to_have_text("12345")
    amount_vs_now = pending.locator('.card-edit-vs-current tr[data-path="refund.amount_cents"]')
    expect(amount_vs_now.locator(".diff-new")).to_have_text("12345")
    expect(section.locator(".card-amount")).to_have_text("123.45 EUR")
    expect(section.locator(".card-headline strong")).to_have_text("123.45 EUR")

    section.locator("button.card-button-approve").click()

    expect(page.locator(f"#card-{card.pk}")).to_have_attribute("data-status", "edited")
    run = drive(Run.objects.get(pk=card.run_id))
    assert run.status == Run.Status.SUCCEEDED
    assert SandboxCall.objects.get(system="payments", applied=True).payload["amount_cents"] == EDITED_CENTS


def test_the_inbox_shows_the_edit_and_neither_bulk_nor_the_a_key_approves_it_unopened(
    console_server, page, reviewer, rita
):
    edited, other = park(), park(20_000)
    edit(edited, rita)
    # `other` with a proposal its row shows whole (a refund card's email is not in its row: approvals.inbox.row_shows).
    Approval.objects.filter(pk=other.pk).update(
        proposed={"refund": {"amount_cents": other.amount_minor, "currency": other.currency}}, current=None
    )
    log_in(page, console_server)

    row = page.locator(f"#row-{edited.pk}")
    expect(row.locator("td.amount")).to_have_text("123.45 EUR")
    expect(row.locator(".badge.edited")).to_have_text("edited by rita")
    expect(row).to_have_attribute("data-version", "2")
    expect(page.locator(f"#row-{other.pk} td.amount")).to_have_text("200.00 EUR")

    row.locator("input[name=cards]").check()
    page.locator(f"#row-{other.pk} input[name=cards]").check()
    # The edit is a whole refund proposal, email included, which its row does not show: no bulk approval of it
    # (the server refuses it too, test_pending_edit.py).
    expect(page.locator("#bulk button.approve")).to_be_disabled()
    row.locator("input[name=cards]").uncheck()
    page.locator("#bulk button.approve").click()

    result = page.locator("#bulk-result")
    expect(result).to_contain_text("1 of 1 card decided")
    assert Decision.objects.filter(approval=other, actor=reviewer).count() == 1
    assert list(Decision.objects.filter(approval=edited).values_list("actor__username", flat=True)) == ["rita"]
    expect(page.locator(f"#row-{other.pk}")).to_have_count(0)  # the reviewer's part of it is done
    expect(row).to_be_visible()

    row.locator("td.workflow").click()  # select the row
    page.keyboard.press("a")
    page.wait_for_url(f"{console_server.url}/approvals/{edited.pk}/")  # opened, not approved
    expect(page.locator(f"#card-{edited.pk} .card-pending-edit")).to_be_visible()
    assert Decision.objects.filter(approval=edited).count() == 1
