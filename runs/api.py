"""The runs' JSON API (/api/runs): start a run (for the token's tenants), read one with its steps and its open card,
and cancel one; who may see and cancel a run: runs.access."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal

from django.http import HttpResponse
from ninja import Field, Router, Schema, Status
from ninja.errors import HttpError, ValidationError
from pydantic import ConfigDict
from pydantic import ValidationError as PydanticError

from core import safe_input, tracing
from core.api import ERRORS
from runs import compensations, forks, submission
from runs import replay as replays
from runs import workflow as workflows
from runs.access import run_for, run_for_ops
from runs.errors import ForkRefused, IdempotencyConflict, InvalidInput, TransitionRefused, UndoRefused, UnknownWorkflow
from runs.models import Run, Step

router = Router(tags=["runs"])


# A decimal string: up to 6 digits before the point and 6 after (Run.cost_limit is a numeric(12, 6)). A string,
# not a JSON number: a number's decimals are a binary float's (0.1 is not one tenth), and a schema cannot bound them.
COST_LIMIT_PATTERN = r"^[0-9]{1,6}(\.[0-9]{1,6})?$"


def _declare_workflows(schema: dict) -> None:
    """RunIn's JSON Schema: `workflow` is one of the deployed workflows, and `input` fits that workflow's input
    schema (runs.submission.submit refuses anything else with a 422)."""
    schema["properties"]["workflow"]["enum"] = sorted(workflows.names())
    schema["allOf"] = [
        {"if": {"properties": {"workflow": {"const": name}}}, "then": {"properties": {"input": input_schema}}}
        for name, input_schema in sorted(_workflow_inputs().items())
    ]


class RunIn(Schema):
    model_config = ConfigDict(json_schema_extra=_declare_workflows)

    workflow: str = Field(max_length=100, description="A deployed workflow's name.")
    input: dict = Field(description="The workflow's input: it must fit the workflow's input schema.")
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)
    tenant: str = Field("default", min_length=1, max_length=100)
    priority: int = Field(0, ge=-100, le=100, strict=True)
    cost_limit: str | None = Field(
        None,
        pattern=COST_LIMIT_PATTERN,
        description='A decimal string, such as "2.50": at most 6 digits before the point and 6 after.',
    )


class RunAccepted(Schema):
    id: uuid.UUID
    status: str
    url: str


class StepOut(Schema):
    seq: int
    name: str
    kind: str
    status: str
    attempt: int
    output: dict | list | str | int | float | bool | None
    error: str
    tokens_in: int
    tokens_out: int
    cost: Decimal
    latency_ms: float | None


class CompensationOut(Schema):
    outcome: str = Field(description="done, declined (a person said no), by_hand, or failed (waiting for a person)")
    at: datetime | None
    by: str
    answer: dict | list | str | int | float | bool | None
    error: str


class EffectOut(Schema):
    """A completed effect of the run, as the registry of compensations shows it (runs.compensations)."""

    key: str
    step: str
    seq: int
    channel: str
    completed_at: datetime
    external_id: str
    can_undo: bool = Field(description="Whether a cancel and undo would compensate it now.")
    why_not: str = Field(description="Why it cannot be undone (now); empty when it can, or was.")
    undo_until: datetime | None = Field(description="Its compensation's deadline; null: none.")
    needs_approval: bool = Field(description="Its compensation asks a person first (a card).")
    compensation: CompensationOut | None = Field(description="What undid it; null while it is not undone.")


class RunOut(Schema):
    id: uuid.UUID
    workflow: str
    workflow_version: int
    tenant: str
    status: str
    current_step: str | None
    steps_done: int
    steps: list[StepOut]
    result: dict | list | str | int | float | bool | None
    error: str
    pause_reason: str
    approval_id: int | None
    undo_reason: str = Field(
        description="Why the run is being (or was) undone: failed, rejected, cancelled, budget; empty when it is not."
    )
    effects: list[EffectOut] = Field(description="Its completed effects, what can still be undone and what undid them.")
    fork_of: uuid.UUID | None = Field(description="The run this one was forked from (runs.forks); null: none.")
    fork_from_step: int | None = Field(description="The original's step this fork runs live from; null: not a fork.")
    fork_reason: str = Field(description="Why it was forked; empty when it is not a fork.")
    forks: list[uuid.UUID] = Field(description="The runs forked from this one, oldest first.")
    trace_id: str = Field(description="The run's trace id (W3C): in its log lines, dead letter and spans.")
    trace_url: str = Field(description="The trace in a tracing UI (TRACE_URL_TEMPLATE); empty: none configured.")
    cost: Decimal
    tokens_in: int
    tokens_out: int
    created_at: datetime
    updated_at: datetime


def run_out(run: Run) -> dict:
    steps = list(run.steps.order_by("seq"))
    current = None
    if not run.is_finished:
        # An agent stage's steps are not declared: the step at the cursor is read from what the run recorded.
        try:
            step = workflows.get(run.workflow, run.workflow_version).step_at(
                run.cursor, {s.name: s.output for s in steps if s.status == Step.Status.DONE and s.seq < run.cursor}
            )
        except (UnknownWorkflow, KeyError, AttributeError, TypeError):
            step = None
        current = step.name if step is not None else None
    # The cards through their relation to the run (the runs app does not import approvals, which builds on it).
    cards = run.approvals
    open_card = cards.filter(status__in=cards.model.OPEN).order_by("-created_at").first()
    return {
        **{
            f: getattr(run, f)
            for f in (
                "id",
                "workflow",
                "workflow_version",
                "tenant",
                "status",
                "result",
                "error",
                "pause_reason",
                "undo_reason",
                "fork_from_step",
                "fork_reason",
                "trace_id",
                "cost",
                "tokens_in",
                "tokens_out",
                "created_at",
                "updated_at",
            )
        },
        "trace_url": tracing.trace_url(run.trace_id),
        "fork_of": run.fork_of_id,
        "forks": list(run.forks.order_by("created_at", "pk").values_list("pk", flat=True)),
        "current_step": current,
        "steps_done": sum(1 for s in steps if s.status == Step.Status.DONE),
        "steps": steps,
        "approval_id": open_card.pk if open_card else None,
        "effects": [entry.as_dict() for entry in compensations.registry(run)],
    }


def _workflow_inputs() -> dict:
    """Each deployed workflow's input schema (JSON Schema), for the OpenAPI document: an `input` that does not
    fit its workflow's is a 422 naming the fields."""
    schemas = {}
    for name in workflows.names():
        definition = workflows.get(name)
        if definition.input_schema is not None:
            schemas[name] = _defs_inlined(definition.input_schema.model_json_schema())
    return schemas


def _defs_inlined(schema: dict) -> dict:
    """A model's JSON Schema with its `$defs` written where they are used: it is embedded in the OpenAPI document,
    where `#/$defs/...` would point nowhere. (An input model that refers to itself cannot be embedded.)"""
    defs = schema.pop("$defs", {})

    def inline(node, depth: int = 0):
        if isinstance(node, list):
            return [inline(item, depth) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            if depth > 16:
                raise ValueError(f"a workflow's input schema refers to itself ({ref}): it cannot be embedded")
            siblings = {key: inline(value, depth) for key, value in node.items() if key != "$ref"}
            return {**inline(defs[ref.removeprefix("#/$defs/")], depth + 1), **siblings}
        return {key: inline(value, depth) for key, value in node.items()}

    return inline(schema)


@router.post(
    "/runs",
    response={200: RunAccepted, 202: RunAccepted, **ERRORS},
    summary="Start a run (202; no agent work here)",
    description="`input` must fit the workflow's input schema: see `x-workflow-input-schemas`, by workflow name.",
    openapi_extra={"x-workflow-input-schemas": _workflow_inputs()},
)
def create_run(request, body: RunIn):
    # The run's root span, continuing the caller's `traceparent`: the run's trace (core.tracing).
    with tracing.server_span(
        "POST /api/runs", request.headers, {"http.request.method": "POST", "http.route": "/api/runs"}
    ):
        return _create_run(request, body)


def _create_run(request, body: RunIn):
    token = getattr(request, "api_token", None)
    if token is not None and not token.allows_tenant(body.tenant):
        raise HttpError(403, f"This token may not start runs for tenant {body.tenant!r}.")
    try:
        run, created = submission.submit(
            workflow=body.workflow,
            input=body.input,
            idempotency_key=body.idempotency_key,
            tenant=body.tenant,
            priority=body.priority,
            cost_limit=None if body.cost_limit is None else Decimal(body.cost_limit),
            created_by=request.user,
        )
    except UnknownWorkflow as exc:
        raise HttpError(422, str(exc)) from None
    except InvalidInput as exc:
        raise ValidationError(exc.errors) from None
    except IdempotencyConflict as exc:
        raise HttpError(409, str(exc)) from None
    return Status(202 if created else 200, {"id": run.id, "status": run.status, "url": f"/api/runs/{run.id}"})


@router.get("/runs/{run_id}", response={200: RunOut, **ERRORS}, summary="A run, its steps and its open card")
def get_run(request, run_id: uuid.UUID):
    return run_out(run_for(request.user, run_id))


class CancelIn(Schema):
    # Strict, as the document says: `{"undo": 0}` or an unknown field is a 422, not a plain cancel.
    model_config = ConfigDict(extra="forbid")

    undo: bool = Field(
        False,
        strict=True,
        description="Cancel and undo: what the run did is compensated too, in reverse order (runs.compensations). "
        "409, nothing done, when it has nothing it can undo or an effect is past its compensation's deadline.",
    )


def cancel_body(request) -> CancelIn:
    """The cancel's body, which is optional: none (or one that is not JSON, as a form post or an empty one) is a
    plain cancel, as it always was; a JSON body must be CancelIn, an object (422 naming the field otherwise)."""
    if not request.body or request.content_type != "application/json":
        return CancelIn()
    try:
        data = safe_input.loads(request.body)
    except safe_input.UnsafeJson as exc:
        raise ValidationError(exc.errors()) from None
    except ValueError:
        raise HttpError(400, "Cannot parse request body") from None
    if not isinstance(data, dict):  # `null` too: the document says an object, or no body at all
        raise ValidationError([{"type": "dict_type", "loc": "body", "msg": "Input should be a valid dictionary"}])
    try:
        return CancelIn.model_validate(data)
    except PydanticError as exc:
        raise ValidationError(
            [
                {"type": e["type"], "loc": safe_input.field_path(list(e["loc"])) or "body", "msg": e["msg"]}
                for e in exc.errors()
            ]
        ) from None


@router.post(
    "/runs/{run_id}/cancel",
    response={200: RunOut, **ERRORS},
    summary="Cancel a run (and undo what it did)",
    description="No body (or `undo: false`): a parked or queued run ends now, a running one stops after its step. "
    '`{"undo": true}`: the run is undone as well (its `status` goes on through `compensating`); refused with 409 '
    "and nothing done when there is nothing it can undo. A run being undone cannot be cancelled (409).",
    # The body is optional (ninja's declared bodies are not): read by cancel_body, stated here.
    openapi_extra={
        "requestBody": {
            "required": False,
            "content": {"application/json": {"schema": CancelIn.model_json_schema()}},
        }
    },
)
def cancel_run(request, run_id: uuid.UUID):
    run = run_for(request.user, run_id, to_operate=True)
    body = cancel_body(request)
    try:
        run = compensations.cancel_and_undo(run, request.user) if body.undo else run.cancel(by=request.user)
    except (UndoRefused, TransitionRefused) as exc:
        raise HttpError(409, str(exc)) from None
    return run_out(run)


class ReplayOut(Schema):
    run: uuid.UUID
    workflow: str
    version: int = Field(description="The deployed version of the workflow it was replayed on.")
    recorded_version: int
    identical: bool
    summary: str
    steps: list[dict] = Field(
        description="Each step replayed identically: seq, name, kind, answers fed back (fed),"
        " versions changed ({name: [recorded, current]}), shimmed."
    )
    divergence: dict | None = Field(description="The first divergence: seq, step, reason, recorded, replayed.")
    calls: int = Field(description="Calls made outside: 0 for a replay.")
    ms: float


@router.post(
    "/runs/{run_id}/replay",
    response={200: ReplayOut, **ERRORS},
    summary="Replay a run on the code deployed now",
    description="Runs the run's workflow on the deployed code, fed back from its record (model answers, reads, "
    "effects' receipts, cards' decisions, time and ids) instead of calling anything, and reports whether it replays "
    "identically or its first divergence (docs/replay.md). Nothing is called, sent or changed. Ops and admins; 409 "
    "for a run that cannot be replayed (queued, running or being undone; an external agent's; its workflow version "
    "not deployed).",
)
def replay_run(request, run_id: uuid.UUID):
    run = run_for_ops(request.user, run_id, "replay")
    try:
        return replays.replay(run).as_dict()
    except replays.NotReplayable as exc:
        raise HttpError(409, str(exc)) from None


class ForkIn(Schema):
    model_config = ConfigDict(extra="forbid")

    from_step: int = Field(
        ge=0, le=2_147_483_647, strict=True, description="The recorded step the fork runs live from."
    )
    reason: str = Field(
        min_length=1, max_length=forks.MAX_REASON, strict=True, description="Why: kept on the fork and audited."
    )


@router.post(
    "/runs/{run_id}/fork",
    response={201: RunOut, **ERRORS},
    summary="Fork a run from one of its steps (ops)",
    description="A new run, linked to this one (`fork_of`), that reuses its recorded outputs before `from_step` and "
    "runs live from it on the code deployed now; the effects this run made are shared by receipt key, never made "
    "again (docs/fork.md). 409, nothing made, for a step the run does not have, a run whose record still moves "
    "(queued, running, compensating), an external agent's run, or a fork past its compensation point. Ops and "
    "admins only (403). The fork's URL is in the 201's `Location` header.",
)
def fork_run(request, run_id: uuid.UUID, body: ForkIn, response: HttpResponse):
    run = run_for_ops(request.user, run_id, "fork")
    try:
        child = forks.fork(run, body.from_step, body.reason, request.user)
    except ForkRefused as exc:
        raise HttpError(409, str(exc)) from None
    response["Location"] = f"/api/runs/{child.id}"
    return Status(201, run_out(child))
