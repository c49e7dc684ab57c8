"""The evaluations' pages (ops and admins, evals.access): the list, with two picked side by side, and one
evaluation with its chart and its dangerous cards. Evaluations are made by `manage.py evaluate` or the API."""

from __future__ import annotations

import json

from django.shortcuts import render
from django.views.decorators.http import require_GET

from evals import charts
from evals.access import check_may_evaluate, evaluation_for
from evals.models import Evaluation

LISTED = 100


@require_GET
def evaluation_list(request):
    check_may_evaluate(request.user)
    evaluations = list(Evaluation.objects.select_related("created_by")[:LISTED])
    picked = [int(pk) for pk in request.GET.getlist("compare") if pk.isdigit()][:2]
    compared = [evaluation_for(request.user, pk) for pk in picked] if len(picked) == 2 else []
    return render(request, "evals/list.html", {"evaluations": evaluations, "compared": compared})


@require_GET
def evaluation_detail(request, pk: int):
    evaluation = evaluation_for(request.user, pk)
    if evaluation.kind == Evaluation.Kind.VERSION:
        bars, height = charts.version_bars(evaluation.figures)
    else:
        bars, height = charts.matrix_bars(evaluation.figures.get("matrix", {}))
    context = {
        "evaluation": evaluation,
        "f": evaluation.figures,
        "bars": bars,
        "chart_height": height,
        "candidate_json": json.dumps(evaluation.candidate, indent=2),
    }
    return render(request, "evals/detail.html", context)
