"""In Chromium: undo (runs.compensations). Ops cancel and undo a support_agent run parked at its email card after
its refund, from the run's page, whose Effects table then says the refund was undone and by whom; a reviewer
rejects and undoes from the email card's page; a run with nothing done offers neither button. The engine is driven
in the test process (tests.engine_helpers.drive), the reversal's own card decided in-process."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import expect

from approvals.models import Approval, Decision
from demo.models import SandboxCall
from runs import submission
from runs.models import Receipt, Run
from tests.conftest import log_in, set_production_password
from tests.engine_helpers import REFUND, drive

SUPPORT = {"customer_id": "cus_1042", "message": "Refund ord_10421 please, 20 EUR", "order_id": "ord_10421"}


@pytest.fixture
def ops(reviewer):
    """The demo's ops user (cancels runs), able to log in to the console server."""
    user = User.objects.get(username="ops")
    set_production_password(user)
    return user


def _parked_at_the_email(reviewer: User) -> Run:
    """A support_agent run that refunded (its card approved) and now waits on its email's card."""
    run = drive(submission.submit(workflow="support_agent", input=SUPPORT)[0])
    for _ in range(3):  # the refund's card (from the threshold up), then the email's
        card = Approval.objects.filter(run=run, status=Approval.Status.PENDING).first()
        if card is not None and card.proposed.get("subject"):
            assert Receipt.objects.filter(run=run, channel="payments", status="done").count() == 1
            return run
        if card is not None:
            card.decide(reviewer, "approve")
        run = drive(run)
    raise AssertionError(f"no email card: {run.status} {run.result}")


def _refund_row(page):
    return page.locator("[data-testid=effects] tr[data-effect]", has_text="payments")


def _reversals(run: Run) -> list[SandboxCall]:
    return list(SandboxCall.objects.filter(run_id=run.id, system="payments", payload__has_key="reverses", applied=True))


def test_ops_cancel_and_undo_from_the_run_page_and_it_shows_the_refund_undone(console_server, page, reviewer, ops):
    run = _parked_at_the_email(reviewer)
    log_in(page, console_server, "ops")
    page.goto(f"{console_server.url}/runs/{run.pk}/")

    row = _refund_row(page)
    expect(row).to_have_count(1)
    expect(row.locator("td.effect-undo")).to_contain_text("can be undone until")
    expect(row.locator("td.effect-undo")).to_contain_text("a person says yes first")
    expect(row.locator("td.effect-undone")).to_have_text("—")
    button = page.get_by_test_id("cancel-and-undo")
    expect(button).to_have_text("Cancel and undo")
    page.on("dialog", lambda dialog: dialog.accept())  # a confirm, should the page ask for one (it has none now)

    button.click()

    expect(page.locator(".message.success")).to_have_text("Cancelled: what the run did is being undone, latest first.")
    expect(page.locator("dd.undo-reason")).to_have_text("cancelled and undone")
    expect(page.locator("h1 .run-status")).to_have_text("Queued")
    run.refresh_from_db()
    assert (run.status, run.undo_reason) == (Run.Status.QUEUED, "cancelled")
    assert not Approval.objects.filter(run=run, kind="action", status=Approval.Status.PENDING).exists()

    run = drive(run)
    assert (run.status, run.undo_reason) == (Run.Status.WAITING_HUMAN, "cancelled")
    assert not _reversals(run)  # gated: nothing reversed before a person says yes
    Approval.objects.get(run=run, kind="undo", status=Approval.Status.PENDING).decide(reviewer, "approve")
    run = drive(run)
    assert run.status == Run.Status.COMPENSATED and len(_reversals(run)) == 1

    page.reload()
    expect(page.locator("h1 .run-status")).to_have_text("Compensated")
    expect(page.locator("h1 .run-status")).to_have_class("run-status status-compensated")
    row = _refund_row(page)
    expect(row.locator(".undo-outcome")).to_have_class("undo-outcome undo-done")
    expect(row.locator("td.effect-undone")).to_contain_text("undone by reviewer at")
    expect(page.get_by_test_id("cancel-and-undo")).to_have_count(0)  # finished: nothing left to cancel


def test_a_reviewer_rejects_and_undoes_the_email_card_from_its_page(console_server, page, reviewer):
    run = _parked_at_the_email(reviewer)
    card = Approval.objects.get(run=run, status=Approval.Status.PENDING)
    log_in(page, console_server)
    page.goto(f"{console_server.url}/approvals/{card.pk}/")
    section = page.locator(f"#card-{card.pk}")
    expect(section).to_have_attribute("data-status", "pending")

    section.locator(".card-reject summary").click()
    form = section.locator("form.card-reject-form")
    undo = form.get_by_test_id("reject-and-undo")
    expect(undo).to_have_text("Reject and undo")
    form.locator("select[name=reason]").select_option("wrong_recipient")
    form.locator("textarea[name=comment]").fill("wrong customer: undo it")
    undo.click()

    section = page.locator(f"#card-{card.pk}")
    expect(section).to_have_attribute("data-status", "rejected")
    expect(section.locator(".card-decision-what")).to_have_text("reject and undo")
    expect(section.locator(".card-decision-reason")).to_have_text("Wrong recipient")
    expect(section.locator(".card-decision-comment")).to_have_text("wrong customer: undo it")
    decision = Decision.objects.get(approval=card)
    assert (decision.decision, decision.undo, decision.actor, decision.reason) == (
        "reject",
        True,
        reviewer,
        "wrong_recipient",
    )
    assert page.url == f"{console_server.url}/approvals/{card.pk}/"  # swapped in place by htmx, no page load
    run = drive(Run.objects.get(pk=run.pk))
    assert (run.status, run.undo_reason) == (Run.Status.WAITING_HUMAN, "rejected")
    assert Approval.objects.filter(run=run, kind="undo", status=Approval.Status.PENDING).count() == 1
    assert not _reversals(run)
    assert not SandboxCall.objects.filter(run_id=run.id, system="email").exists()  # the email never went


def test_a_run_with_nothing_done_offers_no_undo(console_server, page, reviewer, ops):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])  # parked at its gate: nothing done yet
    card = Approval.objects.get(run=run, status=Approval.Status.PENDING)
    assert card.kind == "action"
    log_in(page, console_server)
    page.goto(f"{console_server.url}/approvals/{card.pk}/")
    section = page.locator(f"#card-{card.pk}")
    expect(section).to_have_attribute("data-status", "pending")
    section.locator(".card-reject summary").click()
    expect(section.locator("button.card-button-reject-confirm")).to_be_visible()  # the rejection is offered...
    expect(section.get_by_test_id("reject-and-undo")).to_have_count(0)  # ...without an undo

    page.context.clear_cookies()
    log_in(page, console_server, "ops")
    page.goto(f"{console_server.url}/runs/{run.pk}/")
    cancel = page.locator("form.run-cancel")
    expect(cancel.get_by_role("button", name="Cancel run", exact=True)).to_be_visible()  # ops may cancel it...
    expect(page.get_by_test_id("cancel-and-undo")).to_have_count(0)  # ...but not undo it
    expect(page.get_by_test_id("effects")).to_have_count(0)
