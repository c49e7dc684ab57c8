"""The token rate limit per tenant per minute: a compute step of a tenant at its limit waits (re-queued until the
window has room), never dropped and not an attempt; the dashboard and /metrics show who is throttled."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models import F
from django.utils import timezone
from procrastinate.contrib.django.models import ProcrastinateJob

import tests.workflows  # noqa: F401 - registers the test workflows
from runs import ratelimit, submission
from runs.models import ModelUsage, Run, TenantThrottle
from runs.workflow import Retryable
from tests.engine_helpers import SMALL_REFUND, drive, model_calls
from tests.integration.console.test_metrics import scrape


@pytest.fixture
def limited(settings):
    settings.TOKEN_RATE_LIMIT_PER_MINUTE = 100  # a refund's two model calls use more than that


def _submit(tenant: str) -> Run:
    return submission.submit(workflow="refund", input=SMALL_REFUND, tenant=tenant)[0]


def _take_job(run: Run) -> Run:
    """Drive the run as its job would (in-process drives leave the job in the queue, whose queueing lock would
    refuse the job that a wait defers)."""
    ProcrastinateJob.objects.filter(lock=f"run:{run.id}").delete()
    return drive(run)


def _job(run: Run) -> ProcrastinateJob:
    return ProcrastinateJob.objects.get(lock=f"run:{run.id}", status="todo")


def _a_minute_passes() -> None:
    ModelUsage.objects.update(at=F("at") - timedelta(seconds=61))


def test_a_tenant_over_its_rate_waits_and_loses_nothing(demo, limited):
    first = drive(_submit("acme"))
    assert first.status == Run.Status.SUCCEEDED and ratelimit.tokens_used("acme") >= 100

    waiting = _take_job(_submit("acme"))
    assert waiting.status == Run.Status.QUEUED and waiting.attempt == 0 and waiting.error == ""
    assert model_calls(waiting) == 0 and not waiting.steps.exists()  # the model was not called, nothing failed
    # Its job comes back when the window has room: once the first run's tokens are a minute old.
    job = _job(waiting)
    assert timezone.now() + timedelta(seconds=50) < job.scheduled_at < timezone.now() + timedelta(seconds=62)

    # Another tenant is not held up.
    assert drive(_submit("globex")).status == Run.Status.SUCCEEDED

    _a_minute_passes()
    waiting = _take_job(waiting)
    assert waiting.status == Run.Status.SUCCEEDED
    assert model_calls(waiting) == 2
    assert dict(waiting.steps.values_list("name", "attempt")) == dict.fromkeys(
        ["classify", "lookup_customer", "draft_refund", "approve_refund", "issue_refund", "notify_customer"], 1
    )
    assert not Run.objects.exclude(status=Run.Status.SUCCEEDED).exists()


def test_a_wait_in_the_middle_of_a_run_resumes_at_that_step(demo, settings):
    settings.TOKEN_RATE_LIMIT_PER_MINUTE = 50  # classify alone (about 57 tokens) leaves no room for the draft
    run = _take_job(_submit("acme"))
    assert run.status == Run.Status.QUEUED
    assert list(run.steps.values_list("name", flat=True)) == ["classify", "lookup_customer"]
    assert run.cursor == 2 and model_calls(run, "draft_refund") == 0
    _a_minute_passes()
    run = _take_job(run)
    assert run.status == Run.Status.SUCCEEDED and model_calls(run) == 2


def test_without_a_limit_nobody_waits(demo, settings):
    settings.TOKEN_RATE_LIMIT_PER_MINUTE = 0
    for _ in range(3):
        assert drive(_submit("acme")).status == Run.Status.SUCCEEDED
    assert not TenantThrottle.objects.exists()


def test_the_dashboard_and_metrics_show_who_is_throttled(demo, limited, client, carol):
    drive(_submit("acme"))
    _take_job(_submit("acme"))
    throttle = TenantThrottle.objects.get()
    assert throttle.tenant == "acme" and throttle.waits == 1 and throttle.used >= 100 and throttle.limit == 100

    client.force_login(carol)
    page = client.get("/dashboard/").content.decode()
    assert 'data-throttled="acme"' in page and "100 tokens per tenant per minute" in page
    metrics = scrape(client, REMOTE_ADDR="127.0.0.1")
    assert metrics("hitl_tenant_throttled_tokens_last_minute", tenant="acme") >= 100
    assert metrics("hitl_token_rate_limit_per_minute") == 100

    # Once its wait is over, the tenant is no longer shown as throttled.
    TenantThrottle.objects.update(waiting_until=timezone.now() - timedelta(seconds=1))
    assert 'data-throttled="acme"' not in client.get("/dashboard/").content.decode()


def test_a_failed_attempts_tokens_count_against_the_rate_and_the_runs_cost(demo, settings):
    """A model call that answered, in a step that then failed, spent its tokens: they count against the tenant's
    rate and the run's totals (which its cost limit reads), and its step shows both attempts' usage."""
    run = submission.submit(workflow="test_spend_then_fail", input={}, tenant="acme")[0]
    with pytest.raises(Retryable):
        drive(run)
    failed = Run.objects.get(pk=run.pk)
    once, cost_once = failed.tokens_in + failed.tokens_out, failed.cost
    assert failed.status == Run.Status.QUEUED and once > 0 and cost_once > 0
    assert ratelimit.tokens_used("acme") == once
    assert failed.steps.get().tokens_in == failed.tokens_in  # the failed attempt's row shows what it used

    run = drive(failed, attempts=1)
    assert run.status == Run.Status.SUCCEEDED
    step = run.steps.get()
    assert step.attempt == 2 and (step.tokens_in, step.tokens_out) == (run.tokens_in, run.tokens_out)
    assert run.tokens_in + run.tokens_out == 2 * once and run.cost == 2 * cost_once  # both attempts
    assert ratelimit.tokens_used("acme") == 2 * once


def test_a_lost_attempts_tokens_count_too(demo):
    """The job lost the run between the model's answer and its checkpoint (which is refused): the tokens were
    spent all the same, and count against the run's cost and its tenant's rate."""
    run = drive(submission.submit(workflow="test_spend_then_lose", input={}, tenant="acme")[0])
    assert run.owner == "another-job" and not run.steps.exists()  # nothing of the step was written
    assert run.tokens_in > 0 and run.cost > 0
    assert ratelimit.tokens_used("acme") == run.tokens_in + run.tokens_out
