"""Two-person rule: an edit leaves the card open until someone else approves it, and what runs then is the edit.
So every view shows that pending edit, not the agent's proposal: the card page, the inbox row, GET /api/approvals
and the decision's answer show what runs (the edited payload), its diff against the proposal and against the
current state, and who edited it and when; the version they hand out is the one after the edit (a decision
naming the version before it is refused); and a bulk approval skips the card (it must be opened to be approved).
"""

from __future__ import annotations

import copy

import pytest

from approvals.models import Approval, Decision
from core.models import AuditEntry, Channel
from demo.models import SandboxCall
from runs.models import Run
from tests.engine_helpers import REFUND
from tests.integration.approvals.test_api_approvals import bearer, decide, snapshot, start_parked_run, work_the_runs_job

EDITED_CENTS = 12_345  # the agent proposes 12 500; the refund gate allows lowering it (never raising it)


@pytest.fixture
def demo(demo, rita):
    """The demo's users and Rita; payments needs two people."""
    Channel.objects.filter(name="payments").update(required_approvals=2)
    return {**demo, "rita": rita}


def edit_amount(card: Approval, cents: int = EDITED_CENTS) -> dict:
    payload = copy.deepcopy(card.proposed)
    payload["refund"]["amount_cents"] = cents
    return payload


@pytest.fixture
def edited(client, demo) -> tuple[Run, Approval]:
    """A refund the agent started, edited down by rita (the first of two people): the card stays open."""
    run, card = start_parked_run(client, demo["agent"])
    response = decide(client, demo["rita"], card, decision="edit", comment="partial refund", payload=edit_amount(card))
    assert response.status_code == 200, response.content
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING
    return run, card


def listed(client, user, card: Approval) -> dict:
    response = client.get("/api/approvals", headers=bearer(user))
    assert response.status_code == 200
    return next(c for c in response.json() if c["id"] == card.pk)


# --- the one place that says what runs ----------------------------------------------------------------------------


def test_it_runs_the_pending_edit_and_the_card_says_so(edited, demo):
    _, card = edited
    assert card.version == 2  # the edit is a change of the card
    assert card.to_execute == edit_amount(card)
    assert card.last_edit.actor == demo["rita"] and card.last_edit.comment == "partial refund"
    # The inbox's display columns follow what runs, written with the edit.
    assert (card.headline, card.amount_minor, card.currency) == (REFUND["reason"], EDITED_CENTS, "EUR")


def test_a_card_nobody_edited_runs_its_proposal(client, demo):
    _, card = start_parked_run(client, demo["agent"])
    assert card.last_edit is None
    assert card.to_execute == card.proposed
    assert card.amount_minor == REFUND["amount_cents"]


# --- GET /api/approvals -------------------------------------------------------------------------------------------


def test_the_api_shows_the_second_person_what_runs_its_diffs_and_who_edited(client, demo, edited):
    _, card = edited

    shown = listed(client, demo["reviewer"], card)

    assert shown["version"] == 2
    assert shown["to_execute"]["refund"]["amount_cents"] == EDITED_CENTS
    assert shown["proposed"]["refund"]["amount_cents"] == REFUND["amount_cents"]  # the agent's, for the record
    edit = shown["edit"]
    assert edit["by"] == "rita" and edit["comment"] == "partial refund" and edit["at"]
    assert edit["payload"] == shown["to_execute"]
    assert edit["against_proposed"] == [
        {"path": "refund.amount_cents", "op": "changed", "old": REFUND["amount_cents"], "new": EDITED_CENTS}
    ]
    against_current = {d["path"]: d for d in edit["against_current"]}
    assert against_current["refund.amount_cents"]["new"] == EDITED_CENTS
    assert all(d["op"] != "same" for d in edit["against_current"])
    assert (shown["amount_minor"], shown["currency"]) == (EDITED_CENTS, "EUR")


def test_a_card_nobody_edited_has_no_edit_in_the_api(client, demo):
    _, card = start_parked_run(client, demo["agent"])
    shown = listed(client, demo["reviewer"], card)
    assert shown["edit"] is None
    assert shown["to_execute"] == shown["proposed"]
    assert shown["amount_minor"] == REFUND["amount_cents"]


def test_the_second_persons_approval_pays_the_edited_amount_they_were_shown(client, demo, edited):
    run, card = edited
    shown = listed(client, demo["reviewer"], card)

    response = decide(client, demo["reviewer"], card, decision="approve", version=shown["version"])

    assert response.status_code == 200, response.content
    assert response.json()["status"] == "edited"
    assert response.json()["to_execute"]["refund"]["amount_cents"] == EDITED_CENTS
    entry = AuditEntry.objects.get(action="approval.approve")
    assert entry.data["payload"]["refund"]["amount_cents"] == EDITED_CENTS  # the audit says what they approved
    run = work_the_runs_job(run)
    assert run.status == Run.Status.SUCCEEDED
    payment = SandboxCall.objects.get(system="payments", applied=True)
    assert payment.payload["amount_cents"] == EDITED_CENTS
    assert run.steps.get(name="approve_refund").output["payload"]["refund"]["amount_cents"] == EDITED_CENTS


def test_an_approval_with_the_version_from_before_the_edit_is_refused_and_changes_nothing(client, demo, edited):
    run, card = edited
    before = snapshot(card)

    response = decide(client, demo["reviewer"], card, decision="approve", version=1)

    assert response.status_code == 409
    assert response.json()["error"] == "conflict" and "version" in response.json()["detail"]
    assert snapshot(card) == before
    assert Decision.objects.filter(approval=card).count() == 1
    assert not SandboxCall.objects.filter(system="payments").exists()


# --- the card page --------------------------------------------------------------------------------------------------


def test_the_card_page_shows_the_pending_edit_its_diffs_and_who_made_it(client, demo, edited):
    _, card = edited
    client.force_login(demo["reviewer"])

    html = client.get(f"/approvals/{card.pk}/").content.decode()

    assert '<dd class="card-amount">123.45 EUR</dd>' in html
    pending = html.split('class="card-pending-edit"', 1)[1].split("</section>", 1)[0]
    assert 'data-edited-by="rita"' in pending
    assert "rita" in pending and "partial refund" in pending
    vs_proposed = pending.split("card-edit-vs-proposed", 1)[1].split("</table>", 1)[0]
    assert 'data-path="refund.amount_cents"' in vs_proposed and "12500" in vs_proposed and "12345" in vs_proposed
    vs_current = pending.split("card-edit-vs-current", 1)[1].split("</table>", 1)[0]
    assert 'data-path="refund.amount_cents"' in vs_current and "12345" in vs_current
    assert f'data-version="{card.version}"' in html and 'name="version" value="2"' in html
    # The edit form starts from what runs, not from the proposal.
    assert 'name="p:refund.amount_cents" value="12345"' in html


def test_the_card_page_refuses_an_approval_from_before_the_edit_and_shows_the_edit(client, demo, edited):
    run, card = edited
    before = snapshot(card)
    client.force_login(demo["reviewer"])

    response = client.post(
        f"/approvals/{card.pk}/decide", {"decision": "approve", "version": 1}, headers={"HX-Request": "true"}
    )

    assert response.status_code == 409
    html = response.content.decode()
    assert "card-conflict" in html and 'class="card-pending-edit"' in html and 'name="version" value="2"' in html
    assert snapshot(card) == before


def test_the_card_page_approval_pays_the_edit(client, demo, edited):
    run, card = edited
    client.force_login(demo["reviewer"])

    response = client.post(f"/approvals/{card.pk}/decide", {"decision": "approve", "version": card.version})

    assert response.status_code == 302
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.EDITED
    work_the_runs_job(run)
    assert SandboxCall.objects.get(system="payments", applied=True).payload["amount_cents"] == EDITED_CENTS


# --- the inbox ------------------------------------------------------------------------------------------------------


def test_the_inbox_row_shows_the_edited_amount_and_who_edited(client, demo, edited):
    _, card = edited
    client.force_login(demo["reviewer"])

    html = client.get("/").content.decode()

    row = html.split(f'id="row-{card.pk}"', 1)[1].split("</tr>", 1)[0]
    assert '<td class="amount">123.45 EUR</td>' in row  # (the agent's summary, its rationale, says 125.00)
    assert 'data-pending-edit="rita"' in row and 'data-version="2"' in row
    assert "edited by rita" in row


def test_a_bulk_approval_skips_a_card_with_a_pending_edit_and_says_so(client, demo, edited):
    run, card = edited
    _, other = start_parked_run(client, demo["agent"], {**REFUND, "customer_id": "cus_2001"})
    # A card whose row shows everything that runs (its amount and currency), so that a bulk approval may take it:
    # a refund card's email is not in its row (approvals.inbox.row_shows).
    proposal = {"refund": {"amount_cents": other.amount_minor, "currency": other.currency}}
    Approval.objects.filter(pk=other.pk).update(proposed=proposal, current=None)
    before = snapshot(card)
    client.force_login(demo["reviewer"])

    response = client.post(
        "/approvals/bulk",
        {"cards": [f"{card.pk}:{card.version}", f"{other.pk}:{other.version}"], "decision": "approve"},
        headers={"HX-Request": "true"},
    )

    assert response.status_code == 200
    html = response.content.decode()
    assert "1 card has a pending edit: open it to approve it" in html
    assert f'data-card="{card.pk}" data-status="409"' in html
    assert snapshot(card) == before  # not decided: still rita's edit alone
    assert Decision.objects.filter(approval=other, actor=demo["reviewer"], decision="approve").count() == 1


def test_a_bulk_rejection_still_takes_a_card_with_a_pending_edit(client, demo, edited):
    """Rejecting runs nothing: the edit need not be read first."""
    run, card = edited
    client.force_login(demo["reviewer"])
    response = client.post(
        "/approvals/bulk",
        {"cards": [f"{card.pk}:{card.version}"], "decision": "reject", "comment": "no", "reason": "policy"},
        headers={"HX-Request": "true"},
    )
    assert response.status_code == 200
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.REJECTED


def test_without_javascript_a_bulk_approval_says_on_the_inbox_which_cards_it_skipped(client, demo, edited):
    _, card = edited
    client.force_login(demo["reviewer"])
    response = client.post("/approvals/bulk", {"cards": [f"{card.pk}:{card.version}"], "decision": "approve"})
    assert response.status_code == 302 and response["Location"] == "/"
    assert "1 card has a pending edit: open it to approve it" in client.get("/").content.decode()
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.PENDING
