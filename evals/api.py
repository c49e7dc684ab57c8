"""The evaluations through the API (ops and admins, evals.access; anyone else 404): list them, read one, and make
one (`POST /api/evaluations`: saved and audited as `manage.py evaluate` does). docs/evaluate.md."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ninja import Field, Router, Schema, Status

from core.api import ERRORS
from evals.access import check_may_evaluate, evaluation_for
from evals.errors import CandidateInvalid, EmptyPeriod, PeriodInvalid
from evals.models import Evaluation
from evals.rules import period

router = Router(tags=["evaluations"])


class EvaluationIn(Schema):
    candidate: dict[str, Any] = Field(
        description="The candidate approval rule (docs/evaluate.md): `{name?, rules: [{if: {...}, then}], otherwise?, "
        "quorum?}`; or a workflow or prompt version (docs/replay.md): `{workflow, version, model?: replayed|live}`. "
        "One that does not read is a 400 listing each error with its path."
    )
    since: str = Field(max_length=40, description="Start of the period: an age (30d, 12h, 2w, 90m) or an ISO date.")
    until: str | None = Field(default=None, max_length=40, description="End of the period; default now.")
    name: str = Field(default="", max_length=200, description="Default: the candidate's name.")


class EvaluationSummaryOut(Schema):
    id: int
    kind: str
    name: str
    period_start: datetime
    period_end: datetime
    created_by: str | None
    created_at: datetime
    headline: dict[str, Any] = Field(description="agreement, dangerous, time_saved_seconds and the other counts.")


class EvaluationOut(EvaluationSummaryOut):
    candidate: dict[str, Any]
    figures: dict[str, Any] = Field(description="Every figure (docs/evaluate.md, what the figures mean).")


@router.get("/evaluations", response={200: list[EvaluationSummaryOut], **ERRORS}, summary="The evaluations")
def list_evaluations(request):
    check_may_evaluate(request.user)
    return [Evaluation.as_dict(e) for e in Evaluation.objects.select_related("created_by")[:100]]


@router.get("/evaluations/{evaluation_id}", response={200: EvaluationOut, **ERRORS}, summary="One evaluation")
def get_evaluation(request, evaluation_id: int):
    return Evaluation.as_dict(evaluation_for(request.user, evaluation_id))


@router.post(
    "/evaluations",
    response={201: EvaluationOut, **ERRORS},
    summary="Evaluate a candidate (an approval rule, or a workflow version) over a period",
    description="Saved and audited. 400: the candidate or the period does not read (each error with its path); "
    "409: no card was decided by a person in the period (nothing saved).",
)
def create_evaluation(request, body: EvaluationIn):
    check_may_evaluate(request.user)
    try:
        since, until = period(body.since, body.until)
        if "workflow" in body.candidate:  # a workflow or prompt version (evals.versions)
            evaluation = Evaluation.of_version(body.candidate, since, until, name=body.name, by=request.user)
            evaluation.save_audited()
        else:
            evaluation = Evaluation.of_rule(body.candidate, since, until, name=body.name, by=request.user)
    except CandidateInvalid as exc:
        return Status(400, {"error": "bad_request", "detail": exc.errors})
    except PeriodInvalid as exc:
        return Status(400, {"error": "bad_request", "detail": str(exc)})
    except EmptyPeriod as exc:
        return Status(409, {"error": "conflict", "detail": str(exc)})
    return Status(201, Evaluation.as_dict(evaluation))
