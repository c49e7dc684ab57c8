"""/metrics: Prometheus text read from the database on each scrape, protected by a token or loopback."""

from __future__ import annotations

import statistics
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.db.models import Sum
from django.utils import timezone
from procrastinate.contrib.django.models import ProcrastinateJob
from prometheus_client.parser import text_string_to_metric_families

from approvals.models import Approval
from core.models import Channel, GlobalKillSwitch
from demo.models import SandboxCall
from jobs.models import DeadLetter
from runs import dead_letters, engine, submission
from runs.models import Run, Step
from runs.workflow import Ambiguous, Retryable
from tests.engine_helpers import REFUND, SMALL_REFUND, drive


class Scrape:
    def __init__(self, text: str):
        self.families = {family.name: family for family in text_string_to_metric_families(text)}
        self.samples = {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in self.families.values()
            for sample in family.samples
        }

    def __call__(self, name: str, **labels) -> float:
        return self.samples[(name, frozenset(labels.items()))]


def scrape(client, **extra) -> Scrape:
    response = client.get("/metrics", **extra)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=")
    return Scrape(response.content.decode())


def _submit(faults: dict | None = None, base=SMALL_REFUND) -> Run:
    return submission.submit(workflow="refund", input={**base, **({"faults": faults} if faults else {})})[0]


# Who may scrape


def test_loopback_may_scrape_without_a_token(client, db):
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="::1").status_code == 200


def test_others_may_not_scrape_without_a_token(client, db):
    response = client.get("/metrics", REMOTE_ADDR="10.1.2.3")
    assert response.status_code == 403 and b"METRICS_TOKEN" in response.content


def test_with_a_token_set_a_scraper_must_send_it(client, db, settings):
    settings.METRICS_TOKEN = "s3cret-metrics"
    response = client.get("/metrics")  # loopback is not enough once a token is set
    assert response.status_code == 401 and response["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert client.get("/metrics", headers={"Authorization": "Basic s3cret-metrics"}).status_code == 401
    response = client.get("/metrics", REMOTE_ADDR="10.1.2.3", headers={"Authorization": "Bearer s3cret-metrics"})
    assert response.status_code == 200 and b"hitl_runs" in response.content


def test_metrics_need_no_session_and_only_answer_get(client, db):
    assert client.post("/metrics").status_code == 405
    assert "no-cache" in client.get("/metrics")["Cache-Control"]


# Values against the database


def test_queues_jobs_and_runs(client, demo):
    queued = _submit()
    waiting = drive(_submit(base=REFUND))
    done = drive(_submit())
    assert (waiting.status, done.status) == ("waiting_human", "succeeded")
    # drive() runs the engine in-process, so each run's job is still todo: three ready jobs on "agent".
    # One of them waited five minutes; one is scheduled for later (as a retry with backoff would be).
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE procrastinate_events SET at = now() - interval '5 minutes' WHERE type = 'deferred'"
            " AND job_id = (SELECT id FROM procrastinate_jobs WHERE queueing_lock = %s)",
            [f"run:{queued.id}"],
        )
        cursor.execute(
            "UPDATE procrastinate_jobs SET scheduled_at = now() + interval '10 minutes' WHERE queueing_lock = %s",
            [f"run:{done.id}"],
        )

    m = scrape(client)
    todo = ProcrastinateJob.objects.filter(status="todo", queue_name="agent")
    assert m("hitl_queue_depth", queue="agent") == todo.count() - 1 == 2
    assert m("hitl_queue_scheduled", queue="agent") == 1
    assert m("hitl_queue_depth", queue="outbound") == 0 and m("hitl_queue_depth", queue="hitl") == 0
    assert 299 <= m("hitl_queue_oldest_job_age_seconds", queue="agent") <= 330
    assert m("hitl_queue_oldest_job_age_seconds", queue="hitl") == 0
    for status in Run.Status.values:
        assert m("hitl_runs", status=status) == Run.objects.filter(status=status).count()
    assert m("hitl_runs", status="queued") == 1 and m("hitl_runs", status="succeeded") == 1
    assert m("hitl_workers_alive") == 0 and m("hitl_jobs_running") == 0 and m("hitl_jobs_stalled") == 0


def test_dead_letters(client, demo, alice):
    first = drive(_submit({"issue_refund": ["fatal"]}))
    drive(_submit({"classify": ["fatal"]}))
    DeadLetter.objects.filter(run_id=first.id).update(created_at=timezone.now() - timedelta(minutes=45))
    m = scrape(client)
    assert m("hitl_dead_letters_open") == 2 and m("hitl_dead_letters_total") == 2
    assert 45 * 60 - 5 <= m("hitl_dead_letters_oldest_open_age_seconds") <= 45 * 60 + 30
    assert m("hitl_runs", status="failed") == 2

    dead_letters.resolve(DeadLetter.objects.get(run_id=first.id), alice, "refunded by hand")
    m = scrape(client)
    assert m("hitl_dead_letters_open") == 1 and m("hitl_dead_letters_total") == 2  # the total only grows
    assert m("hitl_dead_letters_oldest_open_age_seconds") < 60


def test_approvals_backlog_and_sla(client, demo):
    for _ in range(2):
        drive(_submit(base=REFUND))
    late, fresh = Approval.objects.order_by("id")
    now = timezone.now()
    Approval.objects.filter(pk=late.pk).update(created_at=now - timedelta(hours=2), due_at=now - timedelta(hours=1))
    m = scrape(client)
    assert m("hitl_approvals_open", channel="payments") == 2 == Approval.objects.filter(status="pending").count()
    assert m("hitl_approvals_open", channel="email") == 0
    assert m("hitl_approvals_sla_breached", channel="payments") == 1
    assert 7200 <= m("hitl_approvals_oldest_open_age_seconds") <= 7230
    assert m("hitl_approvals_oldest_open_sla_seconds") == pytest.approx(3600)


def test_step_errors_and_retries_by_cause(client, demo):
    # A model 429 then success; a tool (CRM) 5xx then success.
    run = _submit({"classify": ["429"], "lookup_customer": ["5xx"]})
    with pytest.raises(Retryable):
        drive(run, attempts=0)
    with pytest.raises(Retryable):
        drive(run, attempts=1)
    assert drive(run, attempts=2).status == Run.Status.SUCCEEDED
    # A worker that died mid-run: its run is still `running` when the next job claims it.
    crashed = _submit()
    Run.objects.filter(pk=crashed.pk).update(status=Run.Status.RUNNING, owner="a-dead-worker")
    assert drive(crashed).status == Run.Status.SUCCEEDED
    # A worker shutting down hands its run back between steps.
    stopped = _submit()
    engine.advance(stopped.id, engine.JobInfo(should_stop=lambda: True))
    stopped.refresh_from_db()
    assert stopped.status == Run.Status.QUEUED

    m = scrape(client)
    assert m("hitl_retries_total", cause="model_429") == 1
    assert m("hitl_retries_total", cause="tool_5xx") == 1
    assert m("hitl_retries_total", cause="owner_gone") == 1
    assert m("hitl_retries_total", cause="shutdown") == 1
    assert m("hitl_retries_total", cause="model_5xx") == 0 and m("hitl_retries_total", cause="tool_timeout") == 0

    # 2 for the first run, 2 for the crashed one (its worker died in classify: that execution is an attempt).
    assert m("hitl_step_attempts_10m", workflow="refund", step="classify", kind="compute") == 4
    assert m("hitl_step_failed_attempts_10m", workflow="refund", step="classify", kind="compute") == 2
    assert m("hitl_step_failed_attempts_10m", workflow="refund", step="lookup_customer", kind="read") == 1
    assert m("hitl_step_error_ratio_10m", workflow="refund", step="lookup_customer", kind="read") == pytest.approx(
        1 / 3
    )
    assert m("hitl_step_failed_attempts_10m", workflow="refund", step="issue_refund", kind="effect") == 0
    with pytest.raises(KeyError):  # a gate is a person's decision, not a tool
        m("hitl_step_attempts_10m", workflow="refund", step="approve_refund", kind="gate")


def test_duplicates_blocked_by_receipts(client, demo):
    # Replayed: the worker died after the payment's receipt was done, before the step's checkpoint committed.
    run = drive(_submit())
    Step.objects.filter(run=run, name="notify_customer").delete()
    Step.objects.filter(run=run, name="issue_refund").update(status="running", output=None, ended_at=None)
    Run.objects.filter(pk=run.pk).update(status="running", owner="a-dead-worker", cursor=4, finished_at=None)
    assert drive(run).status == Run.Status.SUCCEEDED
    assert Step.objects.get(run=run, name="issue_refund").attempt == 2
    # Reconciled: the payment's answer was lost; the lookup found it.
    ambiguous = _submit({"issue_refund": ["timeout"]})
    with pytest.raises(Ambiguous):
        drive(ambiguous)
    assert drive(ambiguous, attempts=1).status == Run.Status.SUCCEEDED

    m = scrape(client)
    assert m("hitl_duplicates_blocked_total", channel="payments", how="replayed") == 1
    assert m("hitl_duplicates_blocked_total", channel="email", how="replayed") == 0
    assert m("hitl_duplicates_blocked_total", channel="payments", how="reconciled") == 1
    assert m("hitl_duplicates_blocked_total", channel="email", how="reconciled") == 0
    assert m("hitl_sandbox_duplicate_side_effects") == 0

    call = SandboxCall.objects.filter(system="email").first()
    SandboxCall.objects.create(system="email", operation=call.operation, idempotency_key=call.idempotency_key)
    assert scrape(client)("hitl_sandbox_duplicate_side_effects") == 1


def test_tokens_and_cost(client, demo):
    for _ in range(3):
        drive(_submit())
    drive(_submit(base=REFUND))  # parked: counted in the totals, not in the per-run histogram
    m = scrape(client)
    totals = Run.objects.aggregate(tokens_in=Sum("tokens_in"), tokens_out=Sum("tokens_out"), cost=Sum("cost"))
    assert m("hitl_tokens_total", direction="in") == totals["tokens_in"] > 0
    assert m("hitl_tokens_total", direction="out") == totals["tokens_out"]
    assert m("hitl_cost_total") == pytest.approx(float(totals["cost"]))

    finished = Run.objects.filter(status="succeeded")
    assert m("hitl_run_cost_count") == 3 == m("hitl_run_cost_bucket", le="+Inf")
    assert m("hitl_run_cost_sum") == pytest.approx(float(finished.aggregate(s=Sum("cost"))["s"]))
    costs = list(finished.values_list("cost", flat=True))
    for bound in ("0.0001", "0.001", "0.01"):
        assert m("hitl_run_cost_bucket", le=bound) == sum(1 for c in costs if c <= Decimal(bound))
    tokens = [r.tokens_in + r.tokens_out for r in finished]
    assert m("hitl_run_tokens_sum") == sum(tokens)
    assert m("hitl_run_tokens_bucket", le="1000.0") == sum(1 for t in tokens if t <= 1000)


def test_runs_not_moving(client, demo):
    done = [drive(_submit()) for _ in range(3)]
    usual = statistics.median(sum(s.latency_ms for s in Step.objects.filter(run=run)) / 1000 for run in done)
    still, moving = _submit(), _submit()
    now = timezone.now()
    Run.objects.filter(pk=still.pk).update(updated_at=now - timedelta(minutes=10))
    Run.objects.filter(pk=moving.pk).update(updated_at=now - timedelta(seconds=30))
    m = scrape(client)
    assert m("hitl_runs_not_moving", workflow="refund") == 1
    assert m("hitl_workflow_usual_active_seconds", workflow="refund") == pytest.approx(usual, rel=1e-6)


def test_kill_switches(client, demo, carol):
    Channel.objects.filter(name="email").update(
        kill_switch_engaged=True, kill_switch_reason="bad template", kill_switch_at=timezone.now()
    )
    m = scrape(client)
    assert m("hitl_kill_switch_engaged", channel="email") == 1
    assert m("hitl_kill_switch_engaged", channel="payments") == 0
    assert m("hitl_global_kill_switch_engaged") == 0
    GlobalKillSwitch.load().engage_kill_switch(carol, "incident 42")
    assert scrape(client)("hitl_global_kill_switch_engaged") == 1


def test_every_family_has_help_and_a_type(client, demo):
    families = scrape(client).families
    assert len(families) >= 25
    for family in families.values():
        assert (
            family.name.startswith("hitl_")
            and family.documentation
            and family.type
            in (
                "gauge",
                "counter",
                "histogram",
            )
        )
