"""/dashboard/: ops and admins see the figures with the seed's alert thresholds as states; htmx refreshes them."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from approvals.models import Approval
from console import alerts, charts, monitoring
from demo.models import SandboxCall
from jobs.models import DeadLetter
from runs import submission
from runs.models import Run
from tests.engine_helpers import REFUND, SMALL_REFUND, drive

URL = "/dashboard/"


def _state(response, signal: str) -> str:
    match = re.search(rf'data-signal="{signal}" data-state="(\w+)"', response.content.decode())
    assert match, f"no signal {signal}"
    return match.group(1)


def test_anonymous_is_sent_to_login(client, db):
    response = client.get(URL)
    assert response.status_code == 302 and response["Location"] == f"/accounts/login/?next={URL}"


@pytest.mark.parametrize(("user", "status"), [("alice", 200), ("carol", 200), ("bob", 404), ("dave", 404)])
def test_who_sees_the_dashboard(client, request, user, status):
    client.force_login(request.getfixturevalue(user))
    response = client.get(URL)
    assert response.status_code == status
    if status == 200:
        assert b'href="/dashboard/"' in response.content  # the nav shows it to the same people


def test_it_only_answers_get(client, carol):
    client.force_login(carol)
    assert client.post(URL).status_code == 405


def _worker_heartbeat() -> None:
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO procrastinate_workers (last_heartbeat) VALUES (now())")


def test_all_clear_on_an_empty_system_with_a_worker(client, demo, carol):
    client.force_login(carol)
    assert _state(client.get(URL), "workers") == "warn"  # nobody would take new work
    _worker_heartbeat()
    response = client.get(URL)
    body = response.content.decode()
    states = re.findall(r'data-state="(\w+)"', body)
    assert states and set(states) == {"ok"}
    assert 'hx-trigger="every 5s"' in body and "<html" in body


def test_htmx_gets_the_figures_partial_only(client, demo, carol):
    client.force_login(carol)
    response = client.get(URL, headers={"HX-Request": "true"})
    body = response.content.decode()
    assert response.status_code == 200
    assert body.lstrip().startswith('<div id="figures"') and "<html" not in body
    assert 'hx-get="/dashboard/"' in body and 'hx-swap="outerHTML"' in body  # it keeps polling


def test_dead_letters_warn_then_alert_after_30_minutes(client, demo, carol):
    client.force_login(carol)
    run = drive(submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {"classify": ["fatal"]}})[0])
    assert _state(client.get(URL), "dead-letters") == "warn"
    DeadLetter.objects.filter(run_id=run.id).update(created_at=timezone.now() - timedelta(minutes=31))
    response = client.get(URL)
    assert _state(response, "dead-letters") == "alert"
    assert b"1 open, oldest 31 min" in response.content


def test_any_duplicate_outbound_alerts(client, demo, carol):
    client.force_login(carol)
    drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    assert _state(client.get(URL), "duplicate-outbound") == "ok"
    email = SandboxCall.objects.get(system="email")
    SandboxCall.objects.create(system="email", operation=email.operation, idempotency_key=email.idempotency_key)
    assert _state(client.get(URL), "duplicate-outbound") == "alert"


def test_approvals_backlog_over_sla_alerts(client, demo, carol):
    client.force_login(carol)
    drive(submission.submit(workflow="refund", input=REFUND)[0])
    assert _state(client.get(URL), "approvals-backlog") == "ok"
    card = Approval.objects.get()
    sla = card.due_at - card.created_at
    Approval.objects.filter(pk=card.pk).update(created_at=card.created_at - sla * 0.8, due_at=card.due_at - sla * 0.8)
    assert _state(client.get(URL), "approvals-backlog") == "warn"
    Approval.objects.filter(pk=card.pk).update(due_at=timezone.now() - timedelta(minutes=1))
    response = client.get(URL)
    assert _state(response, "approvals-backlog") == "alert" and b"1 past their SLA" in response.content


def test_runs_not_moving_alert_and_are_listed(client, demo, carol):
    client.force_login(carol)
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    Run.objects.filter(pk=run.pk).update(updated_at=timezone.now() - timedelta(minutes=5))
    response = client.get(URL)
    assert _state(response, "runs-not-moving") == "alert"
    assert f'data-run="{run.id}"'.encode() in response.content
    assert f"/admin/runs/run/{run.id}/change/".encode() in response.content


def test_the_oldest_job_alerts_past_twice_the_queue_sla(client, demo, carol, settings):
    settings.QUEUE_SLA_SECONDS = 10
    client.force_login(carol)
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    assert _state(client.get(URL), "oldest-queued-job") == "ok"

    def waited(seconds: int) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE procrastinate_events SET at = now() - make_interval(secs => %s) WHERE type = 'deferred'",
                [seconds],
            )

    waited(15)
    assert _state(client.get(URL), "oldest-queued-job") == "warn"
    waited(25)
    assert _state(client.get(URL), "oldest-queued-job") == "alert"
    # Work waits and no worker has sent a heartbeat.
    assert _state(client.get(URL), "workers") == "alert"


def test_tool_errors_warn_on_few_attempts_and_alert_on_many(client, demo, carol):
    client.force_login(carol)
    run, _ = submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {"lookup_customer": ["5xx"]}})
    with pytest.raises(Exception, match="503"):
        drive(run)
    assert _state(client.get(URL), "tool-error-rate-10-min") == "warn"
    snap = monitoring.snapshot()
    (lookup,) = [t for t in snap.tool_errors if t.step == "lookup_customer"]
    lookup.attempts, lookup.failed = 40, 4
    signal = {s.title: s for s in alerts.signals(snap)}["Tool error rate (10 min)"]
    assert signal.state == "alert" and "10% of 40" in signal.value


def test_the_charts_count_the_last_hour(client, demo, carol):
    client.force_login(carol)
    for _ in range(2):
        drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    drive(submission.submit(workflow="refund", input=REFUND)[0])  # one open card
    shown = {chart.title: chart for chart in charts.charts()}
    assert len(shown["Runs finished per minute"].values) == 60
    assert sum(shown["Runs finished per minute"].values) == 2
    assert shown["Runs finished per minute"].last == 2
    assert shown["Open approval cards"].last == 1 and shown["Open approval cards"].values[0] == 0
    assert sum(shown["Dead letters per minute"].values) == 0
    body = client.get(URL).content.decode()
    assert body.count("<polyline") == 3 and "now 2, peak 2" in body
