"""Reject and undo (issue 27) on a card and through POST /api/approvals/{id}/decision, and the undo cards' doors:
their labels, no edit, the card page, the inbox's bulk decisions. Approval.decide(undo=True) and the engine's undo
are the core's (runs.compensations); these are the doors to them."""

from __future__ import annotations

import json

import pytest
from django.test import Client

import tests.undo_workflows  # noqa: F401 - registers the test workflows
from approvals import inbox, labels
from approvals.models import Approval, Decision
from core.models import ApiToken, AuditEntry
from runs import compensations, submission
from runs.gates import Kind
from runs.models import Run
from tests.engine_helpers import drive
from tests.undo_workflows import CALLS


def bearer(user) -> dict:
    _, raw = ApiToken.issue(user)
    return {"Authorization": f"Bearer {raw}"}


def parked(workflow: str = "test_undo_charge_then_ask") -> tuple[Run, Approval]:
    run = drive(submission.submit(workflow=workflow, input={})[0])
    assert run.status == Run.Status.WAITING_HUMAN, run.error
    return run, Approval.objects.get(run=run, status=Approval.Status.PENDING)


def decide(client, card: Approval, user, **body):
    body = {"comment": "", "version": card.version, **body}
    return client.post(
        f"/api/approvals/{card.pk}/decision", data=json.dumps(body), content_type="application/json", headers=user
    )


@pytest.fixture
def reviewer(demo):
    return bearer(demo["reviewer"])


def page_of(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


# The API


def test_reject_and_undo_through_the_api_undoes_the_run(client, demo, reviewer):
    run, card = parked()
    refunds = len(CALLS["refund"])

    response = decide(client, card, reviewer, decision="reject", comment="wrong customer", undo=True)

    assert response.status_code == 200, response.content
    assert response.json()["status"] == "rejected"
    decision = Decision.objects.get(approval=card)
    assert decision.undo is True and decision.decision == "reject"
    assert AuditEntry.objects.filter(approval_id=card.pk, data__undo=True).exists()
    run = drive(Run.objects.get(pk=run.pk))
    assert (run.status, run.undo_reason) == (Run.Status.COMPENSATED, "rejected")
    assert len(CALLS["refund"]) == refunds + 1
    [effect] = client.get(f"/api/runs/{run.pk}", headers=bearer(demo["ops"])).json()["effects"]
    assert effect["compensation"]["outcome"] == "done"


def test_undo_with_an_approval_is_refused(client, demo, reviewer):
    run, card = parked()

    response = decide(client, card, reviewer, decision="approve", undo=True)

    assert response.status_code == 422
    assert "only a rejection" in response.json()["detail"]
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING and not Decision.objects.filter(approval=card).exists()


@pytest.mark.parametrize("undo", [1, "true"])
def test_an_undo_that_is_not_a_boolean_is_422_and_nothing_is_decided(client, demo, reviewer, undo):
    # Taken for a reject and undo before (pydantic's lax booleans; found by the API fuzzer on the cancel, 2026-12-06).
    run, card = parked()
    response = decide(client, card, reviewer, decision="reject", comment="no", undo=undo)
    assert response.status_code == 422, response.content
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING and not Decision.objects.filter(approval=card).exists()


def test_reject_and_undo_with_nothing_to_undo_is_409_and_the_card_stays_pending(client, demo, reviewer):
    run, card = parked("test_undo_nothing_yet")
    before = AuditEntry.objects.count()

    response = decide(client, card, reviewer, decision="reject", comment="no", undo=True)

    assert response.status_code == 409
    assert response.json()["error"] == "conflict" and "nothing to undo" in response.json()["detail"]
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING and not Decision.objects.filter(approval=card).exists()
    assert Run.objects.get(pk=run.pk).status == Run.Status.WAITING_HUMAN
    assert AuditEntry.objects.count() == before

    # A plain rejection still works.
    assert decide(client, card, reviewer, decision="reject", comment="no").status_code == 200


def test_a_plain_rejection_undoes_nothing(client, demo, reviewer):
    run, card = parked()
    assert decide(client, card, reviewer, decision="reject", comment="no").status_code == 200
    assert Decision.objects.get(approval=card).undo is False
    run = drive(Run.objects.get(pk=run.pk))
    assert run.status == Run.Status.SUCCEEDED and not run.undo_reason


# The card page


def test_the_card_offers_reject_and_undo_when_the_run_has_something_to_undo(demo):
    _, card = parked()
    html = page_of(demo["reviewer"]).get(f"/approvals/{card.pk}/").content.decode()
    assert 'data-testid="reject-and-undo"' in html and "Reject and undo" in html

    _, nothing = parked("test_undo_nothing_yet")
    html = page_of(demo["reviewer"]).get(f"/approvals/{nothing.pk}/").content.decode()
    assert 'data-testid="reject-and-undo"' not in html


def test_reject_and_undo_from_the_card_page(demo):
    run, card = parked()
    client = page_of(demo["reviewer"])

    response = client.post(
        f"/approvals/{card.pk}/decide",
        {"decision": "reject", "version": card.version, "reason": "policy", "comment": "not ours", "undo": "1"},
    )

    assert response.status_code == 302, response.content
    decision = Decision.objects.get(approval=card)
    assert decision.undo is True and decision.reason == "policy"
    run = drive(Run.objects.get(pk=run.pk))
    assert (run.status, run.undo_reason) == (Run.Status.COMPENSATED, "rejected")
    html = client.get(f"/approvals/{card.pk}/").content.decode()
    assert "reject and undo" in html


def test_reject_and_undo_refused_on_the_card_page_leaves_it_pending(demo):
    run, card = parked("test_undo_nothing_yet")
    response = page_of(demo["reviewer"]).post(
        f"/approvals/{card.pk}/decide",
        {"decision": "reject", "version": card.version, "reason": "policy", "comment": "not ours", "undo": "1"},
    )
    assert response.status_code == 409
    assert "nothing to undo" in response.content.decode()
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING and not Decision.objects.filter(approval=card).exists()


# Undo cards: a gated compensation, and one that failed for good


def undo_card(client, demo, workflow: str, kind: str) -> tuple[Run, Approval]:
    run, _ = parked(workflow)
    compensations.cancel_and_undo(run, demo["ops"])
    run = drive(Run.objects.get(pk=run.pk))
    card = Approval.objects.get(run=run, status=Approval.Status.PENDING)
    assert card.kind == kind
    return run, card


def test_a_gated_compensations_card_says_undo_it_and_is_never_edited(client, demo, reviewer):
    run, card = undo_card(client, demo, "test_undo_gated", Kind.UNDO)
    assert run.status == Run.Status.WAITING_HUMAN and run.undo_reason == "cancelled"
    assert labels.for_card(card) == {"approve": "Undo it", "edit": "", "reject": "Leave it done"}

    html = page_of(demo["reviewer"]).get(f"/approvals/{card.pk}/").content.decode()
    assert "Undo it" in html and "Leave it done" in html
    assert "card-button-edit" not in html and 'data-testid="reject-and-undo"' not in html

    response = decide(client, card, reviewer, decision="edit", payload=card.proposed)
    assert response.status_code == 422 and "not edited" in response.content.decode()
    response = decide(client, card, reviewer, decision="reject", comment="no", undo=True)
    assert response.status_code == 409  # an undo card is not rejected "and undone"
    response = page_of(demo["reviewer"]).post(
        f"/approvals/{card.pk}/decide", {"decision": "edit", "version": card.version, "preview": "1"}
    )
    assert response.status_code == 422 and "not edited" in response.content.decode()
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.PENDING

    refunds = len(CALLS["refund"])
    assert decide(client, card, reviewer, decision="approve").status_code == 200
    assert drive(Run.objects.get(pk=run.pk)).status == Run.Status.COMPENSATED
    assert len(CALLS["refund"]) == refunds + 1


def test_a_failed_undo_card_says_try_again_or_done_by_hand_and_is_not_bulk_rejected(client, demo, reviewer):
    run, card = undo_card(client, demo, "test_undo_fails", Kind.UNDO_FAILED)
    assert run.status == Run.Status.COMPENSATION_FAILED
    assert labels.for_card(card) == {"approve": "Try again", "edit": "", "reject": "Done by hand"}
    html = page_of(demo["reviewer"]).get(f"/approvals/{card.pk}/").content.decode()
    assert "Try again" in html and "Done by hand" in html and "card-button-edit" not in html
    html = page_of(demo["ops"]).get(f"/runs/{run.pk}/").content.decode()
    assert "status-compensation_failed" in html and "undo failed" in html

    [result] = inbox.decide_cards(demo["reviewer"], {card.pk: card.version}, "reject", "did it", "other")
    assert result.status == 409 and "open it" in result.detail
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.PENDING

    # In the inbox with the others: its row renders.
    assert page_of(demo["reviewer"]).get("/").status_code == 200


def test_an_undo_card_in_a_bulk_approval_is_sent_to_its_card_when_its_row_cannot_show_it(client, demo):
    # Its proposal names the effect and what the external system answered: more than an inbox row shows, and
    # what a person approves is what they were shown (inbox.row_shows_card), as for any card.
    run, card = undo_card(client, demo, "test_undo_gated", Kind.UNDO)
    [result] = inbox.decide_cards(demo["reviewer"], {card.pk: card.version}, "approve", "", "")
    assert (result.status, result.not_shown) == (409, True)
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.PENDING
    [result] = inbox.decide_cards(demo["reviewer"], {card.pk: card.version}, "reject", "leave it", "other")
    assert result.status == 200, result.detail  # "leave it done" needs no more than the row
    assert drive(Run.objects.get(pk=run.pk)).status == Run.Status.COMPENSATED
