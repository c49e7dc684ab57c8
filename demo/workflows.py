"""The `refund` demo workflow: the worked example of docs/workflows.md.

Input: {customer_id, amount_cents, currency, reason}. classify (compute) -> lookup_customer (read) ->
draft_refund (compute) -> approve_refund (gate on payments, skipped below AUTO_APPROVE_CENTS) ->
issue_refund (effect on payments) -> notify_customer (effect on email).
"""

from __future__ import annotations

from typing import Annotated

from django.conf import settings
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from runs.currencies import check_currency
from runs.gates import ApprovalRequest
from runs.webhooks import Source, register_source
from runs.workflow import Display, Fatal, Workflow, register

Currency = Annotated[StrictStr, AfterValidator(check_currency)]
Cents = Annotated[StrictInt, Field(gt=0, le=100_000_000)]  # up to one million in major units


class RefundInput(BaseModel):
    """What a caller submits (POST /api/runs, webhooks, demo_traffic): validated before the run exists."""

    model_config = ConfigDict(extra="forbid")

    customer_id: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]
    amount_cents: Cents
    currency: Currency
    reason: Annotated[StrictStr, Field(min_length=1, max_length=2000)]
    faults: dict[str, list[StrictStr]] | None = None  # demo fault injection (demo.sandbox), development only

    @field_validator("faults")
    @classmethod
    def _faults_in_development_only(cls, faults):
        if faults and not settings.DEMO_FAULTS_ENABLED:
            raise ValueError("fault injection is only available in development")
        return faults


class RefundOrder(BaseModel):
    model_config = ConfigDict(extra="forbid")

    customer_id: StrictStr
    amount_cents: Cents
    currency: Currency
    reason: StrictStr


class CustomerEmail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: Annotated[StrictStr, Field(pattern=r"^[^@\s]+@[^@\s]+$")]
    subject: Annotated[StrictStr, Field(min_length=1, max_length=200)]
    body: Annotated[StrictStr, Field(min_length=1, max_length=10_000)]


class RefundProposal(BaseModel):
    model_config = ConfigDict(extra="forbid")

    refund: RefundOrder
    email: CustomerEmail


def _no_more_than_proposed(proposed: dict, edited: dict) -> list[dict]:
    """A reviewer may lower the refund, never raise it (the agent's draft is the ceiling they signed off)."""
    if edited["refund"]["amount_cents"] > proposed["refund"]["amount_cents"]:
        return [{"loc": "refund.amount_cents", "msg": "may not be more than the proposed amount"}]
    return []


refund = register(
    Workflow("refund", version=1, description="Refund a customer, with a person's sign-off.", input_schema=RefundInput)
)


@refund.compute
def classify(ctx):
    order = ctx.input
    for field in ("customer_id", "amount_cents", "currency", "reason"):
        if field not in order:
            raise Fatal(f"the refund input has no {field!r}")
    if not isinstance(order["amount_cents"], int) or order["amount_cents"] <= 0:
        raise Fatal("amount_cents must be a positive integer")
    return ctx.model.complete("classify", reason=order["reason"], amount_cents=order["amount_cents"])


@refund.read
def lookup_customer(ctx):
    return ctx.tools.crm.get_customer(ctx.input["customer_id"])


@refund.compute
def draft_refund(ctx):
    return ctx.model.complete(
        "draft_refund",
        customer=ctx.outputs["lookup_customer"],
        amount_cents=ctx.input["amount_cents"],
        currency=ctx.input["currency"],
        reason=ctx.input["reason"],
        category=ctx.outputs["classify"]["category"],
    )


def _matches_the_request(order: dict, draft: dict) -> bool:
    """The model's draft is what was asked for: the same customer and currency, and no more than requested."""
    amount = draft.get("amount_cents")
    return (
        draft.get("customer_id") == order["customer_id"]
        and draft.get("currency") == order["currency"]
        and isinstance(amount, int)
        and not isinstance(amount, bool)
        and 0 < amount <= order["amount_cents"]
    )


@refund.gate(
    "payments",
    proposal=RefundProposal,
    editable=("refund.amount_cents", "refund.currency", "email.subject", "email.body"),
    check_edit=_no_more_than_proposed,
    display=Display(headline="refund.reason", amount_minor="refund.amount_cents", currency="refund.currency"),
)
def approve_refund(ctx):
    draft = ctx.outputs["draft_refund"]
    proposal = {"refund": draft["refund"], "email": draft["email"]}
    # Never auto-approve on the model's output alone: only a draft that matches the request, below the amount.
    if (
        _matches_the_request(ctx.input, draft["refund"])
        and draft["refund"]["amount_cents"] < settings.AUTO_APPROVE_CENTS
    ):
        return {
            "decision": "auto",
            "payload": proposal,
            "comment": "below the auto-approve amount",
            "reason": "",
            "by": "system",
        }
    customer = ctx.outputs["lookup_customer"]
    rationale = draft["rationale"]
    return ctx.gate(
        ApprovalRequest(
            channel="payments",
            proposed=proposal,
            # What the refund changes: the customer's balance and the email they have not been sent yet.
            current={
                "refund": {
                    "customer_id": customer["id"],
                    "amount_cents": 0,
                    "currency": ctx.input["currency"],
                    "reason": "",
                },
                "email": {"to": customer["email"], "subject": "", "body": ""},
            },
            summary=rationale["summary"],
            rule_id=rationale["rule_id"],
            confidence=rationale["confidence"],
            citations=rationale["citations"],
            risk=ctx.outputs["classify"]["risk"],
        )
    )


@refund.effect("payments")
def issue_refund(ctx):
    refund_order = ctx.outputs["approve_refund"]["payload"]["refund"]
    payments = ctx.tools.payments
    arguments = {
        "customer_id": refund_order["customer_id"],
        "amount_cents": int(refund_order["amount_cents"]),
        "currency": refund_order["currency"],
    }
    return ctx.effect(
        lambda key: payments.refund(**arguments, idempotency_key=key),
        lookup=payments.lookup,
        preview={"call": "payments.refund", **arguments},  # what shadow mode records instead of the call
    )


@refund.effect("email")
def notify_customer(ctx):
    message = ctx.outputs["approve_refund"]["payload"]["email"]
    email = ctx.tools.email
    # The email system cannot be asked whether it sent a message: an ambiguous send parks for a person.
    arguments = {"to": message["to"], "subject": message["subject"], "body": message["body"]}
    return ctx.effect(
        lambda key: email.send(**arguments, idempotency_key=key), preview={"call": "email.send", **arguments}
    )


# The demo's webhook source (DESIGN "Fixed names"): its body is the refund input, as POST /api/runs takes it.
register_source(Source("demo", workflow="refund", to_input=lambda payload: payload))
