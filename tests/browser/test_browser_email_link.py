"""In Chromium: a reviewer follows the Approve link of the escalation email, logs in, finds the card with Approve
pre-selected, presses it, and the card is decided, audited `via: email` (approvals.links)."""

from __future__ import annotations

import re
from datetime import timedelta

from django.contrib.auth.models import Group, User
from django.core import mail
from playwright.sync_api import expect

from approvals import sla
from approvals.models import Approval, DecisionLink, Notification
from approvals.tasks import send_notification
from core.models import AuditEntry, Channel
from runs import submission
from tests.engine_helpers import REFUND, drive


def test_a_reviewer_approves_from_the_email_link_after_logging_in(console_server, page, reviewer, settings):
    settings.NOTIFY_BACKENDS = ["email"]
    settings.CONSOLE_URL = console_server.url
    leads = Group.objects.create(name="payments-leads")
    reviewer.email = "reviewer@example.com"
    reviewer.save(update_fields=["email"])
    reviewer.groups.add(leads)
    Channel.objects.filter(name="payments").update(escalation_policy="escalate", escalation_group=leads)
    run = drive(submission.submit(workflow="refund", input=REFUND, created_by=User.objects.get(username="agent"))[0])
    card = Approval.objects.get(run=run)
    assert sla.apply_sla(card.pk, card.due_at + timedelta(seconds=1)) == "escalate"
    assert send_notification(notification_id=Notification.objects.get(approval=card).pk) == "sent"
    (message,) = mail.outbox
    (html, _), *_ = message.alternatives

    # The email as a mail client shows it; its Approve link leads to the console's login first.
    page.set_content(html)
    page.click("a.decision-link-approve")
    page.wait_for_url(re.compile(re.escape(console_server.url) + r"/accounts/login/\?next=/approvals/email/"))
    page.fill("#id_username", "reviewer")
    page.fill("#id_password", "password")
    page.click("button[type=submit]")

    page.wait_for_url(re.compile(re.escape(console_server.url) + r"/approvals/email/[^/]+/$"))
    section = page.locator(f"#card-{card.pk}")
    expect(section).to_have_attribute("data-status", "escalated")
    expect(section.locator(".card-via-link")).to_contain_text("You followed the Approve link from your email")
    approve = section.locator("form.card-approve")
    expect(approve).to_have_class(re.compile(r"\bcard-preselected\b"))
    expect(approve.locator("button.card-button-approve")).to_be_focused()
    expect(section.locator("details.card-reject")).not_to_have_attribute("open", "")
    # Landing decided nothing.
    card.refresh_from_db()
    assert card.status == Approval.Status.ESCALATED and not card.decisions.exists()
    assert not DecisionLink.objects.filter(used_at__isnull=False).exists()

    approve.locator("button.card-button-approve").click()

    expect(section).to_have_attribute("data-status", "approved")
    expect(page.locator(f"#card-{card.pk} .card-decision-by")).to_have_text("reviewer")
    page.wait_for_url(f"{console_server.url}/approvals/{card.pk}/")  # not the used link's address
    card.refresh_from_db()
    assert card.status == Approval.Status.APPROVED
    entry = AuditEntry.objects.get(approval_id=card.pk, action="approval.approve")
    assert entry.actor == "reviewer" and entry.data["via"] == "email"
    assert DecisionLink.objects.get(recipient=reviewer, decision="approve").used_at is not None

    # The link again, as from the email a second time: used, and it says so.
    page.set_content(html)
    page.click("a.decision-link-approve")
    expect(page.locator(".link-refused-reason")).to_contain_text("This link was already used")
