"""Graceful shutdown with real worker processes: SIGTERM in the middle of a run.

The worker stops taking jobs, lets the current step finish and checkpoint, re-queues the run (it is not
failed, and nothing is retried as an error), and exits within its graceful timeout. Another worker then
finishes the run from that checkpoint."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from django.core.management import call_command
from procrastinate.contrib.django.models import ProcrastinateJob

from demo import sandbox
from jobs.models import DeadLetter
from runs import submission
from runs.models import Receipt, Run, Step
from tests.engine_helpers import SMALL_REFUND, model_calls, queued_jobs
from tests.worker import FAST_WORKER_ENV, settles_as, wait_with_logs, worker_logs

GRACEFUL_TIMEOUT = float(FAST_WORKER_ENV["WORKER_SHUTDOWN_GRACEFUL_TIMEOUT"])
STEPS = ["classify", "lookup_customer", "draft_refund", "approve_refund", "issue_refund", "notify_customer"]


@pytest.fixture
def demo(transactional_db):
    call_command("demo_setup", verbosity=0)


def _status(run: Run) -> str:
    return Run.objects.values_list("status", flat=True).get(pk=run.pk)


@pytest.mark.parametrize(
    ("step", "checkpointed"),
    [
        ("classify", 1),  # the first step (a model call)
        ("lookup_customer", 2),  # mid-way: a tool read, one step done before it, four after
        ("issue_refund", 5),  # an effect: it completes with its receipt, and is not sent again
    ],
)
def test_sigterm_mid_step_requeues_the_run_and_another_worker_finishes_it(demo, start_worker, step, checkpointed):
    run, _ = submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {step: ["latency:1500"]}})
    first = start_worker()
    # The steps before it are checkpointed and the run is running: the worker is now inside the 1.5 s call.
    wait_with_logs(
        lambda: Run.objects.filter(pk=run.pk, status="running", cursor=STEPS.index(step)).exists(),
        f"{step} to start",
        [first],
    )

    signalled = time.monotonic()
    first.kill(signal.SIGTERM)
    try:
        code = first.wait(GRACEFUL_TIMEOUT + 2)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit within {GRACEFUL_TIMEOUT + 2} s of SIGTERM\n{worker_logs([first])}")
    took = time.monotonic() - signalled
    assert code == 0, worker_logs([first])
    # The engine stopped by itself after the step, before the graceful timeout had to abort the job.
    assert took < GRACEFUL_TIMEOUT, f"exit took {took:.1f} s\n{worker_logs([first])}"

    # Re-queued at the checkpoint after the step it was in, not failed, not counted as a failed attempt.
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED, worker_logs([first])
    assert run.cursor == checkpointed and run.attempt == 0 and not run.error
    steps = list(Step.objects.filter(run=run).order_by("seq").values_list("name", "status"))
    assert steps == [(name, "done") for name in STEPS[:checkpointed]]
    assert queued_jobs(run) == 1
    if step == "issue_refund":
        assert Receipt.objects.get(run=run).status == Receipt.Status.DONE
    assert not ProcrastinateJob.objects.filter(status__in=["doing", "failed"]).filter(task_name="advance_run").exists()
    assert not DeadLetter.objects.exists()

    second = start_worker()
    settles_as(run, Run.Status.SUCCEEDED, [first, second])

    steps = list(Step.objects.filter(run=run).order_by("seq").values_list("name", "status", "attempt"))
    assert steps == [(name, "done", 1) for name in STEPS]  # no step was started twice
    assert model_calls(run, "classify") == 1 and model_calls(run, "draft_refund") == 1
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}
