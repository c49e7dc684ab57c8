"""In Chromium: a reviewer decides demo cards on /approvals/<id>/ (approve, edit, reject), the timer counts down
live, and an agent's hostile text renders as text."""

from __future__ import annotations

import copy
from datetime import timedelta

from django.contrib.auth.models import User
from django.utils import timezone
from playwright.sync_api import expect

from approvals.models import Approval, Decision
from demo import sandbox
from demo.models import SandboxCall
from runs import submission
from runs.models import Run
from tests.conftest import log_in
from tests.engine_helpers import REFUND, drive
from tests.worker import wait_until

XSS_SCRIPT = "<script>alert(1)</script>"
XSS_IMG = '"><img src=x onerror=alert(1)>'


def park(input: dict = REFUND) -> Approval:
    run, _ = submission.submit(workflow="refund", input=input, created_by=User.objects.get(username="agent"))
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN
    return Approval.objects.get(run=run)


def open_card(page, server, card: Approval):
    page.goto(f"{server.url}/approvals/{card.pk}/")
    section = page.locator(f"#card-{card.pk}")
    expect(section).to_have_attribute("data-status", "pending")
    return section


def test_a_reviewer_sees_the_diff_and_timer_approves_and_the_run_finishes(console_server, page, reviewer, start_worker):
    card = park()
    log_in(page, console_server)
    section = open_card(page, console_server, card)

    amount = section.locator('tr.diff-row[data-path="refund.amount_cents"]')
    expect(amount).to_have_attribute("data-op", "changed")
    expect(amount.locator(".diff-marker")).to_contain_text("~")
    expect(amount.locator(".diff-new")).to_have_text("12500")
    expect(section.locator('tr[data-path="email.body"] .diff-line.diff-added').first).to_be_visible()
    expect(section.locator(".card-amount")).to_have_text("125.00 EUR")
    timer = section.locator(".card-sla")
    expect(timer).to_have_class("card-sla card-sla-on_time")
    remaining = timer.locator(".card-sla-remaining")
    first = remaining.inner_text()
    assert first.endswith("left")
    expect(remaining).not_to_have_text(first, timeout=3_000)  # counts down live

    section.locator("button.card-button-approve").click()

    expect(section).to_have_attribute("data-status", "approved")
    expect(page.locator(f"#card-{card.pk} .card-decision-by")).to_have_text("reviewer")
    expect(page.locator(f"#card-{card.pk} button.card-button-approve")).to_have_count(0)
    assert page.url == f"{console_server.url}/approvals/{card.pk}/"  # one click, no page load

    start_worker()
    run = wait_until(
        lambda: Run.objects.filter(pk=card.run_id, status=Run.Status.SUCCEEDED).first(),
        message="the approved run to finish",
    )
    assert run.status == Run.Status.SUCCEEDED
    assert sandbox.stats()["channels"]["payments"] == 1
    assert sandbox.stats()["duplicates"] == 0
    page.reload()
    expect(page.locator(f"#card-{card.pk} .card-run-status")).to_have_text("Succeeded")


def test_a_reviewer_edits_the_amount_previews_confirms_and_that_is_what_is_paid(console_server, page, reviewer):
    card = park()
    log_in(page, console_server)
    section = open_card(page, console_server, card)

    section.locator(".card-edit summary").click()
    amount = section.locator('input[name="p:refund.amount_cents"]')
    expect(amount).to_have_value("12500")
    amount.fill("12.5")  # not whole cents: refused with a field error
    section.locator("button.card-button-preview").click()
    expect(page.locator(f"#card-{card.pk} .card-field-error")).to_be_visible()
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.PENDING

    section = page.locator(f"#card-{card.pk}")
    section.locator('input[name="p:refund.amount_cents"]').fill("4321")
    section.locator("button.card-button-preview").click()
    preview = page.locator(f"#card-{card.pk} .card-preview")
    expect(preview.locator('tr[data-path="refund.amount_cents"] .diff-old')).to_have_text("12500")
    expect(preview.locator('tr[data-path="refund.amount_cents"] .diff-new')).to_have_text("4321")
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.PENDING  # a preview decides nothing

    preview.locator("button.card-button-confirm").click()

    expect(page.locator(f"#card-{card.pk}")).to_have_attribute("data-status", "edited")
    assert Decision.objects.get(approval=card).payload["refund"]["amount_cents"] == 4321
    run = Run.objects.get(pk=card.run_id)
    assert run.status == Run.Status.QUEUED
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    payment = SandboxCall.objects.get(system="payments")
    assert payment.payload["amount_cents"] == 4321
    assert sandbox.stats()["channels"]["payments"] == 1


def test_a_reviewer_rejects_is_stopped_until_a_comment_is_given_and_nothing_is_paid(console_server, page, reviewer):
    card = park()
    log_in(page, console_server)
    section = open_card(page, console_server, card)

    section.locator(".card-reject summary").click()
    form = section.locator("form.card-reject-form")
    form.locator("select[name=reason]").select_option("wrong_amount")
    form.locator("button.card-button-reject-confirm").click()
    comment = form.locator("textarea[name=comment]")
    assert comment.evaluate("textarea => textarea.validity.valueMissing")  # the browser does not send it
    # Blanks get past the browser; the server refuses them and says why, in place.
    comment.fill("   ")
    form.locator("button.card-button-reject-confirm").click()
    expect(page.locator(f"#card-{card.pk} .card-reject .card-field-error")).to_contain_text("comment")
    expect(page.locator(f"#card-{card.pk}")).to_have_attribute("data-status", "pending")
    assert not Decision.objects.exists()
    assert Run.objects.get(pk=card.run_id).status == Run.Status.WAITING_HUMAN

    form = page.locator(f"#card-{card.pk} form.card-reject-form")
    form.locator("select[name=reason]").select_option("wrong_amount")
    form.locator("textarea[name=comment]").fill("the order was 25 EUR")
    form.locator("button.card-button-reject-confirm").click()

    section = page.locator(f"#card-{card.pk}")
    expect(section).to_have_attribute("data-status", "rejected")
    expect(section.locator(".card-decision-reason")).to_have_text("Wrong amount")
    expect(section.locator(".card-decision-comment")).to_have_text("the order was 25 EUR")
    run = drive(Run.objects.get(pk=card.run_id))
    assert run.is_finished
    assert sandbox.stats()["channels"]["payments"] == 0
    assert sandbox.stats()["channels"]["email"] == 0


def test_a_card_decided_elsewhere_shows_who_took_it(console_server, page, reviewer):
    card = park()
    log_in(page, console_server)
    section = open_card(page, console_server, card)
    card.decide(User.objects.get(username="admin"), "approve")

    section.locator("button.card-button-approve").click()

    expect(page.locator(f"#card-{card.pk} .card-conflict")).to_contain_text("already approved by admin")
    expect(page.locator(f"#card-{card.pk}")).to_have_attribute("data-status", "approved")
    assert Decision.objects.filter(approval=card).count() == 1


def test_the_timer_turns_red_live_when_the_deadline_passes(console_server, page, reviewer):
    card = park()
    log_in(page, console_server)
    # Due 8 s after the page is asked for: enough for the page to load on a busy machine (CI failed once at 3 s).
    Approval.objects.filter(pk=card.pk).update(due_at=timezone.now() + timedelta(seconds=8))
    section = open_card(page, console_server, card)
    timer = section.locator(".card-sla")
    expect(timer).to_have_attribute("data-state", "due_soon")  # < 5 minutes: amber, from the server
    expect(timer).to_have_attribute("data-state", "breached", timeout=20_000)  # then red, in the browser
    expect(timer).to_have_class("card-sla card-sla-breached")
    expect(timer.locator(".card-sla-label")).to_have_text("SLA breached")


def test_hostile_agent_text_renders_as_text(console_server, page, reviewer):
    card = park()
    proposed = copy.deepcopy(card.proposed)
    proposed["email"]["body"] = f"Hello\n{XSS_SCRIPT}\n{XSS_IMG}"
    Approval.objects.filter(pk=card.pk).update(
        summary=f"{XSS_SCRIPT} and {XSS_IMG}",
        proposed=proposed,
        citations=[
            {"title": XSS_SCRIPT, "url": "javascript:alert(1)"},
            {"title": XSS_IMG, "url": "https://example.com/policy"},
        ],
    )
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    log_in(page, console_server)

    section = open_card(page, console_server, card)

    expect(section.locator(".card-summary")).to_have_text(f"{XSS_SCRIPT} and {XSS_IMG}")
    citations = section.locator(".card-citations li")
    expect(citations.nth(0)).to_contain_text(XSS_SCRIPT)
    expect(citations.nth(0).locator("a")).to_have_count(0)  # a javascript: URL is not a link
    expect(citations.nth(1).locator("a")).to_have_text(XSS_IMG)
    expect(citations.nth(1).locator("a")).to_have_attribute("rel", "noopener noreferrer")
    body = section.locator('tr[data-path="email.body"]')
    expect(body.locator(".diff-line", has_text=XSS_SCRIPT)).to_be_visible()
    expect(body.locator(".diff-line", has_text=XSS_IMG)).to_be_visible()
    # the edit form and its preview carry the same text, escaped too
    section.locator(".card-edit summary").click()
    section.locator("button.card-button-preview").click()
    expect(page.locator(f"#card-{card.pk} .card-preview")).to_be_visible()
    expect(page.locator(f"#card-{card.pk} img")).to_have_count(0)
    page.wait_for_timeout(500)  # an injected onerror would have fired by now
    assert dialogs == []
    assert page.locator("script:not([src])").count() == 0
