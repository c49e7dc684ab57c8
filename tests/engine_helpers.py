"""Helpers for engine tests that drive runs in the test process (the worker's job is `engine.advance`)."""

from __future__ import annotations

from procrastinate.contrib.django.models import ProcrastinateJob

from approvals.models import Approval
from demo.models import SandboxCall
from runs import engine, submission
from runs.models import Run

REFUND = {
    "customer_id": "cus_1042",
    "amount_cents": 12_500,
    "currency": "EUR",
    "reason": "Item arrived damaged",
}
SMALL_REFUND = {**REFUND, "amount_cents": 900}
# The support agent refunds the order (a card from AUTO_APPROVE_CENTS up), emails the customer (a card), notes it.
SUPPORT = {"customer_id": "cus_1042", "message": "Refund ord_10421 please, 20 EUR", "order_id": "ord_10421"}


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


def approve_until(run: Run, reviewer, stop_at=lambda card: False, tries: int = 6) -> Run:
    """Drive `run` as its jobs would, `reviewer` approving each card it parks on, until it ends or parks on a card
    `stop_at` picks."""
    run = drive(run)
    for _ in range(tries):
        card = Approval.objects.filter(run=run, status=Approval.Status.PENDING).first()
        if card is None or stop_at(card):
            break
        card.decide(reviewer, "approve")
        run = drive(run)
    return run


def support_parked_at_the_email(demo) -> Run:
    """A support_agent run that refunded the order (its card approved) and waits on the email's card."""
    run = approve_until(
        submission.submit(workflow="support_agent", input=SUPPORT)[0],
        demo["reviewer"],
        stop_at=lambda card: bool(card.proposed.get("subject")),
    )
    assert Approval.objects.filter(run=run, status="pending", proposed__has_key="subject").exists(), (
        f"no email card: {run.status} {run.result}"
    )
    return run
