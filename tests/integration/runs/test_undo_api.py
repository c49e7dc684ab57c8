"""Cancel and undo (issue 27): POST /api/runs/{id}/cancel {"undo": true}, the effects of GET /api/runs/{id}, and
the run page's "Cancel and undo" button and Effects table. The core (runs.compensations) decides; these are its
doors."""

from __future__ import annotations

import json

import pytest
from django.test import Client

import tests.undo_workflows  # noqa: F401 - registers the test workflows
from approvals.models import Approval
from core.models import ApiToken, AuditEntry
from runs import submission
from runs.models import Run
from tests.engine_helpers import drive, queued_jobs
from tests.undo_workflows import CALLS


def bearer(user) -> dict:
    _, raw = ApiToken.issue(user)
    return {"Authorization": f"Bearer {raw}"}


def parked(workflow: str = "test_undo_charge_then_ask", created_by=None) -> Run:
    """A run of `workflow` advanced (as its job would) to its gate: charged, waiting for a person."""
    run = drive(submission.submit(workflow=workflow, input={}, created_by=created_by)[0])
    assert run.status == Run.Status.WAITING_HUMAN, run.error
    return run


def cancel(client, run: Run, headers: dict, body=None):
    if body is None:
        return client.post(f"/api/runs/{run.pk}/cancel", headers=headers)
    return client.post(
        f"/api/runs/{run.pk}/cancel", data=json.dumps(body), content_type="application/json", headers=headers
    )


@pytest.fixture
def ops(demo):
    return bearer(demo["ops"])


def test_cancel_and_undo_of_a_parked_run_queues_its_undo_then_compensates_it(client, demo, ops):
    run = parked()
    charged = list(CALLS["charge"])
    refunds = len(CALLS["refund"])

    response = cancel(client, run, ops, {"undo": True})

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "queued" and body["undo_reason"] == "cancelled"
    assert body["approval_id"] is None
    [effect] = body["effects"]
    assert effect["step"] == "charge" and effect["channel"] == "payments"
    assert effect["external_id"] == f"ch_{run.pk.hex[:8]}"
    assert effect["can_undo"] is True and effect["compensation"] is None
    run.refresh_from_db()
    assert (run.status, run.undo_reason) == (Run.Status.QUEUED, "cancelled")
    assert Approval.objects.get(run=run).status == Approval.Status.CANCELLED
    assert queued_jobs(run) == 1
    entry = AuditEntry.objects.get(action="run.cancel", run_id=run.pk)
    assert entry.actor == "ops" and entry.data["undo"] is True

    # Its next job undoes it: the refund, once, and the run ends compensated.
    assert drive(run).status == Run.Status.COMPENSATED
    assert CALLS["charge"] == charged and len(CALLS["refund"]) == refunds + 1
    body = client.get(f"/api/runs/{run.pk}", headers=ops).json()
    assert body["status"] == "compensated" and body["undo_reason"] == "cancelled"
    [effect] = body["effects"]
    assert effect["can_undo"] is False
    assert effect["compensation"]["outcome"] == "done"
    assert effect["compensation"]["answer"] == {"id": f"re_ch_{run.pk.hex[:8]}", "refunded": f"ch_{run.pk.hex[:8]}"}
    assert effect["compensation"]["at"] is not None

    # Undone: another cancel and undo is refused, nothing done.
    response = cancel(client, run, ops, {"undo": True})
    assert response.status_code == 409
    assert Run.objects.get(pk=run.pk).status == Run.Status.COMPENSATED


def test_cancel_and_undo_with_nothing_to_undo_is_409_and_changes_nothing(client, demo, ops):
    run = parked("test_undo_nothing_yet")
    before = AuditEntry.objects.count()

    response = cancel(client, run, ops, {"undo": True})

    assert response.status_code == 409
    assert response.json()["error"] == "conflict"
    assert "nothing to undo" in response.json()["detail"]
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_HUMAN and not run.undo_reason and not run.cancel_requested
    assert Approval.objects.get(run=run).status == Approval.Status.PENDING
    assert AuditEntry.objects.count() == before


def test_cancel_and_undo_past_a_compensations_deadline_is_409(client, demo, ops):
    run = parked("test_undo_too_late")

    response = cancel(client, run, ops, {"undo": True})

    assert response.status_code == 409
    assert "deadline" in response.json()["detail"]
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_HUMAN and not run.undo_reason
    [effect] = client.get(f"/api/runs/{run.pk}", headers=ops).json()["effects"]
    assert effect["can_undo"] is False and "deadline" in effect["why_not"]


@pytest.mark.parametrize("body", [None, {}, {"undo": False}], ids=["no body", "empty", "undo false"])
def test_a_plain_cancel_is_as_before(client, demo, ops, body):
    run = parked()

    response = cancel(client, run, ops, body)

    assert response.status_code == 200, response.content
    assert response.json()["status"] == "cancelled" and response.json()["undo_reason"] == ""
    run.refresh_from_db()
    assert run.status == Run.Status.CANCELLED and not run.undo_reason
    assert AuditEntry.objects.get(action="run.cancel", run_id=run.pk).data.get("undo") is None


def test_a_run_being_undone_cannot_be_cancelled(client, demo, ops):
    run = parked()
    # As its job holds it while it undoes it.
    Run.objects.filter(pk=run.pk).update(status=Run.Status.COMPENSATING, owner="a-job", undo_reason="cancelled")

    for body in (None, {"undo": True}):
        response = cancel(client, run, ops, body)
        assert response.status_code == 409, body
        assert "undone" in response.json()["detail"]
    run.refresh_from_db()
    assert run.status == Run.Status.COMPENSATING


def test_cancel_and_undo_needs_the_right_to_cancel(client, demo):
    run = parked()
    reviewer = bearer(demo["reviewer"])  # sees the run (its card), may not cancel it
    assert cancel(client, run, reviewer, {"undo": True}).status_code == 403
    assert cancel(client, run, bearer(demo["outsider"]), {"undo": True}).status_code == 404
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_HUMAN and not run.undo_reason


@pytest.mark.parametrize(
    "body",
    [{"undo": "perhaps"}, ["undo"], {"undo": 0}, {"undo": "true"}, {"k": None, "undo": False}],
    # An integer, a string, an unknown field and `null` were taken as a plain cancel before (the API fuzzer's
    # findings, 2026-12-06): the document says an object whose `undo` is a boolean, and nothing else.
    ids=["not a boolean", "not an object", "an integer", "a string", "an unknown field"],
)
def test_a_bad_cancel_body_is_422(client, demo, ops, body):
    run = parked()
    response = cancel(client, run, ops, body)
    assert response.status_code == 422, response.content
    assert response.json()["error"] == "invalid"
    assert Run.objects.get(pk=run.pk).status == Run.Status.WAITING_HUMAN


def test_a_null_cancel_body_is_422(client, demo, ops):
    run = parked()
    response = client.post(f"/api/runs/{run.pk}/cancel", data="null", content_type="application/json", headers=ops)
    assert response.status_code == 422, response.content
    assert Run.objects.get(pk=run.pk).status == Run.Status.WAITING_HUMAN


def test_a_body_that_is_not_json_is_400(client, demo, ops):
    run = parked()
    response = client.post(f"/api/runs/{run.pk}/cancel", data="{undo", content_type="application/json", headers=ops)
    assert response.status_code == 400
    assert Run.objects.get(pk=run.pk).status == Run.Status.WAITING_HUMAN


def test_get_run_shows_no_effects_before_any(client, demo, ops):
    run = parked("test_undo_nothing_yet")
    body = client.get(f"/api/runs/{run.pk}", headers=ops).json()
    assert body["effects"] == [] and body["undo_reason"] == ""


# The run page


def page_of(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_run_page_shows_the_effects_and_cancel_and_undo(demo):
    run = parked()
    html = page_of(demo["ops"]).get(f"/runs/{run.pk}/").content.decode()
    assert 'data-testid="effects"' in html
    assert f'data-effect="{run.pk}:1:' in html or "data-effect=" in html
    assert f"ch_{run.pk.hex[:8]}" in html
    assert "can be undone" in html
    assert 'data-testid="cancel-and-undo"' in html


def test_the_run_page_undoes_a_run_and_then_shows_what_undid_it(demo):
    run = parked()
    client = page_of(demo["ops"])

    response = client.post(f"/runs/{run.pk}/cancel", {"undo": "1"}, follow=True)

    assert response.redirect_chain == [(f"/runs/{run.pk}/", 302)]
    html = response.content.decode()
    assert "being undone" in html
    run.refresh_from_db()
    assert (run.status, run.undo_reason) == (Run.Status.QUEUED, "cancelled")
    assert 'data-testid="cancel-and-undo"' not in html  # already being undone

    drive(run)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert "status-compensated" in html and "Compensated" in html
    assert "undone</span> by engine" in html
    assert "Cancel run" not in html


def test_the_run_page_refuses_an_undo_with_nothing_to_undo(demo):
    run = parked("test_undo_too_late")
    client = page_of(demo["ops"])
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'data-testid="cancel-and-undo"' not in html
    assert 'data-testid="undo-refusal"' in html and "deadline" in html

    response = client.post(f"/runs/{run.pk}/cancel", {"undo": "1"}, follow=True)  # posted all the same

    assert "Not cancelled, nothing undone" in response.content.decode()
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_HUMAN and not run.undo_reason
    assert not AuditEntry.objects.filter(action="run.cancel", run_id=run.pk).exists()


def test_no_undo_button_for_a_run_without_effects_nor_for_a_reviewer(demo):
    run = parked("test_undo_nothing_yet")
    html = page_of(demo["ops"]).get(f"/runs/{run.pk}/").content.decode()
    assert "Cancel run" in html and 'data-testid="cancel-and-undo"' not in html
    assert 'data-testid="effects"' not in html

    charged = parked()
    html = page_of(demo["reviewer"]).get(f"/runs/{charged.pk}/").content.decode()
    assert 'data-testid="effects"' in html and 'data-testid="cancel-and-undo"' not in html
    assert page_of(demo["reviewer"]).post(f"/runs/{charged.pk}/cancel", {"undo": "1"}).status_code == 403


def test_the_page_says_a_compensating_run_cannot_be_cancelled(demo):
    run = parked()
    Run.objects.filter(pk=run.pk).update(status=Run.Status.COMPENSATING, owner="a-job", undo_reason="cancelled")
    client = page_of(demo["ops"])
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert "status-compensating" in html and "Cancel run" not in html
    response = client.post(f"/runs/{run.pk}/cancel", follow=True)
    assert "Not cancelled" in response.content.decode()
    assert Run.objects.get(pk=run.pk).status == Run.Status.COMPENSATING
