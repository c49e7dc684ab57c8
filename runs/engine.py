"""The engine: advances one run, step by step, from its last checkpoint until it finishes or parks.

One `advance_run` job per run at a time (runs.tasks) calls `advance()`. Each step is checkpointed in its own
transaction (Step row + run cursor + totals); a done step is replayed from the database, never re-executed.
Between steps the engine checks cancellation, worker shutdown and the cost limit; kill switches are checked
where effects start (runs.steps._open_receipt). Errors are classified: Fatal goes to the dead-letter queue
at once, anything else is retried by the job (exponential backoff with full jitter) until attempts run out.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import ROUND_DOWN, Decimal

import structlog
from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone
from django.utils.module_loading import import_string

from core import tracing
from core.models import Channel
from jobs.models import DeadLetter
from jobs.retry import BackoffWithJitter
from runs import compensations, gates, ownership, personal, ratelimit
from runs import workflow as workflows
from runs.errors import Ambiguous, Fatal, OwnershipLost, Park, Stop, UnknownWorkflow, Wait
from runs.gates import ApprovalRequest, Outcome, canonical_hash
from runs.models import Run, Step
from runs.sql import queries
from runs.steps import Context, StepDef, check_decided_edit
from runs.workflow import Workflow

log = structlog.get_logger("runs.engine")


@dataclass
class JobInfo:
    """What the worker tells the engine about the job that runs it."""

    job_id: int | None = None
    attempts: int = 0  # earlier attempts of this job
    should_stop: Callable[[], bool] = field(default=lambda: False)
    worker: str | None = None


def advance(run_id, job: JobInfo | None = None) -> None:
    """Drive the run while holding its advisory lock (runs.ownership): a job that finds the lock held by a live
    session leaves the run to it, however stale that owner's heartbeat looks, and tries again later."""
    job = job or JobInfo()
    with ownership.taking(run_id) as lock:
        try:
            # The lock and the claim in one round trip (Run.take): what a decided run waits for before its step.
            run, took_over = Run.take(run_id, ownership.new_token(job.worker, job.job_id), lock)
            if not lock.taken:
                _try_again_later(run_id, job)
                return
            if run is None:
                return
            with structlog.contextvars.bound_contextvars(run_id=str(run.id), trace_id=run.trace_id, job_id=job.job_id):
                if took_over:
                    # The previous owner's session ended with the run still running: its worker was killed, or
                    # lost its connection (a database restart). Its step resumes from the last checkpoint; a
                    # pending receipt is reconciled.
                    record_retry(run, "owner_gone")
                _advance(run, job)
        except OwnershipLost as exc:
            # Another job took the run over, or this job's database session ended (and the run's lock with it)
            # while it worked: whatever it did since its last write is redone by the run's next owner.
            log.warning("lost ownership of the run: stopping without writing", run_id=str(run_id), error=str(exc))


def _advance(run: Run, job: JobInfo) -> None:
    workflow = None
    try:
        workflow = workflows.get(run.workflow, run.workflow_version)
        if not run.undo_reason:
            _drive(run, workflow, job)
    except (Fatal, UnknownWorkflow) as exc:
        _fail(run, exc, job, workflow=workflow)
    except OwnershipLost:
        raise
    except Exception as exc:
        if not _out_of_attempts(run, exc, job):
            _wait_for_retry(run, exc, job)
            record_retry(run, exc=exc)
            raise  # the job's retry strategy schedules the next attempt
        _fail(run, exc, job, workflow=workflow)
    if workflow is not None and run.undo_reason and run.status in Run.OWNED:
        _undo(run, workflow, job)  # its undo began in this job, or an earlier job's goes on


def _undo(run: Run, workflow: Workflow, job: JobInfo) -> None:
    """Undo the run (runs.compensations): its compensations in reverse order, each through its own receipt. Parks
    and waits as a step does; a compensation's failure is retried with backoff as a step's is, and one that fails
    for good parks the run `compensation_failed` with a card."""

    def context_for(step_def: StepDef, seq: int) -> Context:
        # The tools of the effect's step, named for its undo (a demo fault list can target it).
        tools = _factory(settings.AGENT_TOOLS)(run, f"undo:{step_def.name}") if settings.AGENT_TOOLS else None
        return Context(run, step_def, seq, {}, model=None, tools=tools)

    try:
        outcome = compensations.drive(run, workflow, context_for, job.should_stop)
    except Park as park:
        _park(run, run.cursor if park.seq is None else park.seq, park)
        log.info("undo parked", reason=park.reason)
        return
    except Wait as wait:
        with transaction.atomic():
            run.release(delay=wait.delay)
        log.info("undo waits", reason=wait.reason, delay_s=round(wait.delay, 2))
        return
    except OwnershipLost:
        raise
    except Fatal as exc:
        _fail(run, exc, job)
        return
    except Exception as exc:
        if not _out_of_attempts(run, exc, job):
            _wait_for_retry(run, exc, job)
            record_retry(run, exc=exc)
            raise
        _fail(run, exc, job)
        return
    if outcome == "stopped":
        _release_for_shutdown(run)
        return
    if outcome == "declined":  # a person said a run that failed for good is not to be undone
        letter = (run.result or {}).get("cause") or {}
        with transaction.atomic():
            run.fail(letter.get("error", "failed"))
            _dead_letter(run, letter)
        log.error("run failed", error=letter.get("error"), undo="declined")
        return
    entries = compensations.registry(run, workflow)
    reason, letter = run.undo_reason, (run.result or {}).get("cause") or {}
    with transaction.atomic():
        run.end_undo(compensations.result_of(run, entries))
        run.audit("run.compensated", {"reason": reason, "effects": {e.key: e.outcome or e.why_not() for e in entries}})
        if reason == "failed":  # dead-lettered too, with what its undo did
            undone = "\n".join(f"  {e.step or e.key} on {e.channel}: {e.outcome or e.why_not()}" for e in entries)
            _dead_letter(run, {**letter, "traceback": f"{letter.get('traceback', '')}\nUndone:\n{undone}\n"})
    log.info("run finished", status=run.status, undo=reason)


def _try_again_later(run_id, job: JobInfo) -> None:
    delay = settings.OWNER_WAIT_SECONDS
    with transaction.atomic():
        run = Run.objects.filter(pk=run_id).first()
        if run is None or run.status not in (Run.Status.QUEUED, *Run.OWNED):
            return  # parked or finished: a decision, a release or nothing will give it its next job
        run.enqueue(delay=delay)
    log.info(
        "the run is driven by another live job: trying again later",
        run_id=str(run_id),
        job_id=job.job_id,
        delay_s=delay,
    )


def _step_attempts(run: Run, job: JobInfo) -> int:
    """Executions of the step at the cursor so far, this one included: its finished attempts (failures, and a
    crash counts as one; a park does not) plus one. The retry budget is per step, not per job."""
    return run.attempt + 1


def _out_of_attempts(run: Run, exc: Exception, job: JobInfo) -> bool:
    if job.attempts + 1 >= BackoffWithJitter.MAX_JOB_ATTEMPTS:
        return True  # the job's last attempt: the run goes to the dead-letter queue, never left queued jobless
    if isinstance(exc, Ambiguous):
        # A write that may have happened is never given up on before it is reconciled: the next attempt asks
        # the tool's lookup, or a person, before anything else. Only the job backstop ends that.
        return False
    return _step_attempts(run, job) >= run.max_attempts


def _drive(run: Run, workflow: Workflow, job: JobInfo) -> None:
    outputs, unfinished = _checkpoints(run)  # read once per job, then carried in memory
    if _end_at_rejection(run, workflow, outputs):
        return
    while True:
        if run.cancel_requested:  # as read by the claim, then by each checkpoint
            _stop(run, workflow, {"outcome": "cancelled"})
            return
        if job.should_stop():
            _release_for_shutdown(run)
            return
        step_def = workflow.step_at(run.cursor, outputs)
        if step_def is None:
            _finish(run, workflow.result(outputs))
            return
        if not _within_budget(run, workflow):
            return
        with _step_span(run, step_def, job):
            if not _run_step(run, workflow, step_def, outputs, unfinished):
                return


def _step_span(run: Run, step_def: StepDef, job: JobInfo):
    """The step's attempt as a `run.step` span (core.tracing) under the run's root, in the run's trace: its model
    calls, tool reads, effects and cards are its children. Off: the shared null context, nothing built."""
    if not tracing.ENABLED:
        return tracing.NULL
    attributes = {
        "hitl.run_id": str(run.id),
        "hitl.workflow": run.workflow,
        "hitl.step": step_def.name,
        "hitl.step.kind": step_def.kind,
        "hitl.step.seq": run.cursor,
        "hitl.attempt": run.attempt + 1,
        "hitl.job_id": job.job_id if job.job_id is not None else -1,
    }
    parent = tracing.parent_of(run.trace_parent, run.trace_id, run.id.hex[:16])
    return tracing.span("run.step", attributes, parent=parent, ok=(Park, Wait, Stop))


def _release_for_shutdown(run: Run) -> None:
    """Its worker is stopping: the run goes back to the queue between two steps (or compensations)."""
    with transaction.atomic():
        run.release()
        record_retry(run, "shutdown")
    log.info("run requeued", reason="worker shutting down")


def _checkpoints(run: Run) -> tuple[dict, dict]:
    """The run's step rows, read once per job (by the claim's statement, Run.claim), then carried in memory: the
    outputs of done steps by name, and the input hash of each step an earlier attempt left unfinished (it failed,
    or parked) by seq."""
    outputs, unfinished = {}, {}
    rows = getattr(run, "step_rows", None)
    if rows is None:  # a run that was not claimed by this job's Run.claim
        with connection.cursor() as cursor:
            cursor.execute(queries["steps_of_run"], [run.pk])
            rows = cursor.fetchall()
    run.step_rows = None  # read once
    for name, seq, status, output, input_hash in rows:
        if status == Step.Status.DONE:
            outputs[name] = json.loads(output) if isinstance(output, str | bytes) else output
        else:
            unfinished[seq] = input_hash
    return outputs, unfinished


def _check_resumed_input(step_def: StepDef, seq: int, input_hash: str, unfinished: dict) -> None:
    """A step an earlier attempt left unfinished runs again only on the same input. Nothing is written when a
    step starts: a crash is counted by the owner that takes the run over (Run.claim, Run.recover), an effect's
    start is its receipt, and the step's one write is its checkpoint."""
    if seq in unfinished and unfinished[seq] != input_hash:
        raise Fatal(
            f"the input of step {seq} ({step_def.name}) changed since it was checkpointed: "
            "refusing to re-run it on different input"
        )


def _record_step(run: Run, step_def: StepDef, seq: int, step_input: dict, input_hash: str, **fields) -> None:
    """Update the step's row (an earlier attempt's: its tokens and cost added to), or insert it, as part of the
    caller's transaction, whose owner's row lock (Run.owned) keeps any other writer of it out."""
    usage = {name: fields.pop(name, 0) for name in ("tokens_in", "tokens_out", "cost")}
    added = {name: F(name) + value for name, value in usage.items()}
    if not Step.objects.filter(run=run, seq=seq).update(attempt=run.attempt + 1, **added, **fields):
        Step.objects.create(
            run=run,
            seq=seq,
            name=step_def.name,
            kind=step_def.kind,
            input=step_input,
            input_hash=input_hash,
            attempt=run.attempt + 1,
            **usage,
            **fields,
        )


def _run_step(run: Run, workflow: Workflow, step_def: StepDef, outputs: dict, unfinished: dict) -> bool:
    """Run (or resume) the step at the cursor. True when the run goes on, False when it parked or ended."""
    seq = run.cursor
    step_input = {
        "input": run.input,
        "outputs": outputs,
        **({"versions": step_def.versions} if step_def.versions else {}),
    }
    input_hash = canonical_hash(step_input)
    _check_resumed_input(step_def, seq, input_hash, unfinished)
    model, tools = _make("AGENT_MODEL", run, step_def), _make("AGENT_TOOLS", run, step_def)
    ctx = Context(run, step_def, seq, outputs, model=model, tools=tools)
    started_at, started = timezone.now(), time.perf_counter()

    def record(**fields) -> None:
        _record_step(
            run,
            step_def,
            seq,
            step_input,
            input_hash,
            started_at=started_at,
            latency_ms=_ms(started),
            tokens_in=ctx.usage.tokens_in,
            tokens_out=ctx.usage.tokens_out,
            cost=ctx.usage.cost,
            **(step_def.versions or {}),
            **fields,
        )

    try:
        if step_def.kind == Step.Kind.COMPUTE:
            ratelimit.wait_for_tokens(run)  # a tenant at its token rate waits (Throttled, a Wait)
        decided = gates.backend().decided(run, seq) if step_def.kind == Step.Kind.GATE else None
        # A decided gate is replayed from its card, never asked again: a person's answer stands even if the
        # gate's code would now decide otherwise (a new auto-approve threshold after a deploy). An edit must
        # still fit the gate's declaration (Fatal otherwise: nothing after it runs).
        if decided is not None:
            check_decided_edit(step_def, decided.proposed, decided)
        output = decided.as_output() if decided is not None else step_def.fn(ctx)
        # Personal data: a read's declared fields sealed, any clear value the step handled back to its reference.
        output = ctx.known.scrub(
            personal.seal_read(step_def.pii, output, field=step_def.name, run_id=run.id, known=ctx.known)
        )
    except Park as park:
        _park(run, seq, park, record)
        _log_step(step_def, seq, "parked", started, ctx, reason=park.reason)
        return False
    except OwnershipLost:
        raise
    except Stop as stop:
        # A person stopped the run from a budget card (an agent's turn limit), or rejected an agent's call with
        # "reject and undo", or a cancel came while the step ran.
        result = dict(stop.result)
        undo = result.pop("undo", "")
        if not undo and result.get("outcome") == "stopped at turn limit" and workflow.undo == "always":
            undo = "budget"
        _stop(run, workflow, result, undo)
        _log_step(step_def, seq, "stopped", started, ctx)
        return False
    except Wait as wait:
        # Not attempted (an open circuit breaker, the token rate limit): no failure is recorded and no attempt
        # counted; the run goes back to the queue with a job due when the wait should be over.
        with transaction.atomic():
            run.release(delay=wait.delay)
        log.info("step waits", step=step_def.name, seq=seq, reason=wait.reason, delay_s=round(wait.delay, 2))
        return False
    except Exception as exc:
        ctx.known.scrub_error(exc)  # recorded, dead-lettered and logged: never with a clear personal value
        status = Step.Status.UNKNOWN if isinstance(exc, Ambiguous) else Step.Status.FAILED
        with transaction.atomic():
            run.owned()
            record(status=status, error=f"{exc.__class__.__name__}: {exc}", output=None, ended_at=None)
        _log_step(step_def, seq, status, started, ctx, error=str(exc))
        raise

    # The last step (nothing follows it, with its output: an agent stage's next step depends on it) ends the run
    # in its checkpoint's statement; its result is computed from the outputs as they will be stored. A rejected
    # gate is the last step too: the run ends in the transaction that records the rejection, so that no crash or
    # failed write between the two can let a retried job go on into the action the person refused.
    rejection = _rejection(step_def, output)
    undo = rejection is not None and rejection.pop("undo", False)  # reject and undo: the run is undone
    if undo:
        last, result = False, None
    elif rejection is not None:
        last, result = workflow.on_reject == "succeed", rejection
    else:
        after = {**outputs, step_def.name: json.loads(json.dumps(output, cls=DjangoJSONEncoder))}
        last = workflow.step_at(seq + 1, after) is None
        result = workflow.result(after) if last else None

    # The step's one write, one statement in autocommit: its row and the run's cursor, owner and cursor checked
    # in the run's UPDATE (OwnershipLost: nothing written). Later steps see the output as it is stored (JSON:
    # jsonb rewrites numbers, dates become strings), so that a step's input, and its hash, are the same in this
    # job and on any replay; a cancel requested while the step ran comes back with it and stops the run before
    # its next step. The last step's is the run's finish too (one transaction: the wake-up of the tenant's runs
    # waiting for a slot is its second statement); a cancel requested while it ran ends the run cancelled.
    with transaction.atomic() if last or rejection is not None else contextlib.nullcontext():
        outputs[step_def.name] = run.checkpoint(
            seq,
            ctx.usage,
            name=step_def.name,
            kind=step_def.kind,
            input=step_input,
            input_hash=input_hash,
            output=output,
            started_at=started_at,
            latency_ms=_ms(started),
            **(step_def.versions or {}),
            tape=ctx.known.scrub(ctx.tape.stored()),
            new=seq not in unfinished,  # no earlier attempt left a row of it (as the claim read them)
            finish=last,
            result=result,
        )
        if undo:
            run.start_undo("rejected", cause=rejection)
        elif rejection is not None and not last:  # on_reject "fail": to the dead-letter queue, in the same transaction
            _fail(run, _rejected_error(rejection), JobInfo(), step=step_def.name)
    _log_step(step_def, seq, "done", started, ctx)
    if last or rejection is not None:
        log.info("run finished", status=run.status)
        return False
    return True


def _rejection(step_def: StepDef, output) -> dict | None:
    """The run's result when `output` is a gate's rejection: the run ends there."""
    if step_def.kind != Step.Kind.GATE or not isinstance(output, dict) or output.get("decision") != Outcome.REJECTED:
        return None
    return {
        "outcome": Outcome.REJECTED.value,
        "step": step_def.name,
        "comment": output.get("comment", ""),
        "reason": output.get("reason", ""),
        "by": output.get("by", ""),
        **({"undo": True} if output.get("undo") else {}),
    }


def _rejected_error(rejection: dict) -> Fatal:
    return Fatal(f"rejected at {rejection['step']}: {rejection['comment']}")


def _end_at_rejection(run: Run, workflow: Workflow, outputs: dict) -> bool:
    """A run whose cursor is past a rejected gate ends there, whatever follows (its rejection was recorded by
    an engine that ended the run in a second transaction, which did not happen). True when it ended."""
    for step_def in workflow.steps:
        rejection = _rejection(step_def, outputs.get(step_def.name))
        if rejection is None:
            continue
        if rejection.pop("undo", False):
            with transaction.atomic():
                run.start_undo("rejected", cause=rejection)
        elif workflow.on_reject == "fail":
            _fail(run, _rejected_error(rejection), JobInfo(), step=step_def.name)
        else:
            _finish(run, rejection)
        return True
    return False


def _within_budget(run: Run, workflow: Workflow) -> bool:
    """Past its cost limit a run parks with a budget card: a person extends the limit or stops the run."""
    if run.cost_limit is None or run.cost < run.cost_limit:
        return True
    channel = next((s.channel for s in workflow.steps if s.channel), "payments")
    # The card proposes at most the ceiling (approvals.edits holds approvals and edits to it too). A run that has
    # spent up to it gets a card all the same, proposing the ceiling, which cannot be approved: it can be stopped.
    ceiling = Decimal(str(settings.BUDGET_CEILING))
    spent = f"The run has spent {run.cost} against a limit of {run.cost_limit}"
    request = ApprovalRequest(
        channel=channel,
        kind=gates.Kind.BUDGET,
        proposed={"cost_limit": str(min(max(run.cost_limit * 2, run.cost + Decimal("0.01")), ceiling))},
        current={"cost": _as_stored(run.cost), "cost_limit": _as_stored(run.cost_limit)},
        summary=(
            f"{spent}, and the ceiling of {ceiling} (BUDGET_CEILING) is reached: stop the run, or raise "
            "BUDGET_CEILING first."
            if run.cost >= ceiling
            else f"{spent}. Extend the limit or stop."
        ),
        rule_id="cost-limit",
        risk="medium",
    )
    park = Park(f"cost limit {run.cost_limit} reached", request, paused=True)
    decision = gates.backend().decision(run, run.cursor, request)
    if decision is None:
        _park(run, run.cursor, park)
        return False
    if decision.rejected:
        undo = "budget" if compensations.wants_undo_on_stop(run, workflow, asked=decision.undo) else ""
        _stop(run, workflow, {"outcome": "stopped at cost limit", "by": decision.by, "comment": decision.comment}, undo)
        return False
    limit = min(Decimal(str((decision.payload or {})["cost_limit"])), ceiling)  # the ceiling may have been lowered
    if limit <= run.cost:
        # No room: an answer to the same question asked when the run had spent less (a card proposing the
        # ceiling), or a ceiling lowered since. Ask again rather than spend on.
        _park(run, run.cursor, park)
        return False
    run.cost_limit = Decimal(_as_stored(limit))
    with transaction.atomic():
        run.owned()
        Run.objects.filter(pk=run.pk).update(cost_limit=run.cost_limit)
    return True


def _as_stored(amount: Decimal) -> str:
    """An amount as the database keeps it (six places, never rounded up): a budget card's question (its
    `current`) reads the same in the job that set the limit and in any later one that reads it back."""
    return str(Decimal(amount).quantize(Decimal("0.000001"), rounding=ROUND_DOWN))


def _park(run: Run, seq: int, park: Park, record: Callable[..., None] | None = None) -> None:
    """Open the card (if any) and park the run, in one transaction. `record` writes the step's row (waiting:
    resuming it is not a new attempt)."""
    with transaction.atomic():
        reason, paused_switch = park.reason, ""
        if record is not None:
            run.owned()
            record(status=Step.Status.WAITING, error="", output=None, ended_at=None)
        if park.kill_switch_channel is not None:
            # The switch was seen in the receipt's transaction, which has ended: re-check it under its lock
            # (Channel.killed_for_effects), or a release committed in between would miss this run and leave it
            # paused for good.
            killed = Channel.killed_for_effects(park.kill_switch_channel)
            if killed is None:
                run.release()
                return
            reason, paused_switch = killed.describe(park.kill_switch_channel), killed.switch
        parked = run.park(paused=park.paused, reason=reason, paused_switch=paused_switch)
        if parked and park.request is not None:
            gates.backend().open(run, seq, park.request)


def _stop(run: Run, workflow: Workflow, result: dict, undo: str = "") -> None:
    """The run stops (a cancel, a person's stop): cancelled, or undone (`undo`, or a cancel and undo requested,
    as the run's row last said) when it has something to undo."""
    reason = undo or run.undo_reason
    with transaction.atomic():
        if reason and (run.undo_reason or compensations.to_undo(compensations.registry(run, workflow))):
            run.start_undo(reason, cause=result)
            log.info("run stops: undoing it", reason=reason)
        else:
            run.finish(Run.Status.CANCELLED, result)
            log.info("run finished", status=Run.Status.CANCELLED)


def _finish(run: Run, result) -> None:
    with transaction.atomic():
        run.finish(Run.Status.SUCCEEDED, result)
    log.info("run finished", status=Run.Status.SUCCEEDED)


def _fail(
    run: Run, exc: BaseException, job: JobInfo, step: str | None = None, workflow: Workflow | None = None
) -> None:
    """The run failed for good: it goes to the dead-letter queue with what an on-call person needs. `step`: the
    step it failed at, when not the one at its cursor. With `workflow`, a run with effects to undo is undone first
    (or a person is asked: runs.compensations), then dead-lettered. A compensation that failed for good parks the
    run `compensation_failed` instead."""
    error = f"{exc.__class__.__name__}: {exc}"
    if run.status == Run.Status.COMPENSATING:
        compensations.failed(run, error)
        log.error("compensation failed for good", error=error)
        return
    if step is None:
        step = Step.objects.filter(run=run, seq=run.cursor).values_list("name", flat=True).first() or ""
    attempts = _step_attempts(run, job)
    letter = {
        "error": error,
        "error_class": exc.__class__.__name__,
        "traceback": "".join(traceback.format_exception(exc)),
        "attempts": attempts,
        "step": step,
        "job_id": job.job_id,
    }
    if workflow is not None and compensations.wants_undo_on_failure(run, workflow):
        with transaction.atomic():  # the letter waits in the run's result (its traceback's end) until the undo ends
            run.start_undo("failed", cause={**letter, "traceback": letter["traceback"][-20_000:]})
        log.warning("run failed for good: undoing what it did", error=error, step=step or None, policy=workflow.undo)
        return
    with transaction.atomic():
        run.fail(error)
        _dead_letter(run, letter)
    log.error("run failed", error=error, step=step or None, attempts=attempts)


def _dead_letter(run: Run, letter: dict) -> None:
    """The run's dead letter and its audit entry, in the caller's transaction (the run's failure, or its undo's end)."""
    DeadLetter.objects.create(
        run_id=run.id,
        workflow=run.workflow,
        input=run.input,
        error=letter.get("error", ""),
        error_class=letter.get("error_class", ""),
        traceback=letter.get("traceback", ""),
        attempts=letter.get("attempts", 0),
        step=letter.get("step", ""),
        trace_id=run.trace_id,
        job_id=letter.get("job_id"),
    )
    run.audit("run.dead_letter", {"error": letter.get("error", ""), "step": letter.get("step", "")})


def _wait_for_retry(run: Run, exc: BaseException, job: JobInfo) -> None:
    attempts = _step_attempts(run, job)
    with transaction.atomic():
        run.retry_later(f"{exc.__class__.__name__}: {exc}", attempts)
    log.warning("step will be retried", error=str(exc), attempt=attempts)


def record_retry(run: Run, cause: str = "", exc: BaseException | None = None, **extra) -> None:
    """One `run.retry` audit entry per retry, with its cause, which the database would not keep otherwise (a
    retried step's row is reused): console.monitoring counts retries by cause from them. Causes: `owner_gone`,
    `shutdown`, or who failed (`model` in a compute step, `tool` in others, `engine` outside any step) and how
    (`429`, `5xx`, `timeout`, `error`), read from the error the clients raise; the recovery sweep's `owner_gone` and
    `no_job` (runs.recovery). `extra` goes into the entry's data."""
    step = Step.objects.filter(run=run, seq=run.cursor).values("name", "kind").first() or {"name": "", "kind": None}
    data = {"step": step["name"], **extra}
    if exc is not None:
        data["error"] = text = f"{exc.__class__.__name__}: {exc}"
        how = next((h for h, p in _RETRY_HOW if re.search(p, text, re.IGNORECASE)), "error")
        source = {"compute": "model", None: "engine"}.get(step["kind"], "tool")
        cause = f"{source}_{how}"
    with transaction.atomic():
        run.audit("run.retry", {"cause": cause, **data})


_RETRY_HOW = [("429", r"\b429\b"), ("5xx", r"\b5\d\d\b"), ("timeout", r"time(d )?out")]


def _make(setting: str, run: Run, step_def: StepDef):
    factory = getattr(settings, setting)
    return _factory(factory)(run, step_def.name) if factory else None


@functools.cache
def _factory(path: str) -> Callable:
    """The factory at a dotted path, imported once per path (not on every step)."""
    return import_string(path)


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


def _log_step(step_def: StepDef, seq: int, status: str, started: float, ctx: Context, **extra) -> None:
    log.info(
        "step",
        step=step_def.name,
        seq=seq,
        kind=step_def.kind,
        status=status,
        latency_ms=_ms(started),
        tokens_in=ctx.usage.tokens_in,
        tokens_out=ctx.usage.tokens_out,
        idempotency_key=ctx.last_effect_key,
        **extra,
    )
