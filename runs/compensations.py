"""Undo: compensations for what a run already did (docs/workflows.md, "Compensations").

A workflow declares, next to an effect, the action that undoes it (`Compensation`: `@wf.effect(..., compensate=...)`,
`@tool(kind="effect", compensate=...)`), with an optional deadline after which it is no longer possible and an
optional gate (a person says yes on a card first). When a run cannot finish as it should, its engine job undoes it:
the compensations of the effects that completed run in reverse order, each through its own receipt (the one door of
effects, runs.effects: its own key, kill switches, breakers, shadow mode, an ambiguous call reconciled like any
write), each at most once, across crashes and restarts.

An undo begins (Run.undo_reason says why):
- `failed`: a step failed for good. Under the workflow's policy (`Workflow.undo`): `ask` (the default) a person is
  asked on a card whether to undo (no: the run goes to the dead-letter queue as before); `always` it is undone at
  once; `never` it is not. An undone failed run is dead-lettered too, with the undo's history.
- `rejected`: a person rejected a gate with "reject and undo";
- `cancelled`: ops cancelled the run with "cancel and undo" (`cancel_and_undo`);
- `budget`: a budget card was rejected with "stop and undo" (or under the policy `always`).

The run is `compensating` while its job undoes it, `compensated` once every compensation ran (or a person declined
a gated one, or took a failed one over by hand), `compensation_failed` when one failed for good: parked, with a card
(try again, or a person does it by hand). The registry (`registry`) says, per completed effect, whether it can still
be undone, until when, and what undid it, by whom; the audit log has one `run.compensation` entry per compensation.
An external agent's run is undone by its agent (external.undo, registered here as `external`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from django.db import transaction
from django.utils import timezone

from core.models import AuditEntry
from runs import gates
from runs import workflow as workflows
from runs.errors import Fatal, Park, UndoRefused, UnknownWorkflow
from runs.gates import ApprovalRequest, Kind
from runs.models import EXTERNAL_WORKFLOW, Receipt, Run, Step
from runs.steps import Compensation, Context, StepDef

__all__ = [
    "POLICIES",
    "Compensation",
    "Entry",
    "ExternalUndo",
    "cancel_and_undo",
    "check_undo",
    "register_external",
    "registry",
]

POLICIES = ("ask", "always", "never")  # Workflow.undo: what a failure for good does to a run that can be undone
UNDO_PREFIX = Receipt.UNDO_PREFIX  # a compensation's receipt key: the prefix, then its effect's key


@dataclass
class Entry:
    """One completed effect of a run, as the registry shows it."""

    key: str
    step: str
    seq: int
    channel: str
    completed_at: datetime
    answer: Any
    shadow: bool = False
    compensation: Compensation | None = None
    step_def: StepDef | None = None
    # What undid it: "" (not undone), "done", "declined" (a person said no on its gated card), "by_hand" (its
    # compensation failed and a person took it over), "failed" (failed for good, waiting for a person)
    outcome: str = ""
    undone_at: datetime | None = None
    undone_by: str = ""
    undo_answer: Any = None
    error: str = ""
    audited: bool = False  # its compensation's `run.compensation` entry says "done"
    extra: dict = field(default_factory=dict)

    @property
    def deadline(self) -> datetime | None:
        if self.compensation is None or self.compensation.within is None:
            return None
        return self.completed_at + self.compensation.within

    @property
    def undo_key(self) -> str:
        return f"{UNDO_PREFIX}{self.key}"

    def why_not(self, now: datetime | None = None) -> str:
        """Why this effect cannot be undone now ("" when it can, or was)."""
        if self.shadow:
            return "never sent (shadow mode): nothing to undo"
        if self.compensation is None:
            return "no compensation declared: it cannot be undone"
        if self.outcome and self.outcome != "failed":
            return ""
        deadline = self.deadline
        if deadline is not None and (now or timezone.now()) > deadline:
            return f"past its deadline ({deadline.isoformat()}): it can no longer be undone"
        return ""

    @property
    def undoable(self) -> bool:
        return self.compensation is not None and not self.shadow

    def as_dict(self, now: datetime | None = None) -> dict:
        """The registry's entry as data (GET /api/runs/{id}, the run page)."""
        why_not = self.why_not(now)
        return {
            "key": self.key,
            "step": self.step,
            "seq": self.seq,
            "channel": self.channel,
            "completed_at": self.completed_at,
            "external_id": str((self.answer or {}).get("id", "")) if isinstance(self.answer, dict) else "",
            "can_undo": self.undoable and not self.outcome and not why_not,
            "why_not": why_not,
            "undo_until": self.deadline,
            "needs_approval": bool(self.compensation and self.compensation.approval),
            "compensation": {
                "outcome": self.outcome,
                "at": self.undone_at,
                "by": self.undone_by,
                "answer": self.undo_answer,
                "error": self.error,
            }
            if self.outcome
            else None,
            **self.extra,
        }


class ExternalUndo(Protocol):
    """The external agents' side (external.undo), registered by that app: an external run's registry, and its
    cancel and undo (approval requests of its compensations, which its agent runs)."""

    def registry(self, run: Run) -> list[Entry]: ...

    def begin(self, run: Run, by) -> Run: ...


external: ExternalUndo | None = None


def register_external(backend: ExternalUndo) -> None:
    global external
    external = backend


# --- the registry ------------------------------------------------------------------------------------------------


def registry(run: Run, workflow=None) -> list[Entry]:
    """The run's completed effects in the order they completed, each with its declared compensation (from the
    workflow's code: an effect step's or an agent tool's), its deadline and what undid it."""
    if run.workflow == EXTERNAL_WORKFLOW:
        return external.registry(run) if external is not None else []
    if workflow is None:
        try:
            workflow = workflows.get(run.workflow, run.workflow_version)
        except UnknownWorkflow:
            workflow = None
    receipts = list(Receipt.objects.filter(run=run).order_by("completed_at", "pk"))
    undo_receipts = {r.key: r for r in receipts if r.key.startswith(UNDO_PREFIX)}
    shadow_keys = set(run.shadow_effects.values_list("key", flat=True))
    outputs = dict(Step.objects.filter(run=run, status=Step.Status.DONE).values_list("name", "output"))
    history = _history(run)
    entries = []
    for receipt in receipts:
        if receipt.key.startswith(UNDO_PREFIX) or receipt.status != Receipt.Status.DONE:
            continue
        step_def = _step_at(workflow, receipt.step_seq, outputs)
        entry = Entry(
            key=receipt.key,
            step=step_def.name if step_def else "",
            seq=receipt.step_seq,
            channel=receipt.channel,
            completed_at=receipt.completed_at,
            answer=receipt.response,
            shadow=receipt.key in shadow_keys,
            compensation=step_def.compensation if step_def else None,
            step_def=step_def,
        )
        done = undo_receipts.get(entry.undo_key)
        recorded = history.get(entry.key)
        if recorded is not None:
            entry.outcome, entry.undone_by, entry.error = recorded["outcome"], recorded["by"], recorded["error"]
            entry.undone_at, entry.audited = recorded["at"], recorded["outcome"] == "done"
        if done is not None and done.status == Receipt.Status.DONE:
            entry.outcome, entry.undone_at, entry.undo_answer = "done", done.completed_at, done.response
            entry.error = ""
        entries.append(entry)
    return entries


def _step_at(workflow, seq: int, outputs: dict) -> StepDef | None:
    if workflow is None:
        return None
    try:
        return workflow.step_at(seq, outputs)
    except (KeyError, AttributeError, TypeError):
        return None


def _history(run: Run) -> dict[str, dict]:
    """The latest `run.compensation` audit entry per effect key: what happened to its compensation, who said."""
    found = {}
    for at, data in (
        AuditEntry.objects.filter(run_id=run.id, action="run.compensation").order_by("pk").values_list("at", "data")
    ):
        found[data.get("effect", "")] = {
            "outcome": data.get("outcome", ""),
            "by": data.get("by", ""),
            "error": data.get("error", ""),
            "at": at,
        }
    return found


def to_undo(entries: list[Entry]) -> list[Entry]:
    """What an undo compensates: the effects with a compensation, not yet undone, latest completed first."""
    return [e for e in reversed(entries) if e.undoable and e.outcome in ("", "failed")]


def check_undo(run: Run, workflow=None) -> list[Entry]:
    """Refuses (UndoRefused) an undo that cannot be done: nothing to undo, or an effect past its compensation's
    deadline. Returns what it would compensate."""
    if run.is_finished:
        raise UndoRefused(f"the run has finished ({run.status}): it can no longer be cancelled and undone")
    if run.undo_reason or run.status in (Run.Status.COMPENSATING, Run.Status.COMPENSATION_FAILED):
        raise UndoRefused(f"the run is already being undone ({run.status})")
    entries = registry(run, workflow)
    pending = to_undo(entries)
    if not pending:
        done = [e for e in entries if not e.shadow]
        if not done:
            raise UndoRefused("nothing to undo: the run has not completed any effect")
        raise UndoRefused(
            "nothing to undo: "
            + "; ".join(f"{e.step or e.key} on {e.channel}: {e.why_not() or 'already undone'}" for e in done)
        )
    late = [e for e in pending if e.why_not()]
    if late:
        raise UndoRefused(
            "cannot undo: " + "; ".join(f"{e.step or e.key} on {e.channel} is {e.why_not()}" for e in late)
        )
    return pending


def check_undo_on_rejection(card) -> None:
    """A "reject and undo" on `card` (approvals.models.Approval.decide): only on a card that asks for an action or a
    budget of a run the engine drives, with something to undo."""
    if card.kind not in (Kind.ACTION, Kind.BUDGET):
        raise UndoRefused(f"a {card.kind} card cannot be rejected with an undo")
    check_undo(card.run)


def cancel_and_undo(run: Run, by) -> Run:
    """Ops' "cancel and undo" (the run page, POST /api/runs/{id}/cancel {"undo": true}): refused with nothing done
    when there is nothing the run can undo (UndoRefused). A queued or parked run goes back to the queue to be undone
    by its next job; a running one is undone by its owner, which sees the request at its next write; an external
    run's compensations are asked of its agent (external.undo)."""
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run.pk)
        if run.workflow == EXTERNAL_WORKFLOW:
            if external is None:
                raise UndoRefused("external runs cannot be undone in this deployment")
            return external.begin(run, by)
        check_undo(run)
        run.audit("run.cancel", {"status": run.status, "undo": True}, actor=by)
        if run.status == Run.Status.RUNNING:
            Run.objects.filter(pk=run.pk).update(cancel_requested=True, undo_reason="cancelled")
            run.cancel_requested, run.undo_reason = True, "cancelled"
        else:
            run.request_undo("cancelled")
        return run


# --- the engine's undo -------------------------------------------------------------------------------------------


def wants_undo_on_failure(run: Run, workflow) -> bool:
    """A run that failed for good is undone (or a person asked whether) when its policy says so and it has
    something to undo."""
    return workflow is not None and workflow.undo != "never" and bool(to_undo(registry(run, workflow)))


def wants_undo_on_stop(run: Run, workflow, asked: bool) -> bool:
    """A run stopped at a budget card: undone when the person asked (`asked`: stop and undo) or the policy is
    `always`, and it has something to undo."""
    return (asked or (workflow is not None and workflow.undo == "always")) and bool(to_undo(registry(run, workflow)))


ContextFor = Callable[[StepDef, int], Context]


def drive(run: Run, workflow, context_for: ContextFor, should_stop: Callable[[], bool] = lambda: False) -> str:
    """Undo `run` (its owner's job): returns "done" when every compensation ran or was declined or taken over by a
    person (the engine ends the run compensated), "declined" when a person answered that a failed run is not to
    be undone (the engine dead-letters it), or "stopped" when its worker is shutting down (`should_stop`, asked
    between compensations, as the engine asks between steps: the engine gives the run back to the queue). Raises
    Park (a card, or a kill switch), Wait (a breaker), and a compensation's errors, which the engine retries;
    Fatal when one cannot be done (past its deadline)."""
    if run.status == Run.Status.RUNNING:
        with transaction.atomic():
            run.start_undo()
    entries = registry(run, workflow)
    for entry in entries:
        if entry.outcome == "done" and not entry.audited:  # its receipt completed, then the job was cut off
            record(run, entry, "done", by="engine", answer=entry.undo_answer)
    pending = to_undo(entries)
    if run.undo_reason == "failed" and workflow.undo == "ask" and not _asked(run, pending):
        return "declined"
    for entry in pending:
        if should_stop():
            return "stopped"
        run.compensating = entry  # for the engine, should this compensation fail for good
        if _taken_over(run, entry):
            continue
        if entry.compensation.approval and not _approved(run, entry):
            continue
        _compensate(run, entry, context_for)
    run.compensating = None
    return "done"


def _asked(run: Run, pending: list[Entry]) -> bool:
    """The policy `ask`: a person says whether a run that failed for good is to be undone (Park until then)."""
    cause = (run.result or {}).get("cause", {})
    request = ApprovalRequest(
        channel=pending[0].channel if pending else "payments",
        kind=Kind.UNDO,
        proposed={"undo": [e.key for e in pending]},
        summary=(
            f"The run failed for good at {cause.get('step') or 'a step'}: {cause.get('error', '')}. Undo what it did "
            f"({'; '.join(_describe(e) for e in pending)})? If not, it goes to the dead-letter queue as it is."
        ),
        rule_id="undo-on-failure",
        risk="high",
    )
    decision = gates.backend().decision(run, run.cursor, request)
    if decision is None:
        raise Park("failed for good: undo what it did?", request, seq=run.cursor)
    return not decision.rejected  # the decision is audited with its card


def _approved(run: Run, entry: Entry) -> bool:
    """A gated compensation: a person says yes on a card first (Park until then). False when they said no: the
    effect stays done, recorded as declined."""
    request = ApprovalRequest(
        channel=entry.channel,
        kind=Kind.UNDO,
        proposed={"undo": entry.key, "answer": entry.answer},
        summary=f"Undo {_describe(entry)}?",
        rule_id="compensation",
        risk="high",
    )
    decision = gates.backend().decision(run, entry.seq, request)
    if decision is None:
        raise Park(f"undo {entry.step} on {entry.channel}: waiting for a person's yes", request, seq=entry.seq)
    if decision.rejected:
        record(run, entry, "declined", by=decision.by, comment=decision.comment)
        return False
    entry.undone_by = decision.by
    return True


def _taken_over(run: Run, entry: Entry) -> bool:
    """A compensation that failed for good, whose card a person answered: "I did it by hand" (True: recorded) or
    "try again" (False)."""
    if entry.outcome != "failed":
        return False
    decision = gates.backend().decision(run, entry.seq, failed_request(entry, entry.error))
    if decision is not None and decision.rejected:
        record(run, entry, "by_hand", by=decision.by, comment=decision.comment)
        return True
    return False


def _compensate(run: Run, entry: Entry, context_for: ContextFor) -> None:
    """One compensation, through its own receipt, at most once (a done receipt answers without a call)."""
    done = Receipt.objects.filter(key=entry.undo_key, status=Receipt.Status.DONE).exists()
    if not done and (why := entry.why_not()):
        raise Fatal(f"{entry.step} on {entry.channel} was not undone: {why}")
    compensation = entry.compensation
    ctx = context_for(entry.step_def, entry.seq)
    ctx.undoing = entry.key
    answer = ctx.effect(
        lambda key: compensation.call(ctx, key, entry.answer),
        key=entry.undo_key,
        lookup=(lambda key: compensation.lookup(ctx, key)) if compensation.lookup else None,
        preview={"undo": entry.key, "answer": entry.answer},
    )
    if not done:
        record(run, entry, "done", by=entry.undone_by or "engine", answer=answer)


def record(run: Run, entry: Entry, outcome: str, *, by: str = "", comment: str = "", error: str = "", answer=None):
    """A compensation's audit entry (`run.compensation`), by the run's owner; its outcome is what the registry
    shows. Written once per outcome."""
    with transaction.atomic():
        if run.owner:
            run.owned()
        audit_outcome(run, entry, outcome, by=by, comment=comment, error=error, answer=answer)
        entry.outcome, entry.undone_by, entry.error = outcome, by, error
        if outcome == "done" and run.owner:
            Run.objects.filter(pk=run.pk).update(attempt=0)  # the next compensation has its own attempts
            run.attempt = 0


def audit_outcome(run: Run, entry: Entry, outcome: str, *, by: str = "", actor: str = "engine", **extra) -> None:
    """The `run.compensation` audit entry of one compensation's outcome (`done`, `declined`, `by_hand`, `failed`),
    in the caller's transaction: what the registry reads. `extra`: its comment, error, answer... (None and ""
    are left out)."""
    data = {"effect": entry.key, "step": entry.step, "channel": entry.channel, "outcome": outcome, "by": by}
    data.update({name: value for name, value in extra.items() if value is not None and value != ""})
    run.audit("run.compensation", data, actor=actor, channel=entry.channel)


def failed_request(entry: Entry, error: str) -> ApprovalRequest:
    """The card of a compensation that failed for good: approve to try again, reject when a person did it by hand."""
    return ApprovalRequest(
        channel=entry.channel,
        kind=Kind.UNDO_FAILED,
        proposed={"undo": entry.key, "error": error},
        summary=(
            f"Undoing {_describe(entry)} failed for good: {error}. Approve to try again; reject once you have undone "
            "it by hand (say what you did)."
        ),
        rule_id="compensation-failed",
        risk="high",
    )


def failed(run: Run, error: str) -> None:
    """The compensation under way failed for good: the run parks `compensation_failed` with a card saying what
    was done, what could not be undone and the error; never silently. In one transaction."""
    entry: Entry | None = getattr(run, "compensating", None)
    with transaction.atomic():
        run.undo_failed(error)
        if entry is not None:
            audit_outcome(run, entry, "failed", by="engine", error=error)
            gates.backend().open(run, entry.seq, failed_request(entry, error))
        else:  # before any compensation began: the undo as a whole (Try again runs it again)
            channel = next((e.channel for e in to_undo(registry(run))), "payments")
            gates.backend().open(
                run,
                run.cursor,
                ApprovalRequest(
                    channel=channel,
                    kind=Kind.UNDO_FAILED,
                    proposed={"undo": "", "error": error},
                    summary=f"Undoing this run failed for good: {error}. Approve to try again.",
                    rule_id="compensation-failed",
                    risk="high",
                ),
            )


def result_of(run: Run, entries: list[Entry]) -> dict:
    """A compensated run's result: why it was undone, what ended its way forward, and each effect's outcome."""
    return {
        "outcome": "compensated",
        "reason": run.undo_reason,
        "cause": (run.result or {}).get("cause"),
        "effects": [
            {"key": e.key, "step": e.step, "channel": e.channel, "undo": e.outcome or e.why_not() or "not undone"}
            for e in entries
        ],
    }


def _describe(entry: Entry) -> str:
    compensation = entry.compensation
    if compensation is not None and compensation.describe is not None:
        try:
            return str(compensation.describe(entry.answer))[:300]
        except Exception:  # noqa: BLE001 - a description must never stop an undo
            pass
    return f"{entry.step} on {entry.channel} ({entry.key})"
