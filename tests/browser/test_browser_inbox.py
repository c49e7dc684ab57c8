"""In Chromium: a reviewer works the inbox at / with the keyboard and bulk decisions, and it updates live."""

from __future__ import annotations

from django.contrib.auth.models import User
from playwright.sync_api import expect

from approvals.models import Approval, Decision
from core.models import AuditEntry
from runs import submission
from runs.models import Run
from tests.conftest import log_in
from tests.engine_helpers import REFUND, drive


def park(amount: int = 12_500) -> Approval:
    run, _ = submission.submit(
        workflow="refund",
        input={**REFUND, "amount_cents": amount},
        created_by=User.objects.get(username="agent"),
    )
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN
    return Approval.objects.get(run=run)


def shown_in_full(card: Approval) -> Approval:
    """The card with a proposal its row shows whole (its amount and currency), so that the row may approve it: a
    refund card's email is not in its row (approvals.inbox.row_shows)."""
    proposal = {"refund": {"amount_cents": card.amount_minor, "currency": card.currency}}
    Approval.objects.filter(pk=card.pk).update(proposed=proposal, current=None)
    return Approval.objects.get(pk=card.pk)


def test_a_reviewer_approves_with_the_keyboard_and_the_row_leaves(console_server, page, reviewer):
    cards = [shown_in_full(park(12_500 + i)) for i in range(3)]
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    log_in(page, console_server)

    rows = page.locator("#inbox-rows tr.card-row")
    expect(rows).to_have_count(3)
    expect(page.locator(f"#row-{cards[0].pk} td.amount")).to_have_text("125.00 EUR")
    expect(page.locator(f"#row-{cards[0].pk} .sla-left")).to_contain_text("left")

    page.keyboard.press("?")
    expect(page.locator("#inbox-help")).to_be_visible()
    page.keyboard.press("Escape")
    expect(page.locator("#inbox-help")).to_be_hidden()

    page.keyboard.press("j")
    page.keyboard.press("j")
    second = page.locator(f"#row-{cards[1].pk}")
    expect(second).to_have_class("card-row sla-on_time selected")
    page.keyboard.press("k")
    first = page.locator(f"#row-{cards[0].pk}")
    expect(first).to_have_class("card-row sla-on_time selected")
    page.keyboard.press("j")
    page.keyboard.press("a")

    expect(second).to_have_count(0)  # gone without a reload
    expect(rows).to_have_count(2)
    expect(page.locator(".inbox-facets [data-count=matching]")).to_have_text("2")
    expect(page.locator(f"#row-{cards[2].pk}")).to_have_class("card-row sla-on_time selected")  # the next one
    card = Approval.objects.get(pk=cards[1].pk)
    assert card.status == Approval.Status.APPROVED
    assert Decision.objects.get(approval=card).actor == reviewer
    assert Approval.objects.get(pk=cards[0].pk).status == Approval.Status.PENDING
    assert dialogs == []


def test_cards_arriving_or_decided_elsewhere_show_without_a_reload(console_server, page, reviewer):
    decided_elsewhere = park()
    log_in(page, console_server)
    expect(page.locator("#inbox-rows tr.card-row")).to_have_count(1)

    arrived = park(20_000)
    decided_elsewhere.decide(User.objects.get(username="admin"), "approve")

    expect(page.locator(f"#row-{arrived.pk}")).to_be_visible(timeout=12_000)  # the 5 s poll
    expect(page.locator(f"#row-{decided_elsewhere.pk}")).to_have_count(0)
    expect(page.locator(".inbox-facets [data-count=matching]")).to_have_text("1", timeout=12_000)


def test_e_and_r_open_the_card_page(console_server, page, reviewer):
    card = park()
    log_in(page, console_server)
    page.keyboard.press("j")
    page.keyboard.press("r")
    page.wait_for_url(f"{console_server.url}/approvals/{card.pk}/#reject")
    page.go_back()
    page.keyboard.press("j")
    page.keyboard.press("e")
    page.wait_for_url(f"{console_server.url}/approvals/{card.pk}/")


def test_a_bulk_rejection_needs_a_comment_then_decides_each_card(console_server, page, reviewer):
    cards = [park(13_000 + i) for i in range(3)]
    log_in(page, console_server)
    for card in cards[:2]:
        page.locator(f"#row-{card.pk} input[name=cards]").check()
    expect(page.locator("[data-bulk-count]")).to_have_text("2 selected on payments")

    page.locator("#bulk button.reject").click()
    expect(page.locator('#bulk-result [data-field="comment"]')).to_be_visible()
    assert not Decision.objects.exists()

    page.fill("#bulk input[name=comment]", "duplicates of an earlier refund")
    page.select_option("#bulk select[name=reason]", "duplicate")
    page.locator("#bulk button.reject").click()
    expect(page.locator("#bulk-result")).to_contain_text("2 of 2 cards decided")
    expect(page.locator("#inbox-rows tr.card-row")).to_have_count(1)
    expect(page.locator(f"#row-{cards[2].pk}")).to_be_visible()
    for card in cards[:2]:
        assert Approval.objects.get(pk=card.pk).status == Approval.Status.REJECTED
    entries = AuditEntry.objects.filter(action="approval.reject", actor="reviewer")
    assert sorted(entries.values_list("approval_id", flat=True)) == sorted(c.pk for c in cards[:2])


def test_a_row_expands_into_the_card_and_is_decided_there(console_server, page, reviewer):
    card, other = park(), park(15_000)
    log_in(page, console_server)
    page.locator(f"#row-{card.pk} [data-expand]").click()
    section = page.locator(f"#detail-{card.pk} #card-{card.pk}")
    expect(section).to_have_attribute("data-status", "pending")
    expect(section.locator(".card-amount")).to_have_text("125.00 EUR")
    page.wait_for_timeout(5_500)  # a refresh of the rows keeps the expanded card open
    expect(section).to_be_visible()

    section.locator("button.card-button-approve").click()
    expect(page.locator(f"#row-{card.pk}")).to_have_count(0)
    expect(page.locator(f"#row-{other.pk}")).to_be_visible()
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.APPROVED


def test_a_row_that_cannot_show_all_that_runs_is_approved_only_on_its_card(console_server, page, reviewer):
    """Issue 24: a refund card runs an email its row does not show. The row says so; ticking it disables "Approve
    selected" (the server refuses it too); the a key opens the card; rejecting it from the row stays possible."""
    refund, plain = park(), shown_in_full(park(20_000))
    log_in(page, console_server)
    row = page.locator(f"#row-{refund.pk}")
    expect(row.locator(".row-not-shown")).to_contain_text("4 fields not shown here")
    expect(page.locator(f"#row-{plain.pk} .row-not-shown")).to_have_count(0)

    page.locator(f"#row-{plain.pk} input[name=cards]").check()
    expect(page.locator("#bulk button.approve")).to_be_enabled()
    row.locator("input[name=cards]").check()
    expect(page.locator("#bulk button.approve")).to_be_disabled()
    expect(page.locator("#bulk button.reject")).to_be_enabled()
    row.locator("input[name=cards]").uncheck()
    page.locator("#bulk button.approve").click()
    expect(page.locator("#bulk-result")).to_contain_text("1 of 1 card decided")
    assert Approval.objects.get(pk=plain.pk).status == Approval.Status.APPROVED

    row.locator("td.workflow").click()  # select the row
    page.keyboard.press("a")
    page.wait_for_url(f"{console_server.url}/approvals/{refund.pk}/")  # opened, not approved
    assert Approval.objects.get(pk=refund.pk).status == Approval.Status.PENDING
