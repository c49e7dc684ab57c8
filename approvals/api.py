"""The cards' JSON API (/api/approvals): the cards the caller may decide, one card (its deadline applied first),
and a decision on it, under the rules the card page follows (approvals.access, Approval.decide)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.db.models import OuterRef, QuerySet, Subquery
from django.utils import timezone
from ninja import Field, Query, Router, Schema, Status
from ninja.errors import HttpError, ValidationError
from pydantic import ConfigDict

from approvals import personal, sla
from approvals.access import card_for, cards_to_decide
from approvals.diff import changes
from approvals.errors import AlreadyDecided, DecisionError, Expired, InvalidDecision
from approvals.models import Approval, Delegation, RejectReason
from approvals.rules import decider_refusal
from core.api import ERRORS
from core.safe_input import NOT_BLANK
from runs.errors import UndoRefused
from runs.models import Step

router = Router(tags=["approvals"])


class FieldChangeOut(Schema):
    path: str  # dotted, as in the card's diff: refund.amount_cents
    op: Literal["added", "removed", "changed"]
    old: Any = None
    new: Any = None


class EditOut(Schema):
    """The card's latest edit: on an open card the pending edit, which is what runs if the card is approved."""

    by: str
    at: datetime
    comment: str
    payload: dict
    against_proposed: list[FieldChangeOut]  # what the edit changed in the agent's proposal
    against_current: list[FieldChangeOut]  # what running it changes in the current state


def _changes(old, new) -> list[dict]:
    return [{"path": d.path, "op": d.op, "old": d.old, "new": d.new} for d in changes(old, new)]


def with_action(cards: QuerySet[Approval]) -> QuerySet[Approval]:
    """The cards, each with the name of its run's step at the card's seq (`action_name`): a workflow gate's step
    name, or an external request's action (external.asks records the request as a step of that name). Read
    through the run's steps, so that approvals need not know the external app, which builds on it."""
    step = Step.objects.filter(run_id=OuterRef("run_id"), seq=OuterRef("step_seq")).values("name")[:1]
    return cards.annotate(action_name=Subquery(step))


class CardOut(Schema):
    id: int
    run_id: str
    step_seq: int
    # What the card asks about: the workflow gate's step name, or the external agent's action (`refund_order`).
    action: str | None
    kind: str
    channel: str
    status: str
    proposed: dict  # what the agent proposed, as it proposed it
    current: dict | None
    # What runs if the card is approved as it stands (its latest edit, else the proposal), or what ran; null once
    # rejected, expired or cancelled. The same value as the card page's and the engine's (Approval.to_execute).
    to_execute: dict | None
    edit: EditOut | None  # null when nobody edited the proposal
    # The gate's display hints, applied to what runs.
    headline: str
    amount_minor: int | None
    currency: str
    summary: str
    rule_id: str
    confidence: float | None
    citations: list
    risk: str
    shadow: bool
    version: int
    due_at: datetime  # the deadline of the card's stage, under an approval policy
    created_at: datetime
    # Under an admin's approval policy (null under the channel's own rule): which policy, version and stage the
    # card is at, and who it asks.
    policy_stage: dict | None = None
    asked: dict | None = None

    @staticmethod
    def resolve_policy_stage(card):
        return card.policy_stage()

    @staticmethod
    def resolve_asked(card):
        return card.asked_names() if card.admin_policy else None

    @staticmethod
    def resolve_action(card):
        if hasattr(card, "action_name"):  # with_action: the list's cards, in its one query
            return card.action_name
        return Step.objects.filter(run_id=card.run_id, seq=card.step_seq).values_list("name", flat=True).first()

    @staticmethod
    def resolve_channel(card):
        return card.channel.name

    @staticmethod
    def resolve_run_id(card):
        return str(card.run_id)

    @staticmethod
    def resolve_edit(card):
        edit = card.last_edit
        if edit is None:
            return None
        return {
            "by": edit.actor.get_username() if edit.actor else "system",
            "at": edit.created_at,
            "comment": edit.comment,
            "payload": edit.payload,
            "against_proposed": _changes(card.proposed, edit.payload),
            "against_current": _changes(card.current, edit.payload),
        }


class CardDetailOut(CardOut):
    """One card, as the list shows it, and whether the caller may decide it now (the list holds only those they
    may; a card is seen by more people: the run's starter, and those a policy's stage does not ask yet)."""

    may_decide: bool
    why_not: str | None = Field(description="Why the caller may not decide it now; null when they may.")


RejectReasonValue = Literal[tuple(RejectReason.values)]


class DecisionIn(Schema):
    # What depends on the decision alone is stated in the schema (below); Approval.decide is what refuses it.
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"decision": {"const": "edit"}}},
                    "then": {"required": ["payload"], "properties": {"payload": {"type": "object"}}},
                },
                {
                    "if": {"properties": {"decision": {"const": "reject"}}},
                    "then": {"required": ["comment"], "properties": {"comment": {"pattern": NOT_BLANK}}},
                },
                {  # reject and undo
                    "if": {"required": ["undo"], "properties": {"undo": {"const": True}}},
                    "then": {"properties": {"decision": {"const": "reject"}}},
                },
            ]
        }
    )

    decision: Literal["approve", "edit", "reject"]
    comment: str = Field("", max_length=5000, description="Required, not blank, for a rejection.")
    # The taxonomy the card page's reject form and the inbox's bulk reject offer (Slack sends none): a reason
    # outside it would be a category nobody can filter or count by.
    reason: RejectReasonValue | None = Field(
        None, description="Why, in the reject-reason taxonomy; omitted or null for none (422 for any other value)."
    )
    payload: dict | None = Field(
        None,
        description="An edit's new payload: the whole arguments, which replace the card's `proposed` as a whole "
        "(not a patch: a field left out is removed). Required for an edit; ignored otherwise. It must fit the "
        "card: its proposal's shape and the fields a person may change; else 422 naming the fields.",
    )
    version: int = Field(strict=True, description="The card's `version` as read: 409 when it has changed since.")
    # Shadow cards only: whether the reviewer, who did the action by hand, agrees with the agent (required there).
    agreement: Literal["agree", "disagree"] | None = Field(
        None, description="Required on a card with `shadow: true`; refused (422) on any other card."
    )
    done_by_hand: str = Field(
        "",
        max_length=5000,
        description="What the reviewer did by hand: shadow cards only (422 on others, unless blank).",
    )
    undo: bool = Field(
        False,
        strict=True,  # `{"undo": 1}` is a 422, as the document says, not a reject and undo
        description="Reject and undo (a rejection of an action or budget card only): what the run did is undone "
        "too. 422 with any other decision; 409, nothing done, when the card's run has nothing it can undo.",
    )


CardStatus = Literal[(*Approval.Status.values, "all")]  # a card's status, or all of them
STATUS_QUERY = Query(
    Approval.Status.PENDING.value,
    description="`pending` (the default): every card waiting for a decision, escalated ones included (each card "
    "says its own `status`); `escalated`: only those past their first deadline; another status: the cards closed "
    "with it; `all`: every card.",
)


@router.get("/approvals", response={200: list[CardOut], **ERRORS}, summary="Cards the caller may decide")
def list_cards(request, status: CardStatus = STATUS_QUERY):
    cards = (
        with_action(cards_to_decide(request.user))
        .select_related("channel")
        .prefetch_related("decisions__actor")  # each card's latest edit, in one query for the whole list
    )
    # An escalated card still waits for a decision, and is the most urgent of them: a reviewer asking for what
    # is pending (the RUNBOOK's call for an SLA backlog) must get it.
    if status == Approval.Status.PENDING:
        cards = cards.filter(status__in=Approval.OPEN)
    elif status != "all":
        cards = cards.filter(status=status)
    return cards.order_by("due_at")[:500]


@router.get(
    "/approvals/{card_id}",
    response={200: CardDetailOut, **ERRORS},
    summary="One card",
    description="The card as `GET /api/approvals` lists it, to whoever may see it (who may approve its channel; "
    "404 for anyone else, as for a card that does not exist), with whether the caller may decide it now. A card "
    "past its `due_at` has its deadline applied first (escalated, or closed by its channel's safe default).",
)
def get_card(request, card_id: int):
    card = card_for(request.user, card_id)
    if card.status in Approval.OPEN and card.due_at <= timezone.now():
        # Past its deadline the card's expiry applies (reject, escalate, safe default) before it is shown, as a
        # request's GET does (external.status): it never reads as waiting because no timer job ran yet.
        sla.apply_sla(card.pk)
        card = card_for(request.user, card_id)
    why_not = decider_refusal(request.user, card, Delegation.covered_by(request.user))
    if not why_not and card.status not in Approval.OPEN:
        why_not = f"the card is {card.status}: there is nothing left to decide"
    card.may_decide, card.why_not = not why_not, why_not or None
    return card


class RevealedOut(Schema):
    path: str  # where on the card: proposed.customer.email, edit.<decision id>.payload.to
    field: str  # the field it was sealed as
    value: Any = None  # the clear value (null when erased)
    erased: bool


class RevealOut(Schema):
    card_id: int
    fields: list[RevealedOut]


@router.post(
    "/approvals/{card_id}/reveal",
    response={200: RevealOut, **ERRORS},
    summary="Reveal a card's personal data (audited)",
    description="Every answer shows personal data masked (`j***@example.com`), or `[erased]`. A holder of "
    "`view_pii` on the card's channel gets the card's personal values in clear here, each with where it is on the "
    "card; each reveal writes one audit entry `pii.view` (who, the card, the fields; never the values). 403 without "
    "`view_pii` (nothing revealed, nothing audited); 503 `pii_keys_missing` (or `pii_key_unknown`, "
    "`pii_unreadable`) when the vault's key is missing or wrong.",
)
def reveal(request, card_id: int):
    card = card_for(request.user, card_id)
    shown = personal.reveal(card, request.user, via="api")
    return {"card_id": card.pk, "fields": [item.as_dict() for item in shown]}


@router.post(
    "/approvals/{card_id}/decision",
    response={200: CardOut, **ERRORS},
    summary="Approve, edit or reject a card",
    description="An edit's `payload` is the whole arguments: it replaces the card's `proposed` as a whole (what "
    "runs is exactly it). `reason`, when given, is one of the reject-reason taxonomy. "
    "Two rules depend on the card, not on the body alone, and are answered with 422: `agreement` "
    "(and `done_by_hand`) belong to shadow cards only (`shadow` in the card: required there, refused elsewhere), "
    "and an edit's `payload` must fit the card's proposal.",
    openapi_extra={
        "responses": {
            # An int, as ninja keys its responses: a "422" string would be a second key of the same name in the
            # JSON, which YAML parsers (Swagger UI's) refuse.
            422: {
                "description": "The body is invalid, or does not fit this card: `agreement`/`done_by_hand` on a "
                "card that is not shadow, no `agreement` on a shadow card, an edit the card does not allow.",
                # (openapi_extra replaces the response ERRORS declared: its body is stated again)
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}},
            }
        }
    },
)
def decide(request, card_id: int, body: DecisionIn):
    card = card_for(request.user, card_id, to_decide=True)
    try:
        return card.decide(
            request.user,
            body.decision,
            comment=body.comment,
            reason=body.reason or "",
            payload=body.payload,
            version=body.version,
            agreement=body.agreement or "",
            done_by_hand=body.done_by_hand,
            undo=body.undo,
        )
    except UndoRefused as exc:
        raise HttpError(409, str(exc)) from None
    except AlreadyDecided as exc:
        raise HttpError(409, str(exc)) from None
    except Expired as exc:
        # Its own code: the card's expiry was applied, and deciding again will not help (unlike a stale version).
        return Status(409, {"error": "expired", "detail": str(exc)})
    except InvalidDecision as exc:
        if exc.errors:
            raise ValidationError(exc.errors) from None  # 422, each field's error
        raise HttpError(exc.status, str(exc)) from None
    except DecisionError as exc:
        raise HttpError(exc.status, str(exc)) from None
