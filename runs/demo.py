"""The `refund` demo workflow: the worked example of docs/workflows.md.

Input: {customer_id, amount_cents, currency, reason}. classify (compute) -> lookup_customer (read) ->
draft_refund (compute) -> approve_refund (gate on payments, skipped below AUTO_APPROVE_CENTS) ->
issue_refund (effect on payments) -> notify_customer (effect on email).
"""

from __future__ import annotations

from django.conf import settings

from runs.gates import ApprovalRequest
from runs.workflow import Fatal, Workflow, register

refund = register(Workflow("refund", version=1, description="Refund a customer, with a person's sign-off."))


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


@refund.gate("payments")
def approve_refund(ctx):
    draft = ctx.outputs["draft_refund"]
    proposal = {"refund": draft["refund"], "email": draft["email"]}
    if draft["refund"]["amount_cents"] < settings.AUTO_APPROVE_CENTS:
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
    return ctx.effect(
        lambda key: payments.refund(
            customer_id=refund_order["customer_id"],
            amount_cents=int(refund_order["amount_cents"]),
            currency=refund_order["currency"],
            idempotency_key=key,
        ),
        lookup=payments.lookup,
    )


@refund.effect("email")
def notify_customer(ctx):
    message = ctx.outputs["approve_refund"]["payload"]["email"]
    email = ctx.tools.email
    # The email system cannot be asked whether it sent a message: an ambiguous send parks for a person.
    return ctx.effect(
        lambda key: email.send(to=message["to"], subject=message["subject"], body=message["body"], idempotency_key=key)
    )
