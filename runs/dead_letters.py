"""What the dead-letter queue does to a run: requeue it from its last checkpoint, or resolve its letter with a
note. Both are audited. `jobs.DeadLetter` sits below runs (jobs never imports runs), so this lives here.

Who may (runs.access): ops and admins requeue; only admins resolve."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from core.access import Forbidden
from core.models import AuditEntry
from jobs.models import DeadLetter
from runs.access import may_requeue_dead_letters, may_resolve_dead_letters
from runs.gates import Outcome
from runs.models import Run, Step


class DeadLetterError(Exception):
    """The letter cannot be requeued or resolved as asked; the message says why."""


def _rejected_gate(run: Run) -> Step | None:
    """The gate a person rejected just before the run failed (a workflow with on_reject="fail"), if any.
    Its cursor is already past the gate: requeueing would carry out what the person said no to."""
    step = Step.objects.filter(run=run, seq=run.cursor - 1, kind=Step.Kind.GATE, status=Step.Status.DONE).first()
    if step is not None and isinstance(step.output, dict) and step.output.get("decision") == Outcome.REJECTED:
        return step
    return None


def _lock_unresolved(letter_id: int) -> DeadLetter:
    assert transaction.get_connection().in_atomic_block
    letter = DeadLetter.objects.select_for_update().get(pk=letter_id)
    if letter.resolved_at is not None:
        by = letter.resolved_by.get_username() if letter.resolved_by else "someone"
        raise DeadLetterError(
            f"dead letter {letter.pk} was already {letter.resolution} by {by} at {letter.resolved_at:%Y-%m-%d %H:%M:%S}"
        )
    return letter


def requeue(letter: DeadLetter, user, note: str = "") -> Run:
    """Give the run a fresh attempt budget and queue it again: it continues from its last checkpoint (done
    steps are replayed from the database, never executed again; the failed step runs again on the same
    input). The letter is marked resolved as "requeued", in the same transaction as the new job."""
    if not may_requeue_dead_letters(user):
        raise Forbidden("only ops and admins may requeue a dead letter")
    with transaction.atomic():
        # The run first, like the engine, then the letter; re-read both under their locks.
        run = Run.objects.select_for_update().filter(pk=letter.run_id).first()
        letter = _lock_unresolved(letter.pk)
        if run is None:
            raise DeadLetterError(f"run {letter.run_id} no longer exists: resolve this letter instead")
        if run.status != Run.Status.FAILED:
            raise DeadLetterError(f"run {run.id} is {run.status}, not failed: only a failed run can be requeued")
        if (gate := _rejected_gate(run)) is not None:
            raise DeadLetterError(
                f"a person rejected this run at {gate.name}: requeueing would act against that decision; "
                "resolve the letter instead"
            )
        step = Step.objects.filter(run=run, seq=run.cursor).first()
        before = {
            "status": run.status,
            "error": run.error,
            "cursor": run.cursor,
            "step_attempts": step.attempt if step else 0,
        }
        if step is not None and step.status != Step.Status.DONE:
            # A fresh budget: the engine counts a step's executions (and the new job's attempts start at 0).
            # The dead letter and the audit entry keep the count of the attempts that failed.
            Step.objects.filter(pk=step.pk).update(attempt=0)
        run.requeue_failed()
        _close(letter, user, DeadLetter.Resolution.REQUEUED, note)
        AuditEntry.record(
            "dead_letter.requeue",
            actor=user,
            target=f"dead_letter:{letter.pk}",
            run_id=run.id,
            trace_id=run.trace_id,
            data={"before": before, "step": letter.step, "error_class": letter.error_class, "note": note},
        )
    return run


def resolve(letter: DeadLetter, user, note: str) -> DeadLetter:
    """Close the letter without retrying the run (fixed by hand, or not worth doing): a note is required."""
    if not may_resolve_dead_letters(user):
        raise Forbidden("only admins may resolve a dead letter")
    note = (note or "").strip()
    if not note:
        raise DeadLetterError("resolving a dead letter needs a note saying what was done about it")
    with transaction.atomic():
        letter = _lock_unresolved(letter.pk)
        _close(letter, user, DeadLetter.Resolution.RESOLVED, note)
        AuditEntry.record(
            "dead_letter.resolve",
            actor=user,
            target=f"dead_letter:{letter.pk}",
            run_id=letter.run_id,
            trace_id=letter.trace_id,
            data={"step": letter.step, "error_class": letter.error_class, "note": note},
        )
    return letter


def _close(letter: DeadLetter, user, resolution: str, note: str) -> None:
    letter.resolved_at = timezone.now()
    letter.resolved_by = user
    letter.resolution = resolution
    letter.note = note
    letter.save(update_fields=["resolved_at", "resolved_by", "resolution", "note"])
