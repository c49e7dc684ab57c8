"""The token rate limit per tenant per minute: a compute step of a tenant at its limit waits (re-queued until the
window has room), never dropped and not an attempt; the dashboard and /metrics show who is throttled."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db.models import F
from django.utils import timezone
from procrastinate.contrib.django.models import ProcrastinateJob

from runs import ratelimit
from runs.models import Run, Step, TenantThrottle
from tests.engine_helpers import SMALL_REFUND, drive, model_calls
from tests.test_metrics import scrape


@pytest.fixture
def demo(db):
    call_command("demo_setup", verbosity=0)


@pytest.fixture
def limited(settings):
    settings.TOKEN_RATE_LIMIT_PER_MINUTE = 100  # a refund's two model calls use more than that


def _submit(tenant: str) -> Run:
    return Run.submit(workflow="refund", input=SMALL_REFUND, tenant=tenant)[0]


def _take_job(run: Run) -> Run:
    """Drive the run as its job would (in-process drives leave the job in the queue, whose queueing lock would
    refuse the job that a wait defers)."""
    ProcrastinateJob.objects.filter(lock=f"run:{run.id}").delete()
    return drive(run)


def _job(run: Run) -> ProcrastinateJob:
    return ProcrastinateJob.objects.get(lock=f"run:{run.id}", status="todo")


def _a_minute_passes() -> None:
    Step.objects.filter(ended_at__isnull=False).update(
        ended_at=F("ended_at") - timedelta(seconds=61), started_at=F("started_at") - timedelta(seconds=61)
    )


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
