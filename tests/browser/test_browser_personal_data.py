"""In Chromium: personal data on a card shows masked; a holder of view_pii on its channel presses Reveal and sees the
value, and the reveal is in the audit log (issue 29, docs/personal-data.md "Who can see it")."""

from __future__ import annotations

from django.contrib.auth.models import User
from guardian.shortcuts import assign_perm
from playwright.sync_api import expect

from approvals.models import Approval
from core import pii
from core.models import AuditEntry, Channel
from runs import submission
from runs.models import Run
from tests.conftest import log_in
from tests.engine_helpers import REFUND, drive

EMAIL = "jane.doe@example.com"


def park_with_personal_data() -> Approval:
    run, _ = submission.submit(workflow="refund", input=REFUND, created_by=User.objects.get(username="agent"))
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN
    card = Approval.objects.get(run=run)
    ref = pii.seal(EMAIL, subject="cus_1042", field="customer.email", run_id=run.pk)
    Approval.objects.filter(pk=card.pk).update(
        proposed={**card.proposed, "email": {**card.proposed["email"], "to": ref}}
    )
    return card


def test_a_reviewer_sees_the_mask_and_a_view_pii_holder_reveals_the_value(console_server, page, reviewer):
    card = park_with_personal_data()
    log_in(page, console_server)
    page.goto(f"{console_server.url}/approvals/{card.pk}/")
    section = page.locator(f"#card-{card.pk}")
    expect(section.locator('tr[data-path="email.to"] .diff-new')).to_have_text("j***@example.com")
    expect(section.locator("button.card-button-reveal")).to_have_count(0)
    assert EMAIL not in page.content()

    assign_perm("core.view_pii", reviewer, Channel.objects.get(name="payments"))
    page.reload()
    expect(section.locator('tr[data-path="email.to"] .diff-new')).to_have_text("j***@example.com")
    section.locator("button.card-button-reveal").click()
    revealed = section.locator('.card-revealed tr[data-path="proposed.email.to"] .card-revealed-value')
    expect(revealed).to_have_text(EMAIL)
    entry = AuditEntry.objects.get(action="pii.view")
    assert entry.actor == "reviewer" and entry.approval_id == card.pk and "proposed.email.to" in entry.data["fields"]
