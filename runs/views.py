"""Runs pages: the list with status and workflow filters, and a run's page with its timeline, cards and
decisions; ops and the run's creator cancel from there."""

from __future__ import annotations

import json
import uuid
from datetime import datetime

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import Prefetch, Q
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from runs import workflow as workflows
from runs.api import can_operate_run
from runs.models import Run, Step

PAGE_SIZE = 50


def _get_run_for_user(request, pk) -> Run:
    """404 for a run the user may not see (an outsider learns nothing about it)."""
    run = get_object_or_404(Run.objects.select_related("created_by"), pk=pk)
    if not run.is_visible_to(request.user):
        raise Http404("No such run.")
    return run


def _pretty(value) -> str:
    if value is None:
        return ""
    return json.dumps(value, indent=2, sort_keys=True, cls=DjangoJSONEncoder, ensure_ascii=False)


@require_GET
def run_list(request):
    """Newest first, PAGE_SIZE a page, with a keyset cursor (`before`: the last row's created_at and id) instead
    of page numbers, so a page costs the same however many runs there are (no COUNT over them)."""
    runs = Run.visible_to(request.user).select_related("created_by").order_by("-created_at", "-pk")
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
def run_detail(request, pk):
    run = _get_run_for_user(request, pk)
    steps = list(Step.objects.filter(run=run).order_by("seq"))
    for step in steps:
        step.input_json, step.output_json = _pretty(step.input), _pretty(step.output)
    # The runs app's models know nothing of cards; this page, on top of both apps, shows them.
    from approvals.models import Decision, Notification

    cards = run.approvals.select_related("channel", "assigned_group").prefetch_related(
        Prefetch("decisions", queryset=Decision.objects.select_related("actor").order_by("created_at")),
        Prefetch("notifications", queryset=Notification.objects.select_related("group").order_by("created_at")),
    )
    cards = list(cards.order_by("created_at"))
    for card in cards:
        for decision in card.decisions.all():
            decision.payload_json = _pretty(decision.payload)
    return render(
        request,
        "runs/detail.html",
        {
            "run": run,
            "steps": steps,
            "cards": cards,
            "result_json": _pretty(run.result),
            "input_json": _pretty(run.input),
            "can_cancel": not run.is_finished and can_operate_run(request.user, run),
        },
    )


@require_POST
def run_cancel(request, pk):
    run = _get_run_for_user(request, pk)
    if not can_operate_run(request.user, run):
        raise PermissionDenied("Only ops or the run's creator may cancel it.")
    if run.is_finished:
        messages.info(request, f"The run had already finished ({run.status}).")
    else:
        run = run.cancel(by=request.user)
        if run.status == Run.Status.CANCELLED:
            messages.success(request, "Run cancelled.")
        else:
            messages.info(request, "Cancellation requested: the run stops after its current step.")
    return redirect("run", pk=run.pk)
