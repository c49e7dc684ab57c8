"""Helpers for engine tests that drive runs in the test process (the worker's job is `engine.advance`)."""

from __future__ import annotations

from procrastinate.contrib.django.models import ProcrastinateJob

from demo.models import SandboxCall
from runs import engine
from runs.models import Run

REFUND = {
    "customer_id": "cus_1042",
    "amount_cents": 12_500,
    "currency": "EUR",
    "reason": "Item arrived damaged",
}
SMALL_REFUND = {**REFUND, "amount_cents": 900}


def drive(run: Run, attempts: int = 0) -> Run:
    """Advance the run as its job would, until it finishes or parks."""
    engine.advance(run.id, engine.JobInfo(attempts=attempts))
    run.refresh_from_db()
    return run


def model_calls(run: Run, step: str | None = None) -> int:
    calls = SandboxCall.objects.filter(run_id=run.id, system="model")
    return calls.filter(operation=step).count() if step else calls.count()


def queued_jobs(run: Run) -> int:
    return ProcrastinateJob.objects.filter(lock=f"run:{run.id}", status="todo").count()
