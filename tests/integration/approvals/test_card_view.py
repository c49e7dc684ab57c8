"""The card page /approvals/<id>/ and its decisions POST /approvals/<id>/decide (htmx and plain forms)."""

from __future__ import annotations

import copy
import json
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.template.loader import render_to_string
from django.test import Client
from django.utils import timezone
from guardian.shortcuts import assign_perm

import tests.workflows  # noqa: F401 - registers test_reject_fails
from approvals.models import Approval, Decision, RejectReason
from approvals.views import prepare, sla
from core import pii
from core.models import AuditEntry, Channel
from demo.models import SandboxCall
from runs import submission
from runs.models import Run
from tests.engine_helpers import REFUND, drive, queued_jobs

XSS_SCRIPT = "<script>alert(1)</script>"
XSS_IMG = '"><img src=x onerror=alert(1)>'
HTMX = {"HX-Request": "true"}


@pytest.fixture
def channels(db):
    call_command("demo_setup", verbosity=0)
    return {c.name: c for c in Channel.objects.all()}


@pytest.fixture
def bob_reviews_payments(bob, channels):
    assign_perm("core.approve_channel", bob, channels["payments"])
    return bob


@pytest.fixture
def erin(channels):
    """A reviewer of another channel (email) only."""
    user = User.objects.create_user("erin", password="password")
    assign_perm("core.approve_channel", user, channels["email"])
    return user


@pytest.fixture
def agent(channels):
    return User.objects.get(username="agent")


def park(created_by=None, input: dict = REFUND) -> Approval:
    run, _ = submission.submit(workflow="refund", input=input, created_by=created_by)
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN
    return Approval.objects.get(run=run)


@pytest.fixture
def card(agent, bob_reviews_payments) -> Approval:
    return park(agent)


def snapshot(card: Approval) -> tuple:
    card = Approval.objects.get(pk=card.pk)
    run = Run.objects.get(pk=card.run_id)
    return (card.status, card.version, card.decided_at, card.proposed, card.decisions.count(), run.status)


def post(client, card, htmx=True, **data):
    data.setdefault("version", card.version)
    return client.post(f"/approvals/{card.pk}/decide", data, headers=HTMX if htmx else {})


def edit_fields(card, **changes) -> dict:
    fields = {
        "p:refund.amount_cents": card.proposed["refund"]["amount_cents"],
        "p:refund.currency": card.proposed["refund"]["currency"],
        "p:email.subject": card.proposed["email"]["subject"],
        "p:email.body": card.proposed["email"]["body"],
    }
    return {**fields, **changes}


# --- the page ------------------------------------------------------------------------------------------------


def test_it_shows_the_diff_the_rationale_the_run_and_the_timer(client, card, bob):
    client.force_login(bob)

    response = client.get(f"/approvals/{card.pk}/")

    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-path="refund.amount_cents" data-op="changed"' in html
    assert 'data-path="email.subject" data-op="changed"' in html
    assert 'data-path="refund.customer_id" data-op="same"' in html
    assert 'class="diff-line diff-added"' in html  # the email body, line by line
    assert pii.REF.search(card.summary) and pii.present(card.summary) in html  # the customer's name, masked
    assert card.rule_id in html
    assert f"{round(card.confidence * 100)}%" in html
    assert 'href="https://policies.example.com/refunds#' in html
    assert 'rel="noopener noreferrer"' in html
    assert "125.00 EUR" in html
    assert f'href="/runs/{card.run_id}/"' in html
    assert "lookup_customer" in html and "<details>" in html
    assert 'class="card-sla card-sla-on_time"' in html
    assert card.due_at.strftime("%Y-%m-%d") in html
    assert "/sla.js" in html
    assert f'name="version" value="{card.version}"' in html
    assert "<html" in html


def test_an_agents_current_equal_to_what_runs_is_said_as_such(client, card, bob):
    """Issue 24: the same words as in Slack (approvals.diff.CLAIMS_UNCHANGED), every field shown, not "no change"."""
    Approval.objects.filter(pk=card.pk).update(current=card.proposed)
    client.force_login(bob)
    html = client.get(f"/approvals/{card.pk}/").content.decode()
    assert "The agent says the target already has these values" in html
    assert 'data-path="refund.amount_cents" data-op="same"' in html and "No change." not in html
    # Not said when something changes.
    Approval.objects.filter(pk=card.pk).update(current={**card.proposed, "refund": {}})
    assert "The agent says the target already has" not in client.get(f"/approvals/{card.pk}/").content.decode()


def test_htmx_gets_the_card_partial_alone(client, card, bob):
    client.force_login(bob)
    response = client.get(f"/approvals/{card.pk}/", headers=HTMX)
    html = response.content.decode()
    assert response.status_code == 200
    assert html.lstrip().startswith("<section") or "<html" not in html
    assert f'id="card-{card.pk}"' in html


PAGE_MATRIX = {"alice": 200, "bob": 200, "erin": 404, "carol": 404, "dave": 404}


@pytest.mark.parametrize(("who", "status"), PAGE_MATRIX.items(), ids=PAGE_MATRIX.keys())
def test_who_may_see_the_card(client, card, alice, carol, dave, erin, who, status):
    client.force_login(User.objects.get(username=who))
    assert client.get(f"/approvals/{card.pk}/").status_code == status


def test_anonymous_is_sent_to_log_in(client, card):
    response = client.get(f"/approvals/{card.pk}/")
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


def test_an_unknown_card_is_404(client, bob_reviews_payments):
    client.force_login(bob_reviews_payments)
    assert client.get("/approvals/999999/").status_code == 404


def test_the_runs_creator_sees_the_card_without_decision_forms(client, bob_reviews_payments):
    card = park(bob_reviews_payments)
    client.force_login(bob_reviews_payments)
    html = client.get(f"/approvals/{card.pk}/").content.decode()
    assert "You started this run" in html
    assert "card-approve" not in html


# --- permissions on decisions --------------------------------------------------------------------------------

DECISIONS = {
    "approve": {"decision": "approve"},
    "reject": {"decision": "reject", "reason": "policy", "comment": "not covered"},
    "edit": {"decision": "edit"},  # completed with the edit fields in the test
}
DECIDE_MATRIX = {"alice": 200, "bob": 200, "erin": 404, "carol": 404, "dave": 404}


@pytest.mark.parametrize("decision", DECISIONS)
@pytest.mark.parametrize(("who", "status"), DECIDE_MATRIX.items(), ids=DECIDE_MATRIX.keys())
def test_who_may_decide(client, card, alice, carol, dave, erin, who, status, decision):
    client.force_login(User.objects.get(username=who))
    before = snapshot(card)
    data = dict(DECISIONS[decision])
    if decision == "edit":
        data.update(edit_fields(card, **{"p:refund.amount_cents": 500}))

    response = post(client, card, **data)

    assert response.status_code == status
    if status == 200:
        card.refresh_from_db()
        assert card.status == {"approve": "approved", "reject": "rejected", "edit": "edited"}[decision]
        decision_row = Decision.objects.get(approval=card)
        assert decision_row.actor.username == who
        assert AuditEntry.objects.filter(action=f"approval.{decision}", actor=who).count() == 1
        assert Run.objects.get(pk=card.run_id).status == Run.Status.QUEUED
    else:
        assert snapshot(card) == before


@pytest.mark.parametrize("decision", DECISIONS)
def test_anonymous_decisions_are_sent_to_log_in(client, card, decision):
    before = snapshot(card)
    response = post(client, card, htmx=False, **DECISIONS[decision])
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")
    assert snapshot(card) == before


@pytest.mark.parametrize("decision", DECISIONS)
def test_the_runs_creator_gets_403(client, bob_reviews_payments, decision):
    card = park(bob_reviews_payments)
    client.force_login(bob_reviews_payments)
    before = snapshot(card)
    data = dict(DECISIONS[decision])
    if decision == "edit":
        data.update(edit_fields(card))
    assert post(client, card, **data).status_code == 403
    assert snapshot(card) == before


def test_decide_needs_post(client, card, bob):
    client.force_login(bob)
    assert client.get(f"/approvals/{card.pk}/decide").status_code == 405


def test_decide_needs_the_csrf_token(card, bob):
    client = Client(enforce_csrf_checks=True)
    client.force_login(bob)
    before = snapshot(card)
    assert post(client, card, decision="approve").status_code == 403
    assert snapshot(card) == before


# --- approve -------------------------------------------------------------------------------------------------


def test_an_approval_answers_the_decided_card_and_the_htmx_event(client, card, bob):
    client.force_login(bob)

    response = post(client, card, decision="approve")

    assert response.status_code == 200
    assert "approvals-changed" in response["HX-Trigger-After-Settle"]
    html = response.content.decode()
    assert "<html" not in html
    assert 'data-status="approved"' in html
    assert "card-decision-by" in html and ">bob<" in html
    assert "card-approve" not in html  # no second decision from this card
    run = Run.objects.get(pk=card.run_id)
    assert run.status == Run.Status.QUEUED
    assert queued_jobs(run) == 1


def test_without_htmx_a_decision_redirects_to_the_card(client, card, bob):
    client.force_login(bob)
    response = post(client, card, htmx=False, decision="approve")
    assert response.status_code == 302
    assert response["Location"] == f"/approvals/{card.pk}/"


@pytest.mark.parametrize("decision", ["approve", "reject", "maybe"])
@pytest.mark.parametrize("version", [None, "", "two"], ids=["absent", "empty", "not-a-number"])
def test_a_decision_without_a_version_is_refused(client, card, bob, decision, version):
    """Said before anything else is checked: the decision itself, or a rejection's form."""
    client.force_login(bob)
    before = snapshot(card)
    data = {"decision": decision} if version is None else {"decision": decision, "version": version}
    response = client.post(f"/approvals/{card.pk}/decide", data, headers=HTMX)
    assert response.status_code == 422
    html = response.content.decode()
    assert "The card&#x27;s version is missing: reload the card." in html
    assert "Choose a reason." not in html and "Choose approve, edit or reject." not in html
    assert snapshot(card) == before


@pytest.mark.parametrize("decision", ["maybe", ""])
def test_an_unknown_decision_is_refused(client, card, bob, decision):
    client.force_login(bob)
    before = snapshot(card)
    response = post(client, card, decision=decision)
    assert response.status_code == 422
    assert "Choose approve, edit or reject." in response.content.decode()
    assert snapshot(card) == before


# --- 409: decided elsewhere ----------------------------------------------------------------------------------


def test_a_card_decided_elsewhere_shows_who_and_when_and_takes_no_second_decision(client, card, bob, alice):
    opened_version = card.version
    card.decide(alice, "reject", comment="duplicate of another refund", reason="duplicate")
    client.force_login(bob)

    response = post(client, card, decision="approve", version=opened_version)

    assert response.status_code == 409
    html = response.content.decode()
    assert "already rejected by alice" in html
    assert 'class="card-conflict"' in html
    assert 'data-status="rejected"' in html
    assert "duplicate of another refund" in html
    assert "card-approve" not in html
    assert Decision.objects.filter(approval=card).count() == 1
    assert "HX-Trigger-After-Settle" not in response


def test_a_stale_version_is_409_and_shows_the_card_again(client, card, bob):
    client.force_login(bob)
    before = snapshot(card)
    response = post(client, card, decision="approve", version=card.version + 3)
    assert response.status_code == 409
    assert "changed since you opened it" in response.content.decode()
    assert snapshot(card) == before


# --- reject --------------------------------------------------------------------------------------------------


def test_a_rejection_records_the_reason_and_comment(client, card, bob):
    client.force_login(bob)

    response = post(client, card, decision="reject", reason="wrong_amount", comment="should be 50 EUR")

    assert response.status_code == 200
    decision = Decision.objects.get(approval=card)
    assert (decision.decision, decision.reason, decision.comment) == ("reject", "wrong_amount", "should be 50 EUR")
    html = response.content.decode()
    assert "Wrong amount" in html and "should be 50 EUR" in html


REFUSED_REJECTIONS = {
    "no comment": ({"reason": "policy"}, "comment"),
    "blank comment": ({"reason": "policy", "comment": "   "}, "comment"),
    "no reason": ({"comment": "no"}, "reason"),
    "unknown reason": ({"comment": "no", "reason": "vibes"}, "reason"),
}


@pytest.mark.parametrize(("data", "field"), REFUSED_REJECTIONS.values(), ids=REFUSED_REJECTIONS.keys())
def test_a_rejection_needs_a_comment_and_a_known_reason(client, card, bob, data, field):
    client.force_login(bob)
    before = snapshot(card)

    response = post(client, card, decision="reject", **data)

    assert response.status_code == 422
    html = response.content.decode()
    assert 'class="error card-field-error"' in html
    assert 'card-reject" open' in html
    assert snapshot(card) == before
    assert not Decision.objects.exists()
    assert "HX-Trigger-After-Settle" not in response


def test_the_reason_taxonomy():
    assert RejectReason.values == ["wrong_amount", "wrong_recipient", "policy", "duplicate", "other"]


# --- edit ----------------------------------------------------------------------------------------------------


def test_the_edit_form_has_typed_fields_for_the_refund(client, card, bob):
    client.force_login(bob)
    html = client.get(f"/approvals/{card.pk}/").content.decode()
    assert 'type="number" name="p:refund.amount_cents" value="12500"' in html
    assert 'name="p:email.body"' in html
    assert 'name="p:refund.customer_id"' not in html  # shown, not editable


def test_an_edit_preview_shows_the_diff_against_the_proposal_and_changes_nothing(client, card, bob):
    client.force_login(bob)
    before = snapshot(card)

    response = post(client, card, decision="edit", preview="1", **edit_fields(card, **{"p:refund.amount_cents": 4321}))

    assert response.status_code == 200
    html = response.content.decode()
    assert "card-preview" in html
    assert 'data-path="refund.amount_cents" data-op="changed"' in html
    assert "4321" in html
    assert "Confirm the edit" in html
    assert snapshot(card) == before
    assert "HX-Trigger-After-Settle" not in response


def test_a_confirmed_edit_is_the_payload_that_runs(client, card, bob):
    client.force_login(bob)
    fields = edit_fields(card, **{"p:refund.amount_cents": 4321, "p:email.body": "Hi\r\nWe refunded 43.21 EUR."})

    response = post(client, card, decision="edit", comment="partial", **fields)

    assert response.status_code == 200
    expected = copy.deepcopy(card.proposed)
    expected["refund"]["amount_cents"] = 4321
    expected["email"]["body"] = "Hi\nWe refunded 43.21 EUR."
    decision = Decision.objects.get(approval=card)
    assert (decision.decision, decision.payload, decision.comment) == ("edit", expected, "partial")
    assert isinstance(decision.payload["refund"]["amount_cents"], int)
    assert 'data-status="edited"' in response.content.decode()
    run = drive(Run.objects.get(pk=card.run_id))
    assert run.status == Run.Status.SUCCEEDED
    assert SandboxCall.objects.get(system="payments").payload["amount_cents"] == 4321


REFUSED_EDITS = {
    "amount not a number": ({"p:refund.amount_cents": "12.5x"}, "p:refund.amount_cents"),
    "amount not whole": ({"p:refund.amount_cents": "12.5"}, "p:refund.amount_cents"),
    "amount zero": ({"p:refund.amount_cents": "0"}, "p:refund.amount_cents"),
    "amount missing": ({"p:refund.amount_cents": ""}, "p:refund.amount_cents"),
    "subject blanked": ({"p:email.subject": ""}, "p:email.subject"),
    "currency not a code": ({"p:refund.currency": "euros"}, "p:refund.currency"),
}


@pytest.mark.parametrize(("changes", "field"), REFUSED_EDITS.values(), ids=REFUSED_EDITS.keys())
@pytest.mark.parametrize("preview", ["1", ""], ids=["preview", "confirm"])
def test_an_invalid_edit_shows_field_errors_and_changes_nothing(client, card, bob, changes, field, preview):
    client.force_login(bob)
    before = snapshot(card)

    response = post(client, card, decision="edit", preview=preview, **edit_fields(card, **changes))

    assert response.status_code == 422
    html = response.content.decode()
    assert 'class="card-field card-field-invalid"' in html
    assert f'name="{field}"' in html
    assert "card-preview" not in html
    assert snapshot(card) == before


def test_a_tampered_confirmation_cannot_change_fields_that_are_not_editable(client, card, bob):
    client.force_login(bob)
    response = post(client, card, decision="edit", **edit_fields(card), **{"p:refund.customer_id": "cus_evil"})
    assert response.status_code == 200
    assert Decision.objects.get().payload["refund"]["customer_id"] == REFUND["customer_id"]


def _generic_card(agent, proposed, current=None, kind="action") -> Approval:
    """A card of a gate that declares nothing (tests.workflows' test_reject_fails): any values, same shape."""
    card = park(agent)
    Run.objects.filter(pk=card.run_id).update(workflow="test_reject_fails")
    # Its gate is that workflow's first step (a card whose step cannot be found refuses every edit).
    Approval.objects.filter(pk=card.pk).update(proposed=proposed, current=current, kind=kind, step_seq=0)
    card.refresh_from_db()
    return card


def test_a_payload_with_lists_is_edited_as_json_with_type_checks(client, agent, bob_reviews_payments):
    card = _generic_card(agent, {"ids": [1, 2], "note": "x", "count": 3})
    client.force_login(bob_reviews_payments)
    assert 'name="payload_json"' in client.get(f"/approvals/{card.pk}/").content.decode()
    before = snapshot(card)

    for bad, message in [
        ("{nope", "Not valid JSON"),
        ('{"ids": [1], "note": "x"}', "count is required"),
        ('{"ids": [1], "note": "x", "count": "3"}', "count must be a whole number"),
        ("[1]", "must be an object"),
    ]:
        response = post(client, card, decision="edit", payload_json=bad)
        assert response.status_code == 422, bad
        assert message in response.content.decode()
    assert snapshot(card) == before

    response = post(client, card, decision="edit", payload_json='{"ids": [3], "note": "y", "count": 4}')
    assert response.status_code == 200
    assert Decision.objects.get().payload == {"ids": [3], "note": "y", "count": 4}


def test_a_budget_card_renders_and_edits_its_limit(client, agent, bob_reviews_payments):
    card = _generic_card(agent, {"cost_limit": "2.00"}, {"cost": "1.01", "cost_limit": "1.00"}, kind="budget")
    client.force_login(bob_reviews_payments)
    html = client.get(f"/approvals/{card.pk}/").content.decode()
    assert "Cost limit reached" in html and "Extend the limit" in html and "Stop the run" in html
    assert 'data-path="cost" data-op="removed"' in html
    assert 'name="p:cost_limit"' in html


def test_a_reconcile_card_is_approved_or_rejected_not_edited(client, agent, bob_reviews_payments):
    card = _generic_card(agent, {"receipt": "r:1", "receipt_created_at": "2026-01-01T00:00:00"}, kind="reconcile")
    client.force_login(bob_reviews_payments)
    html = client.get(f"/approvals/{card.pk}/").content.decode()
    assert "Did this write happen?" in html and "It happened" in html and "It did not happen" in html
    assert "card-edit-form" not in html
    before = snapshot(card)
    response = post(client, card, decision="edit", payload_json="{}")
    assert response.status_code == 422
    assert "A reconcile card is approved (it happened) or rejected, not edited." in response.content.decode()
    assert snapshot(card) == before


# --- the SLA timer -------------------------------------------------------------------------------------------


def test_the_sla_state_is_computed_on_the_server(card):
    card.channel.sla = timedelta(hours=1)
    now = timezone.now()
    card.due_at = now + timedelta(minutes=30)
    assert sla(card, now)["state"] == "on_time"
    card.due_at = now + timedelta(minutes=14)  # < 25% of an hour
    assert sla(card, now)["state"] == "due_soon"
    card.due_at = now - timedelta(seconds=1)
    assert sla(card, now)["state"] == "breached"
    assert sla(card, now)["remaining"].startswith("overdue by")
    card.channel.sla = timedelta(minutes=8)
    card.due_at = now + timedelta(minutes=4)  # < 5 min, though more than 25% of 8 min
    assert sla(card, now)["state"] == "due_soon"


def test_a_breached_card_renders_red(client, card, bob):
    Approval.objects.filter(pk=card.pk).update(due_at=timezone.now() - timedelta(minutes=1))
    client.force_login(bob)
    html = client.get(f"/approvals/{card.pk}/").content.decode()
    assert 'class="card-sla card-sla-breached"' in html
    assert "SLA breached" in html


# --- escaping ------------------------------------------------------------------------------------------------


def test_agent_text_is_escaped_everywhere(client, agent, bob_reviews_payments):
    card = park(agent)
    proposed = copy.deepcopy(card.proposed)
    proposed["email"]["body"] = f"Hello\n{XSS_SCRIPT}\n{XSS_IMG}"
    proposed["email"]["subject"] = XSS_IMG
    Approval.objects.filter(pk=card.pk).update(
        summary=f"{XSS_SCRIPT} {XSS_IMG}",
        rule_id=XSS_IMG,
        proposed=proposed,
        citations=[
            {"title": XSS_SCRIPT, "url": "javascript:alert(1)"},
            {"title": XSS_IMG, "url": f"https://example.com/{XSS_IMG}"},
            XSS_SCRIPT,
        ],
    )
    client.force_login(bob_reviews_payments)

    html = client.get(f"/approvals/{card.pk}/").content.decode()

    assert "<script>alert(1)</script>" not in html
    assert "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in html
    assert 'href="javascript:' not in html
    # the https citation is a link, its URL escaped inside the attribute
    assert 'href="https://example.com/&quot;&gt;&lt;img src=x onerror=alert(1)&gt;"' in html


def test_the_preview_of_an_edit_escapes_too(client, card, bob):
    client.force_login(bob)
    response = post(client, card, decision="edit", preview="1", **edit_fields(card, **{"p:email.subject": XSS_IMG}))
    html = response.content.decode()
    assert response.status_code == 200
    assert "<img src=x" not in html
    assert json.dumps(XSS_IMG) not in html


# --- the two-person rule -------------------------------------------------------------------------------------


def test_two_person_rule_a_first_approval_leaves_the_card_open_for_someone_else(client, card, bob, alice):
    Channel.objects.filter(name="payments").update(required_approvals=2)
    client.force_login(bob)

    response = post(client, card, decision="approve")

    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-status="pending"' in html
    assert "1 of 2 approvals" in html
    assert "You approved" in html
    assert "card-button-approve" not in html and "card-reject-form" in html
    assert Run.objects.get(pk=card.run_id).status == Run.Status.WAITING_HUMAN

    card.refresh_from_db()
    again = post(client, card, decision="approve")  # the same person, by a stale form or a second tab
    assert again.status_code == 409
    assert "different person" in again.content.decode()
    assert Decision.objects.filter(approval=card).count() == 1

    client.force_login(alice)
    response = post(client, card, decision="approve")
    assert response.status_code == 200
    assert 'data-status="approved"' in response.content.decode()
    assert Run.objects.get(pk=card.run_id).status == Run.Status.QUEUED


def test_two_person_rule_an_edit_restarts_the_count_on_the_page_as_in_the_decision(client, card, bob, alice):
    """Bob approved the proposal, then Alice edited it: what runs now is her edit, which Bob has not approved. The
    page counts as Approval.decide does (approvals.rules.counted): 1 of 2, and Bob may approve the edit."""
    Channel.objects.filter(name="payments").update(required_approvals=2)
    card.decide(bob, "approve", version=card.version)
    card.refresh_from_db()
    edited = copy.deepcopy(card.proposed)
    edited["refund"]["amount_cents"] = 4321
    card.decide(alice, "edit", payload=edited, version=card.version)
    client.force_login(bob)

    html = client.get(f"/approvals/{card.pk}/").content.decode()

    assert "1 of 2 approvals" in html
    assert "You approved" not in html and "card-button-approve" in html
    card.refresh_from_db()
    response = post(client, card, decision="approve")
    assert 'data-status="edited"' in response.content.decode()
    assert Run.objects.get(pk=card.run_id).status == Run.Status.QUEUED


# --- the partial other pages include -------------------------------------------------------------------------


def test_other_pages_can_include_the_card_partial(rf, card, bob):
    request = rf.get("/")
    request.user = bob
    html = render_to_string("approvals/card.html#card", {"card": prepare(card, bob)}, request=request)

    assert html.lstrip().startswith("<section")
    assert f'id="card-{card.pk}"' in html
    assert 'data-path="refund.amount_cents"' in html
    assert f'id="card{card.pk}-p:refund.amount_cents"' in html  # form ids unique per card on a shared page
    assert "csrfmiddlewaretoken" in html


def test_a_preview_that_changes_nothing_offers_no_confirmation(client, card, bob):
    client.force_login(bob)
    response = post(client, card, decision="edit", preview="1", **edit_fields(card))
    assert response.status_code == 200
    html = response.content.decode()
    assert "Your edit changes nothing" in html
    assert "card-button-confirm" not in html
