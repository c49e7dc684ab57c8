"""Runs pages: the list with status and workflow filters, and a run's page with its timeline, cards and
decisions; ops and the run's creator cancel from there. Who sees and cancels a run: runs.access."""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime

from django.contrib import messages
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import Model, Prefetch, Q, QuerySet
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from core import tracing
from core.access import may_operate_channel
from core.models import Channel
from core.views import HtmxHttpRequest
from runs import compensations, forks
from runs import replay as replays
from runs import workflow as workflows
from runs.access import may_operate_run, may_replay_or_fork, run_for, run_for_ops, visible_runs
from runs.errors import ForkRefused, TransitionRefused, UndoRefused
from runs.models import EXTERNAL_WORKFLOW, Receipt, Run, Step
from runs.workflow import UnknownWorkflow

PAGE_SIZE = 50


def _pretty(value) -> str:
    if value is None:
        return ""
    return json.dumps(value, indent=2, sort_keys=True, cls=DjangoJSONEncoder, ensure_ascii=False)


@require_GET
def run_list(request: HtmxHttpRequest):
    """Newest first, PAGE_SIZE a page, with a keyset cursor (`before`: the last row's created_at and id) instead
    of page numbers, so a page costs the same however many runs there are (no COUNT over them)."""
    runs = visible_runs(request.user).select_related("created_by").order_by("-created_at", "-pk")
    status = request.GET.get("status", "")
    workflow = request.GET.get("workflow", "")
    if status in Run.Status.values:
        runs = runs.filter(status=status)
    else:
        status = ""
    if workflow:
        runs = runs.filter(workflow=workflow)
    before = _cursor(request.GET.get("before", ""))
    if before is not None:
        runs = runs.filter(Q(created_at__lt=before[0]) | Q(created_at=before[0], pk__lt=before[1]))
    rows = list(runs[: PAGE_SIZE + 1])
    older = rows[PAGE_SIZE - 1] if len(rows) > PAGE_SIZE else None
    return render(
        request,
        "runs/list.html",
        {
            "runs": rows[:PAGE_SIZE],
            "older": f"{older.created_at.isoformat()}~{older.pk}" if older else "",
            "paged": before is not None,
            "status": status,
            "workflow": workflow,
            "statuses": Run.Status.choices,
            "workflows": sorted(set(workflows.names()) | ({workflow} - {""})),
        },
    )


def _cursor(value: str) -> tuple[datetime, uuid.UUID] | None:
    """A `before` cursor, or None for the first page (also when it is malformed: the newest runs, not a 500)."""
    at, _, pk = value.partition("~")
    try:
        created_at = datetime.fromisoformat(at)
        return (created_at, uuid.UUID(pk)) if created_at.tzinfo is not None else None
    except ValueError:
        return None


@require_GET
def run_detail(request: HtmxHttpRequest, pk):
    return render_run(request, run_for(request.user, pk))


def render_run(
    request: HtmxHttpRequest,
    run: Run,
    *,
    status: int = 200,
    outcome_form: dict | None = None,
    replay: dict | None = None,
):
    """The run's page (`status`: 200, or the refusal of a form posted from it, shown again with `outcome_form`:
    the step, outcome and text a person tried to record; `replay`: the report of "Replay on current code")."""
    steps = list(Step.objects.filter(run=run).order_by("seq"))
    for step in steps:
        step.input_json, step.output_json = _pretty(step.input), _pretty(step.output)
    # The cards with their decisions and notifications, reached through their relations to the run: the approvals
    # app builds on this one, which does not import it (pyproject.toml, [tool.importlinter]).
    decisions, notifications = (_rows_of(run.approvals.model, name) for name in ("decisions", "notifications"))
    cards = run.approvals.select_related("channel", "assigned_group").prefetch_related(
        Prefetch("decisions", queryset=decisions.select_related("actor").order_by("created_at")),
        Prefetch("notifications", queryset=notifications.select_related("group").order_by("created_at")),
    )
    cards = list(cards.order_by("created_at"))
    for card in cards:
        for decision in card.decisions.all():
            decision.payload_json = _pretty(decision.payload)
    can_cancel = not run.is_finished and run.cancellable and may_operate_run(request.user, run)
    effects = [entry.as_dict() for entry in compensations.registry(run)]
    return render(
        request,
        "runs/detail.html",
        {
            "run": run,
            "steps": steps,
            "timeline": timeline(run, steps, cards),
            "cards": cards,
            "result_json": _pretty(run.result),
            "input_json": _pretty(run.input),
            "can_cancel": can_cancel,
            "effects": effects,
            "undo_refusal": undo_refusal(run, effects) if can_cancel else "",
            "recordable": outcomes_to_record(request.user, run, steps),
            "outcome_form": outcome_form or {},
            "can_replay": may_replay_or_fork(request.user) and run.workflow != EXTERNAL_WORKFLOW,
            "replay": replay,
            "fork": fork_panel(request.user, run, steps),
            "trace_url": tracing.trace_url(run.trace_id),
        },
        status=status,
    )


def fork_panel(user, run: Run, steps: list[Step]) -> dict:
    """What the page shows of forks (runs.forks): the run it was forked from, the runs forked from it, and for ops
    and admins the steps it may be forked from (each recorded step whose steps before are done; the core says on the
    press whether the rest allows it), none while its record still moves."""
    fork_steps = []
    if may_replay_or_fork(user) and run.workflow != EXTERNAL_WORKFLOW and run.status not in Run.MOVING:
        for step in steps:
            fork_steps.append(step)
            if step.status != Step.Status.DONE:
                break
    return {
        "of": run.fork_of,
        "forks": list(run.forks.order_by("created_at", "pk")),
        "steps": fork_steps,
        "max_reason": forks.MAX_REASON,
    }


def undo_refusal(run: Run, effects: list[dict]) -> str:
    """Why "cancel and undo" is not offered on the run's page ("" when it is): the refusal the core would give
    (runs.compensations.check_undo), said beside the button instead of after a press."""
    if not effects and run.workflow != EXTERNAL_WORKFLOW:
        return "nothing to undo: the run has not completed any effect"
    if run.workflow == EXTERNAL_WORKFLOW:
        return ""  # its agent runs its compensations: the core says on the press whether it can (external.undo)
    try:
        compensations.check_undo(run)
    except UndoRefused as exc:
        return str(exc)
    return ""


def outcomes_to_record(user, run: Run, steps: list[Step]) -> set[int]:
    """The steps of an external run whose outcome `user` may record by hand (external.views.record_outcome): an
    execution whose outcome is unknown (its step `unknown`, its receipt pending: the agent consumed the approval
    and never reported), on a channel the user operates. Read here from the runs' own tables, so that this page
    offers the form without importing the external app above it."""
    if run.workflow != EXTERNAL_WORKFLOW:
        return set()
    unknown = {step.seq for step in steps if step.status == Step.Status.UNKNOWN}
    if not unknown:
        return set()
    pending = list(Receipt.objects.filter(run=run, step_seq__in=unknown, status=Receipt.Status.PENDING))
    channels = {channel.name: channel for channel in Channel.objects.filter(name__in={r.channel for r in pending})}
    return {
        receipt.step_seq
        for receipt in pending
        if receipt.channel in channels and may_operate_channel(user, channels[receipt.channel])
    }


def _rows_of(model: type[Model], relation: str) -> QuerySet:
    """Every row of the model at the other end of `model`'s relation (a card's decisions, its notifications)."""
    return model._meta.get_field(relation).related_model.objects.all()


def _agent_stages(run: Run) -> list[str]:
    try:
        definition = workflows.get(run.workflow, run.workflow_version)
    except UnknownWorkflow:
        return []
    return [s.name for s in definition.steps if s.kind == "agent"]


def timeline(run: Run, steps: list[Step], cards: list) -> list[dict]:
    """The run's steps as the page shows them: a fixed step as itself; an agent stage's steps as a conversation,
    each model turn (`<stage>.turn<N>`, its words, tokens and cost) with the tool calls it made
    (`<stage>.turn<N>.<i>.<tool>`: arguments, result, error or rejection, who decided, the card) and the answer
    (`<stage>`). Everything here is shown as text: the model's words and the tools' results are untrusted."""
    stages = _agent_stages(run)
    cards_at: dict[int, list] = {}
    for card in cards:
        cards_at.setdefault(card.step_seq, []).append(card)
    patterns = [
        (stage, re.compile(rf"{re.escape(stage)}\.turn(\d+)"), re.compile(rf"{re.escape(stage)}\.turn(\d+)\.(\d+)\..+"))
        for stage in stages
    ]
    entries: list[dict] = []
    turns: dict[tuple[str, int], dict] = {}
    for step in steps:
        entry = None
        for stage, turn_re, call_re in patterns:
            if step.name == stage and step.kind == "compute":
                output = step.output if isinstance(step.output, dict) else {}
                entry = {"type": "answer", "stage": stage, "step": step, "answer": output.get("answer", "")}
                entry["turns"] = output.get("turns")
            elif match := turn_re.fullmatch(step.name):
                entry = _turn(stage, int(match.group(1)), step, cards_at.get(step.seq, []))
                turns[(stage, entry["number"])] = entry
            elif (match := call_re.fullmatch(step.name)) and (stage, int(match.group(1))) in turns:
                turn = turns[(stage, int(match.group(1)))]
                turn["calls"].append(_call(turn, int(match.group(2)) - 1, step, cards_at.get(step.seq, [])))
                entry = False  # shown inside its turn
            if entry is not None:
                break
        if entry is None:
            entry = {"type": "step", "step": step}
        if entry:
            entries.append(entry)
    return entries


def _turn(stage: str, number: int, step: Step, cards: list) -> dict:
    message = step.output if isinstance(step.output, dict) else {}
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    return {
        "type": "turn",
        "stage": stage,
        "number": number,
        "step": step,
        "content": message.get("content") or "",
        "model": message.get("model") or "",
        "max_turns": message.get("max_turns"),
        "tool_calls": calls,
        "calls": [],
        "cards": cards,
    }


def _arguments_text(raw) -> str:
    """The arguments as the model wrote them: pretty JSON when they are JSON, else the text itself."""
    if isinstance(raw, str):
        try:
            return _pretty(json.loads(raw))
        except ValueError:
            return raw
    return _pretty(raw)


def _call(turn: dict, index: int, step: Step, cards: list) -> dict:
    asked = turn["tool_calls"][index] if index < len(turn["tool_calls"]) else {}
    function = asked.get("function") or {}
    output = step.output if isinstance(step.output, dict) else {}
    call = {
        "step": step,
        "tool": output.get("tool") or function.get("name") or step.name.rsplit(".", 1)[-1],
        "call_id": output.get("call_id") or asked.get("id", ""),
        "arguments_json": _arguments_text(function.get("arguments") or "{}"),
        "cards": cards,
        "outcome": step.status,
    }
    if step.status != Step.Status.DONE:
        return call
    if "error" in output:
        call.update(outcome="error", error=output["error"], details=output.get("details") or [])
    elif "rejected" in output:
        rejected = output["rejected"] or {}
        call.update(outcome="rejected", rejected=rejected, repeat=bool(output.get("repeat")))
    else:
        call.update(outcome="done", result_json=_pretty(output.get("result")))
        if output.get("approved_by"):
            call.update(approved_by=output["approved_by"], edited=bool(output.get("edited")))
            if output.get("edited"):
                call["executed_json"] = _pretty(output.get("arguments"))
    return call


@require_POST
def run_cancel(request: HtmxHttpRequest, pk):
    """Cancel, or with `undo` posted (the "Cancel and undo" button), cancel and undo (runs.compensations): refused
    with nothing done, and said why, when the run has nothing it can undo."""
    run = run_for(request.user, pk, to_operate=True)
    if run.is_finished:
        messages.info(request, f"The run had already finished ({run.status}).")
    elif request.POST.get("undo"):
        try:
            run = compensations.cancel_and_undo(run, request.user)
        except UndoRefused as exc:
            messages.error(request, f"Not cancelled, nothing undone: {exc}.")
        else:
            messages.success(request, "Cancelled: what the run did is being undone, latest first.")
    else:
        try:
            run = run.cancel(by=request.user)
        except TransitionRefused as exc:
            messages.error(request, f"Not cancelled: {exc}.")
            return redirect("run", pk=run.pk)
        if run.status == Run.Status.CANCELLED:
            messages.success(request, "Run cancelled.")
        else:
            messages.info(request, "Cancellation requested: the run stops after its current step.")
    return redirect("run", pk=run.pk)


@require_POST
def run_replay(request: HtmxHttpRequest, pk):
    """Replay on current code (runs.replay), for ops and admins: the run's page with the report, side by side with
    the record where it diverges. Nothing is called, sent or changed; a run that cannot be replayed says why."""
    run = run_for_ops(request.user, pk, "replay")
    try:
        report = replays.replay(run)
    except replays.NotReplayable as exc:
        messages.error(request, f"Not replayed: {exc}.")
        return redirect("run", pk=run.pk)
    shown = report.as_dict()
    if report.divergence is not None:
        shown["recorded_json"] = _pretty(report.divergence.recorded)
        shown["replayed_json"] = _pretty(report.divergence.replayed)
    return render_run(request, run, replay=shown)


@require_POST
def run_fork(request: HtmxHttpRequest, pk):
    """Fork the run from the posted step for the posted reason (runs.forks), then show the fork; refused with nothing
    made, and said why, on the run's page."""
    run = run_for_ops(request.user, pk, "fork")
    try:
        from_step = int(request.POST.get("from_step", ""))
    except ValueError:
        messages.error(request, "Not forked: choose the step to fork from.")
        return redirect("run", pk=run.pk)
    try:
        child = forks.fork(run, from_step, request.POST.get("reason", ""), request.user)
    except ForkRefused as exc:
        messages.error(request, f"Not forked: {exc}.")
        return redirect("run", pk=run.pk)
    messages.success(request, f"Forked from step {from_step}: this run reuses the original's steps before it.")
    return redirect("run", pk=child.pk)
