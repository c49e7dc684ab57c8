"""The doors of replay (runs.replay): POST /api/runs/{id}/replay and the run page's "Replay on current code", for
ops and admins; refused with nothing done to anyone else and for a run that cannot be replayed."""

from __future__ import annotations

import pytest
from django.test import Client

from approvals.models import Approval
from demo.models import SandboxCall
from runs import submission
from runs.models import Run, Step
from tests.engine_helpers import REFUND, drive
from tests.integration.runs.test_undo_api import bearer


@pytest.fixture
def refunded(demo) -> Run:
    run = drive(submission.submit(workflow="refund", input=REFUND, created_by=demo["agent"])[0])
    Approval.objects.get(run=run, status=Approval.Status.PENDING).decide(demo["reviewer"], "approve")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    return run


def test_ops_replay_a_run_over_the_api(demo, refunded):
    calls = SandboxCall.objects.count()
    response = Client().post(f"/api/runs/{refunded.pk}/replay", headers=bearer(demo["ops"]))
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["identical"] and body["calls"] == 0 and body["divergence"] is None
    assert [s["name"] for s in body["steps"]] == list(
        Step.objects.filter(run=refunded).order_by("seq").values_list("name", flat=True)
    )
    assert body["summary"] == "replays identically (6 steps)"
    assert SandboxCall.objects.count() == calls


def test_the_api_refuses_others_and_a_running_run(demo, refunded):
    client = Client()
    # The reviewer sees the run (a card of theirs), the agent started it: neither may replay it.
    for who in ("reviewer", "agent"):
        response = client.post(f"/api/runs/{refunded.pk}/replay", headers=bearer(demo[who]))
        assert response.status_code == 403, (who, response.content)
    assert client.post(f"/api/runs/{refunded.pk}/replay", headers=bearer(demo["outsider"])).status_code == 404
    queued = submission.submit(workflow="refund", input=REFUND)[0]
    response = client.post(f"/api/runs/{queued.pk}/replay", headers=bearer(demo["ops"]))
    assert response.status_code == 409
    assert "the run is queued" in response.json()["detail"]


def test_the_run_page_offers_ops_a_replay_and_shows_its_report(demo, refunded):
    ops = Client()
    ops.force_login(demo["ops"])
    assert b'data-testid="replay"' in ops.get(f"/runs/{refunded.pk}/").content
    page = ops.post(f"/runs/{refunded.pk}/replay")
    assert page.status_code == 200
    text = page.content.decode()
    assert "refund v1: replays identically (6 steps)" in text and 'data-testid="replay-report"' in text

    reviewer = Client()
    reviewer.force_login(demo["reviewer"])
    assert b'data-testid="replay"' not in reviewer.get(f"/runs/{refunded.pk}/").content
    assert reviewer.post(f"/runs/{refunded.pk}/replay").status_code == 403


def test_the_page_shows_a_divergence_side_by_side(demo, refunded):
    Step.objects.filter(run=refunded, name="classify").update(output={"category": "other", "risk": "low"})
    ops = Client()
    ops.force_login(demo["ops"])
    text = ops.post(f"/runs/{refunded.pk}/replay").content.decode()
    assert 'data-testid="replay-divergence"' in text
    assert "diverges at step 0 (classify): returns another output" in text
    assert "Recorded" in text and "On current code" in text and "&quot;other&quot;" in text
