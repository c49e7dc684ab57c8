"""Forking a recorded run from one of its steps (issue 28, docs/fork.md): a new run, linked to the original ("fork
of"), that reuses the original's recorded outputs before that step and runs live from it on the code deployed now.

What it reuses: the done step rows before the step, copied (input, hash, output, tape, versions), which the engine
replays from the database as it replays any run's checkpoints (runs.engine._checkpoints); an agent stage's steps are
derived from those outputs (runs.agent.expand), so an agent's run forks the same way. Their tokens and cost stay the
original's (the copies carry none): the fork's totals and budget count only what it spends itself.

What it shares: the original's effects, by receipt key. A fork's `effects_of` is the original's effects root, which
the default keys of its effects start with (runs.steps.Context.effect), so an effect the original already made at
the same step is found done and returns its recorded answer; it is never made twice. New effects and gates behave as
in any run: a gate at or after the step opens a new card (cards are the run's own).

What it refuses, with nothing written (ForkRefused): a run whose record still moves (queued, running, being undone
by its job), an external agent's run (no code here drives it), a step the run does not have or one after a step that
is not done, an empty or too long reason, a workflow version no longer deployed (or whose steps before the fork no
longer match what was recorded), and a fork past the run's compensation point: an effect before the step was undone
(or is being undone), so the outputs the fork would reuse describe what no longer holds.

A fork is made through the one door of runs (runs.submission: the run and its first job in one statement), in one
transaction with its copied steps and its audit entries (`run.fork` on the fork, `run.forked` on the original)."""

from __future__ import annotations

from django.db import transaction

from runs import compensations, submission
from runs import workflow as workflows
from runs.errors import ForkRefused, InvalidInput, UnknownWorkflow
from runs.models import EXTERNAL_WORKFLOW, Run, Step

MAX_REASON = 500  # Run.fork_reason

# The step columns a fork copies, as recorded (tokens and cost are the original's: not copied).
_COPIED = (
    "seq",
    "name",
    "kind",
    "input",
    "input_hash",
    "output",
    "attempt",
    "latency_ms",
    "prompt_version",
    "tools_version",
    "tape",
    "started_at",
    "ended_at",
)


def fork(run: Run, from_step: int, reason: str, by) -> Run:
    """A new run, forked from `run` at its step `from_step` for `reason`, by the person `by`: queued with its first
    job, its steps before `from_step` copied. ForkRefused, nothing written, when it cannot be made (module doc)."""
    reason = (reason or "").strip()
    if not reason:
        raise ForkRefused("a fork needs a reason")
    if len(reason) > MAX_REASON:
        raise ForkRefused(f"the reason is too long ({len(reason)} characters; at most {MAX_REASON})")
    with transaction.atomic():
        # The original's row locked: nothing resumes, cancels or undoes it while its record is read and copied.
        original = Run.objects.select_for_update().get(pk=run.pk)
        steps = list(Step.objects.filter(run=original).order_by("seq"))
        definition = _check(original, steps, from_step)
        child = submission.new_run(
            definition,
            original.input,
            tenant=original.tenant,
            priority=original.priority,
            cost_limit=original.cost_limit,
            created_by=by,
            cursor=from_step,
            fork_of=original,
            fork_from_step=from_step,
            fork_reason=reason,
            effects_of=original.effects_root,
        )
        submission.insert_with_first_job(child)
        Step.objects.bulk_create(
            Step(run=child, status=Step.Status.DONE, **{name: getattr(step, name) for name in _COPIED})
            for step in steps[:from_step]
        )
        entry = {"fork_of": str(original.id), "from_step": from_step, "step": steps[from_step].name, "reason": reason}
        child.audit("run.fork", entry, actor=by)
        original.audit("run.forked", {**entry, "fork": str(child.id)}, actor=by)
    return child


def _check(run: Run, steps: list[Step], from_step: int):
    """The deployed workflow a fork of `run` from `from_step` runs on; ForkRefused when it cannot be made."""
    if run.workflow == EXTERNAL_WORKFLOW:
        raise ForkRefused("an external agent's run cannot be forked: its agent runs it, not this deployment's code")
    if run.status in Run.MOVING:
        raise ForkRefused(f"the run is {run.status}: its record still moves; fork it once it has parked or finished")
    by_seq = {step.seq: step for step in steps}
    if from_step not in by_seq:
        recorded = ", ".join(f"{s.seq} ({s.name})" for s in steps) or "none"
        raise ForkRefused(f"the run has no step {from_step}; its recorded steps are: {recorded}")
    for seq in range(from_step):
        step = by_seq.get(seq)
        if step is None or step.status != Step.Status.DONE:
            what = f"step {seq} ({step.name}, {step.status})" if step else f"step {seq} (not recorded)"
            raise ForkRefused(f"{what} before step {from_step} is not done: a fork reuses only done steps")
    try:
        definition = workflows.get(run.workflow, run.workflow_version)
    except UnknownWorkflow as exc:
        raise ForkRefused(f"the run's workflow is not deployed: {exc}") from None
    outputs: dict = {}
    for step in steps[:from_step]:
        declared = _step_at(definition, step.seq, outputs)
        if declared is None or declared.name != step.name:
            raise ForkRefused(
                f"the deployed {run.workflow} v{run.workflow_version} no longer has step {step.seq} as recorded "
                f"({step.name}): its outputs cannot be reused"
            )
        outputs[step.name] = step.output
    try:
        definition.validate_input(run.input)
    except InvalidInput as exc:
        raise ForkRefused(f"the run's input no longer fits the workflow's input schema: {exc}") from None
    point = compensation_point(run, definition)
    if point is not None and from_step > point[0]:
        seq, name = point
        raise ForkRefused(
            f"the run is past its compensation point: its effect {name} (step {seq}) was undone or is being undone, "
            f"so the outputs before step {from_step} no longer hold; fork from step {seq} or before"
        )
    return definition


def compensation_point(run: Run, definition=None) -> tuple[int, str] | None:
    """(seq, step name) of the run's earliest effect that was undone, or that its undo (under way or parked) is to
    undo: a fork may start there or before, never after. None when no effect of it was or is to be undone."""
    entries = compensations.registry(run, definition)
    undone = [e for e in entries if e.outcome in ("done", "by_hand", "failed")]
    undoing = run.undo_reason or run.status == Run.Status.COMPENSATION_FAILED
    if undoing and run.status != Run.Status.COMPENSATED:
        undone += compensations.to_undo(entries)
    if not undone:
        return None
    first = min(undone, key=lambda e: e.seq)
    return first.seq, first.step or first.key


def _step_at(definition, seq: int, outputs: dict):
    try:
        return definition.step_at(seq, outputs)
    except (KeyError, AttributeError, TypeError):
        return None
