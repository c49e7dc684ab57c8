"""In Chromium: support_agent cards (demo_traffic's, a submitted run's) are in the inbox; the refund card shows
the proposal against the order's refund state and the model's words; approved, the worker carries the agent on to
its email card, and the run page shows the conversation."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.core.management import call_command
from playwright.sync_api import expect

from approvals.models import Approval
from demo import sandbox
from runs import submission
from runs.models import Run
from tests.conftest import log_in
from tests.engine_helpers import drive
from tests.worker import wait_until


def test_support_agent_cards_are_in_the_inbox_and_the_card_shows_the_diff(console_server, page, reviewer, start_worker):
    call_command("demo_traffic", runs=3, seed=4, workflow="support_agent", verbosity=0)
    run, _ = submission.submit(
        workflow="support_agent",
        input={"customer_id": "cus_2077", "message": "Order never arrived, I want my money back."},
        created_by=User.objects.get(username="agent"),
    )
    for queued in Run.objects.all():
        drive(queued)
    cards = list(Approval.objects.filter(workflow="support_agent", status="pending"))
    assert len(cards) == 4
    card = Approval.objects.get(run=run)
    order = sandbox.orders_of("cus_2077")[0]

    log_in(page, console_server)
    for each in cards:
        expect(page.locator(f"#row-{each.pk} td.workflow")).to_have_text("support_agent")

    page.goto(f"{console_server.url}/approvals/{card.pk}/")
    section = page.locator(f"#card-{card.pk}")
    expect(section).to_have_attribute("data-status", "pending")
    amount = section.locator('tr.diff-row[data-path="amount_cents"]')
    expect(amount).to_have_attribute("data-op", "changed")
    expect(amount.locator(".diff-old")).to_have_text("0")
    expect(amount.locator(".diff-new")).to_have_text(str(order["total_cents"]))
    expect(section.locator('tr.diff-row[data-path="order_id"]')).to_have_attribute("data-op", "same")
    expect(section.locator(".card-summary")).to_contain_text(f"order {order['id']}")
    expect(section.locator(".card-sla")).to_be_visible()
    section.locator("button.card-button-approve").click()
    expect(section).to_have_attribute("data-status", "approved")

    start_worker()
    wait_until(
        lambda: Approval.objects.filter(run=run, rule_id="tool:send_email", status="pending").exists(),
        message="the agent to go on to its email",
    )
    page.goto(f"{console_server.url}/runs/{run.pk}/")
    call = page.locator('li.agent-call[data-tool="refund_order"]')
    expect(call.locator(".agent-approved")).to_contain_text("approved by reviewer")
    email = page.locator('li.agent-call[data-tool="send_email"]')
    expect(email.locator(".step-status")).to_have_text("waiting")
    expect(email.locator(".agent-card a")).to_have_attribute(
        "href", f"/approvals/{Approval.objects.get(run=run, rule_id='tool:send_email').pk}/"
    )
