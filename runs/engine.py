"""The engine: advances one run, step by step, from its last checkpoint until it finishes or parks.

One `advance_run` job per run at a time (runs.tasks) calls `advance()`. Each step is checkpointed in its own
transaction (Step row + run cursor + totals); a done step is replayed from the database, never re-executed.
Between steps the engine checks cancellation, worker shutdown and the cost limit; kill switches are checked
where effects start (runs.workflow._open_receipt). Errors are classified: Fatal goes to the dead-letter queue
at once, anything else is retried by the job (exponential backoff with full jitter) until attempts run out.
"""

from __future__ import annotations

import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal

import structlog
from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone
from django.utils.module_loading import import_string

from console.models import AuditEntry, Channel
from jobs.models import DeadLetter
from jobs.retry import BackoffWithJitter
from runs import gates
from runs import workflow as workflows
from runs.gates import ApprovalRequest, canonical_hash
from runs.models import Run, Step
from runs.workflow import Ambiguous, Context, Fatal, Park, StepDef, UnknownWorkflow, Workflow

log = structlog.get_logger("runs.engine")


@dataclass
class JobInfo:
    """What the worker tells the engine about the job that runs it."""

    job_id: int | None = None
    attempts: int = 0  # earlier attempts of this job
    should_stop: Callable[[], bool] = field(default=lambda: False)


def advance(run_id, job: JobInfo | None = None) -> None:
    job = job or JobInfo()
    run = _claim(run_id)
    if run is None:
        return
    with structlog.contextvars.bound_contextvars(run_id=str(run.id), trace_id=run.trace_id, job_id=job.job_id):
        try:
            _drive(run, workflows.get(run.workflow, run.workflow_version), job)
        except (Fatal, UnknownWorkflow) as exc:
            _fail(run, exc, job)
        except Exception as exc:
            if _out_of_attempts(run, exc, job):
                _fail(run, exc, job)
                return
            _wait_for_retry(run, exc, job)
            _record_retry(run, exc=exc)
            raise  # the job's retry strategy schedules the next attempt


def _step_attempts(run: Run, job: JobInfo) -> int:
    """Executions of the step at the cursor so far (a worker crash counts as one): the retry budget is per
    step, not per job, which carries its attempts across steps."""
    cursor = Run.objects.filter(pk=run.pk).values("cursor")[:1]
    return Step.objects.filter(run=run, seq=cursor).values_list("attempt", flat=True).first() or job.attempts + 1


def _out_of_attempts(run: Run, exc: Exception, job: JobInfo) -> bool:
    if isinstance(exc, Ambiguous):
        # A write that may have happened is never given up on before it is reconciled: the next attempt asks
        # the tool's lookup, or a person, before anything else. Only the job backstop ends that.
        return job.attempts + 1 >= BackoffWithJitter.MAX_JOB_ATTEMPTS
    return _step_attempts(run, job) >= run.max_attempts


def _claim(run_id) -> Run | None:
    """Mark the run running, unless it has nothing to do or its tenant is at its cap (then it waits)."""
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(pk=run_id).first()
        if run is None or run.status not in (Run.Status.QUEUED, Run.Status.RUNNING):
            return None  # parked, finished, or a duplicate job: nothing to do
        if run.status == Run.Status.QUEUED:
            if run.cancel_requested:
                _finish(run, Run.Status.CANCELLED, {"outcome": "cancelled"})
                return None
            if not _tenant_has_room(run.tenant):
                run.enqueue(delay=settings.TENANT_WAIT_SECONDS)
                return None
            run.status = Run.Status.RUNNING
            run.save(update_fields=["status", "updated_at"])
        else:  # still running: its worker died (killed, crashed, or outlived its shutdown timeout)
            _record_retry(run, "worker_crash")
        return run


def _tenant_has_room(tenant: str) -> bool:
    # Serialise claims of one tenant, or two workers could both see room for one more.
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"tenant:{tenant}"])
    running = Run.objects.filter(tenant=tenant, status=Run.Status.RUNNING).count()
    return running < settings.TENANT_MAX_RUNNING


def _drive(run: Run, workflow: Workflow, job: JobInfo) -> None:
    while True:
        run.refresh_from_db()
        if run.status != Run.Status.RUNNING:
            return
        if run.cancel_requested:
            _finish(run, Run.Status.CANCELLED, {"outcome": "cancelled"})
            return
        if job.should_stop():
            _requeue(run, "worker shutting down")
            _record_retry(run, "shutdown")
            return
        if run.cursor >= len(workflow.steps):
            last = Step.objects.filter(run=run).order_by("-seq").values_list("output", flat=True).first()
            _finish(run, Run.Status.SUCCEEDED, last)
            return
        if not _within_budget(run, workflow):
            return
        if not _run_step(run, workflow, workflow.steps[run.cursor]):
            return


def _outputs(run: Run) -> dict:
    return dict(Step.objects.filter(run=run, status=Step.Status.DONE).order_by("seq").values_list("name", "output"))


def _run_step(run: Run, workflow: Workflow, step_def: StepDef) -> bool:
    """Run (or resume) the step at the cursor. True when the run goes on, False when it parked or ended."""
    seq = run.cursor
    outputs = _outputs(run)
    step_input = {"input": run.input, "outputs": outputs}
    input_hash = canonical_hash(step_input)
    with transaction.atomic():
        step, created = Step.objects.select_for_update().get_or_create(
            run=run,
            seq=seq,
            defaults={
                "name": step_def.name,
                "kind": step_def.kind,
                "input": step_input,
                "input_hash": input_hash,
                "started_at": timezone.now(),
            },
        )
        if not created:
            if step.input_hash != input_hash:
                raise Fatal(
                    f"the input of step {seq} ({step_def.name}) changed since it was checkpointed: "
                    "refusing to re-run it on different input"
                )
            step.attempt += 1
            step.status, step.error, step.started_at = Step.Status.RUNNING, "", timezone.now()
            step.save(update_fields=["attempt", "status", "error", "started_at"])

    model, tools = _make("AGENT_MODEL", run, step_def), _make("AGENT_TOOLS", run, step_def)
    ctx = Context(run, step_def, seq, outputs, model=model, tools=tools)
    started = time.perf_counter()
    try:
        output = step_def.fn(ctx)
    except Park as park:
        _park(run, seq, park)
        _log_step(step_def, seq, "parked", started, ctx, reason=park.reason)
        return False
    except Exception as exc:
        status = Step.Status.UNKNOWN if isinstance(exc, Ambiguous) else Step.Status.FAILED
        Step.objects.filter(pk=step.pk).update(
            status=status,
            error=f"{exc.__class__.__name__}: {exc}",
            latency_ms=_ms(started),
            tokens_in=ctx.usage.tokens_in,
            tokens_out=ctx.usage.tokens_out,
            cost=ctx.usage.cost,
        )
        _log_step(step_def, seq, status, started, ctx, error=str(exc))
        raise

    with transaction.atomic():
        Step.objects.filter(pk=step.pk).update(
            status=Step.Status.DONE,
            output=output,
            latency_ms=_ms(started),
            ended_at=timezone.now(),
            tokens_in=ctx.usage.tokens_in,
            tokens_out=ctx.usage.tokens_out,
            cost=ctx.usage.cost,
        )
        moved = Run.objects.filter(pk=run.pk, cursor=seq, status=Run.Status.RUNNING).update(
            cursor=seq + 1,
            attempt=0,
            error="",
            updated_at=timezone.now(),
            tokens_in=F("tokens_in") + ctx.usage.tokens_in,
            tokens_out=F("tokens_out") + ctx.usage.tokens_out,
            cost=F("cost") + ctx.usage.cost,
        )
        if not moved:
            raise RuntimeError(f"run {run.id} moved while step {seq} ran")  # rolls the checkpoint back
    _log_step(step_def, seq, "done", started, ctx)

    if step_def.kind == Step.Kind.GATE and isinstance(output, dict) and output.get("decision") == "rejected":
        result = {
            "outcome": "rejected",
            "step": step_def.name,
            "comment": output.get("comment", ""),
            "reason": output.get("reason", ""),
            "by": output.get("by", ""),
        }
        if workflow.on_reject == "fail":
            _fail(run, Fatal(f"rejected at {step_def.name}: {output.get('comment', '')}"), JobInfo())
        else:
            _finish(run, Run.Status.SUCCEEDED, result)
        return False
    return True


def _within_budget(run: Run, workflow: Workflow) -> bool:
    """Past its cost limit a run parks with a budget card: a person extends the limit or stops the run."""
    if run.cost_limit is None or run.cost < run.cost_limit:
        return True
    channel = next((s.channel for s in workflow.steps if s.channel), "payments")
    request = ApprovalRequest(
        channel=channel,
        kind=gates.Kind.BUDGET,
        proposed={"cost_limit": str(max(run.cost_limit * 2, run.cost + Decimal("0.01")))},
        current={"cost": str(run.cost), "cost_limit": str(run.cost_limit)},
        summary=f"The run has spent {run.cost} against a limit of {run.cost_limit}. Extend the limit or stop.",
        rule_id="cost-limit",
        risk="medium",
    )
    decision = gates.backend().decision(run, run.cursor, request)
    if decision is None:
        _park(run, run.cursor, Park(f"cost limit {run.cost_limit} reached", request, paused=True))
        return False
    if decision.rejected:
        _finish(
            run,
            Run.Status.CANCELLED,
            {"outcome": "stopped at cost limit", "by": decision.by, "comment": decision.comment},
        )
        return False
    Run.objects.filter(pk=run.pk).update(cost_limit=Decimal(str((decision.payload or {})["cost_limit"])))
    return True


def _park(run: Run, seq: int, park: Park) -> None:
    """Open the card (if any) and park the run, in one transaction."""
    with transaction.atomic():
        reason, paused_switch = park.reason, ""
        if park.kill_switch_channel is not None:
            # The switch was seen in the receipt's transaction, which has ended: re-check it under its lock
            # (FOR SHARE), or a release committed in between would miss this run and leave it paused for good.
            killed = Channel.killed_for_effects(park.kill_switch_channel)
            if killed is None:
                Run.objects.filter(pk=run.pk).update(status=Run.Status.QUEUED, updated_at=timezone.now())
                run.enqueue()
                return
            reason, paused_switch = killed.describe(park.kill_switch_channel), killed.switch
        if park.request is not None:
            gates.backend().open(run, seq, park.request)
        status = Run.Status.PAUSED if park.paused else Run.Status.WAITING_HUMAN
        Run.objects.filter(pk=run.pk).update(
            status=status, pause_reason=reason, paused_switch=paused_switch, updated_at=timezone.now()
        )


def _finish(run: Run, status: str, result) -> None:
    with transaction.atomic():
        Run.objects.filter(pk=run.pk).update(
            status=status, result=result, finished_at=timezone.now(), updated_at=timezone.now()
        )
        if status == Run.Status.CANCELLED:
            gates.backend().close_pending(run, "cancelled")
    log.info("run finished", status=status)


def _fail(run: Run, exc: BaseException, job: JobInfo) -> None:
    """The run failed for good: it goes to the dead-letter queue with what an on-call person needs."""
    step = Step.objects.filter(run=run, seq=run.cursor).first()
    error = f"{exc.__class__.__name__}: {exc}"
    with transaction.atomic():
        Run.objects.filter(pk=run.pk).update(
            status=Run.Status.FAILED, error=error, finished_at=timezone.now(), updated_at=timezone.now()
        )
        DeadLetter.objects.create(
            run_id=run.id,
            workflow=run.workflow,
            input=run.input,
            error=error,
            error_class=exc.__class__.__name__,
            traceback="".join(traceback.format_exception(exc)),
            attempts=_step_attempts(run, job),
            step=step.name if step else "",
            trace_id=run.trace_id,
            job_id=job.job_id,
        )
        gates.backend().close_pending(run, "cancelled")
        AuditEntry.record(
            "run.dead_letter",
            actor="engine",
            target=f"run:{run.id}",
            run_id=run.id,
            trace_id=run.trace_id,
            data={"error": error, "step": step.name if step else ""},
        )
    log.error("run failed", error=error, step=step.name if step else None, attempts=_step_attempts(run, job))


def _wait_for_retry(run: Run, exc: BaseException, job: JobInfo) -> None:
    attempts = _step_attempts(run, job)
    Run.objects.filter(pk=run.pk).update(
        status=Run.Status.QUEUED,
        attempt=attempts,
        error=f"{exc.__class__.__name__}: {exc}",
        updated_at=timezone.now(),
    )
    log.warning("step will be retried", error=str(exc), attempt=attempts)


def _requeue(run: Run, reason: str) -> None:
    with transaction.atomic():
        Run.objects.filter(pk=run.pk).update(status=Run.Status.QUEUED, updated_at=timezone.now())
        run.enqueue()
    log.info("run requeued", reason=reason)


def _record_retry(run: Run, cause: str = "", exc: BaseException | None = None) -> None:
    """One `run.retry` audit entry per retry, with its cause, which the database would not keep otherwise (a
    retried step's row is reused): console.monitoring counts retries by cause from them. Causes: `worker_crash`,
    `shutdown`, or who failed (`model` in a compute step, `tool` in others, `engine` outside any step) and how
    (`429`, `5xx`, `timeout`, `error`), read from the error the clients raise."""
    step = Step.objects.filter(run=run, seq=run.cursor).values("name", "kind").first() or {"name": "", "kind": None}
    data = {"step": step["name"]}
    if exc is not None:
        data["error"] = text = f"{exc.__class__.__name__}: {exc}"
        how = next((h for h, p in _RETRY_HOW if re.search(p, text, re.IGNORECASE)), "error")
        source = {"compute": "model", None: "engine"}.get(step["kind"], "tool")
        cause = f"{source}_{how}"
    with transaction.atomic():
        AuditEntry.record(
            "run.retry",
            actor="engine",
            target=f"run:{run.id}",
            run_id=run.id,
            trace_id=run.trace_id,
            data={"cause": cause, **data},
        )


_RETRY_HOW = [("429", r"\b429\b"), ("5xx", r"\b5\d\d\b"), ("timeout", r"time(d )?out")]


def _make(setting: str, run: Run, step_def: StepDef):
    return import_string(getattr(settings, setting))(run, step_def.name)


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
