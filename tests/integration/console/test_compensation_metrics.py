"""Undo on the dashboard and in /metrics: the compensation rate per workflow (runs undone over the runs that ended)
and the compensations by outcome, read from the database on each request."""

from __future__ import annotations

import tests.undo_workflows  # noqa: F401 - registers the test workflows
from approvals.models import Approval
from runs import compensations, submission
from runs.models import Run
from tests.engine_helpers import drive
from tests.integration.console.test_metrics import scrape

WORKFLOW = "test_undo_charge_then_ask"


def parked(workflow: str = WORKFLOW) -> Run:
    run = drive(submission.submit(workflow=workflow, input={})[0])
    assert run.status == Run.Status.WAITING_HUMAN, run.error
    return run


def undone(demo, workflow: str = WORKFLOW) -> Run:
    run = parked(workflow)
    compensations.cancel_and_undo(run, demo["ops"])
    return drive(Run.objects.get(pk=run.pk))


def succeeded(demo) -> Run:
    run = parked()
    card = Approval.objects.get(run=run)
    card.decide(demo["reviewer"], "approve", version=card.version)
    run = drive(Run.objects.get(pk=run.pk))
    assert run.status == Run.Status.SUCCEEDED
    return run


def test_nothing_undone_nothing_counted(client, demo):
    succeeded(demo)
    m = scrape(client)
    assert not m.families["hitl_compensations"].samples
    assert not m.families["hitl_runs_undone"].samples
    assert not m.families["hitl_compensation_ratio"].samples


def test_the_compensation_rate_and_the_compensations_done_per_workflow(client, demo):
    assert undone(demo).status == Run.Status.COMPENSATED
    succeeded(demo)
    parked()  # still waiting: it has not ended, it does not count
    failed = undone(demo, "test_undo_fails")
    assert failed.status == Run.Status.COMPENSATION_FAILED

    m = scrape(client)

    assert m("hitl_compensations_total", workflow=WORKFLOW, outcome="done") == 1
    assert m("hitl_compensations_total", workflow=WORKFLOW, outcome="failed") == 0
    assert m("hitl_runs_undone_total", workflow=WORKFLOW) == 1
    assert m("hitl_compensation_ratio", workflow=WORKFLOW) == 0.5
    assert m("hitl_compensations_total", workflow="test_undo_fails", outcome="failed") == 1
    assert m("hitl_compensations_total", workflow="test_undo_fails", outcome="done") == 0
    assert m("hitl_runs_undone_total", workflow="test_undo_fails") == 1
    assert m("hitl_compensation_ratio", workflow="test_undo_fails") == 1.0


def test_the_dashboard_shows_the_compensation_rate(client, demo):
    undone(demo)
    succeeded(demo)
    client.force_login(demo["ops"])

    html = client.get("/dashboard/").content.decode()

    assert 'id="compensations"' in html
    row = html.split(f'data-compensations="{WORKFLOW}"', 1)[1].split("</tr>", 1)[0]
    assert "<td>2</td>" in row  # runs ended
    assert '<td class="dash-undone">1</td>' in row
    assert '<td class="dash-rate">50.0%</td>' in row
    assert '<td class="dash-compensations-done">1</td>' in row


def test_the_dashboard_says_when_nothing_was_undone(client, demo):
    client.force_login(demo["ops"])
    assert "No run has been undone." in client.get("/dashboard/").content.decode()
