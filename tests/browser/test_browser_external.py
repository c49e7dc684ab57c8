"""In Chromium: an external agent's request (issue 19) shows in the inbox, on its card and on its run's page as
clearly as a card of our own workflows: what it wants (the diff against the current state), why, the SLA timer;
after the agent consumed the approval without reporting back, "outcome unknown"; then what it reported."""

from __future__ import annotations

import hashlib
import json

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import expect

from core.models import ApiToken
from external import asks, executions
from external.asks import Ask
from tests.conftest import log_in

pytestmark = [pytest.mark.slow, pytest.mark.browser]

ARGUMENTS = {"order_id": "ord_9", "amount_cents": 4_250, "currency": "EUR", "reason": "parcel lost"}


def test_a_reviewer_sees_and_approves_an_external_request_then_its_outcome(console_server, page, reviewer, client):
    agent = User.objects.get(username="agent")
    request, _ = asks.open_request(
        agent,
        Ask(
            channel="payments",
            action="refund_order",
            arguments=ARGUMENTS,
            idempotency_key="browser-1",
            current={"order_id": "ord_9", "amount_cents": 0, "currency": "EUR", "reason": ""},
            rationale={"summary": "The carrier lost the parcel; the customer asked for a refund.", "rule_id": "RF-7"},
            display={"headline": "reason", "amount_minor": "amount_cents", "currency": "currency"},
        ),
    )
    log_in(page, console_server)
    row = page.locator(f"#row-{request.card_id}")
    expect(row).to_contain_text("parcel lost")
    expect(row).to_contain_text("42.50 EUR")
    row.locator("td.summary a").click()

    section = page.locator(f"#card-{request.card_id}")
    expect(section.locator('tr.diff-row[data-path="amount_cents"] .diff-new')).to_have_text("4250")
    expect(section).to_contain_text("The carrier lost the parcel")
    expect(section.locator(".card-sla-remaining")).to_contain_text("left")
    expect(section.locator("button.card-button-approve")).to_be_visible()
    expect(section.locator(".card-button-edit")).to_have_count(0)  # the agent sent no schema: nothing to edit against
    section.locator("button.card-button-approve").click()
    expect(section).to_have_attribute("data-status", "approved")

    # The agent consumes the approval and does not report back (it crashed): the card says the outcome is unknown.
    canonical = json.dumps(ARGUMENTS, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    executions.consume(agent, request.id, hashlib.sha256(canonical).hexdigest())
    page.reload()
    expect(page.locator(".card-execution-unknown")).to_contain_text("Outcome unknown")

    executions.report(agent, request.id, ok=True, result={"refund_id": "re_77"})
    page.reload()
    expect(page.locator(".card-outcome-done")).to_be_visible()
    expect(page.locator(".card-execution-response")).to_contain_text("re_77")

    # The run's page: the agent's session, its request as a step of its timeline.
    page.goto(f"{console_server.url}/runs/{request.run_id}/")
    expect(page.locator("body")).to_contain_text("external")
    expect(page.locator("body")).to_contain_text("refund_order")
    assert ApiToken.objects.count() == 0  # nothing here needed a token: the agent's side went through the module
