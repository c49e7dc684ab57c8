"""The console's pages for external agents' requests: a person records the outcome of an execution whose outcome
is unknown, from its run's page (runs.views shows the form; the logic is external.executions.record_outcome)."""

from __future__ import annotations

from django.contrib import messages
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from external import executions
from external.errors import RequestError
from runs.access import run_for
from runs.views import render_run


@require_POST
def record_outcome(request, pk, seq: int):
    """POST `outcome` (succeeded or failed) and `text` (how they know; the error of a failure). Who may not see the
    run gets 404 (runs.access.run_for); who sees it without `operate_channel` on the request's channel, 403; a
    refused record (bad form 422, nothing to record or recorded already 409) shows the run's page again, saying
    why, with nothing changed."""
    run = run_for(request.user, pk)
    outcome, text = request.POST.get("outcome", ""), request.POST.get("text", "")
    try:
        executions.record_outcome(request.user, run.pk, seq, outcome=outcome, text=text)
    except RequestError as exc:
        messages.error(request, f"Not recorded: {exc.detail}")
        form = {"seq": seq, "outcome": outcome, "text": text}
        return render_run(request, run, status=exc.status, outcome_form=form)
    messages.success(request, f"Recorded: step #{seq} {outcome}.")
    return redirect("run", pk=run.pk)
