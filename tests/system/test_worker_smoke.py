from __future__ import annotations

from django.core.management import call_command
from procrastinate.contrib.django.models import ProcrastinateJob

from approvals.models import Approval
from demo import sandbox
from runs import submission
from runs.models import Run, Step
from tests.conftest import approves_every_channel
from tests.engine_helpers import REFUND, SMALL_REFUND
from tests.worker import wait_until


def test_a_real_worker_parks_and_finishes_a_refund(start_worker, bob):
    call_command("demo_setup", verbosity=0)
    approves_every_channel(bob)
    start_worker()
    run, _ = submission.submit(workflow="refund", input=REFUND)
    wait_until(lambda: Run.objects.get(pk=run.pk).status == Run.Status.WAITING_HUMAN, message="the gate")
    Approval.objects.get(run=run).decide(bob, "approve")
    wait_until(lambda: Run.objects.get(pk=run.pk).status == Run.Status.SUCCEEDED, message="the run to finish")
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}


def test_a_real_worker_retries_a_retryable_fault_with_backoff_then_succeeds(start_worker):
    call_command("demo_setup", verbosity=0)
    start_worker()
    run, _ = submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {"classify": ["429", "5xx"]}})
    wait_until(lambda: Run.objects.get(pk=run.pk).status == Run.Status.SUCCEEDED, message="the run to finish")
    assert Step.objects.get(run=run, name="classify").attempt == 3
    # The run's last checkpoint commits before the worker records its job's outcome (and counts its last attempt).
    jobs = ProcrastinateJob.objects.filter(lock=f"run:{run.id}", task_name="advance_run")
    wait_until(lambda: jobs.get().status == "succeeded", message="the job's outcome")
    job = jobs.get()
    assert job.attempts == 3  # the first try and two retries, each scheduled by the backoff strategy
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}
