"""The demo workflows, the worked examples of docs/workflows.md.

`refund`, fixed steps. Input: {customer_id, amount_cents, currency, reason}. classify (compute) ->
lookup_customer (read) -> draft_refund (compute) -> approve_refund (gate on payments, skipped below
AUTO_APPROVE_CENTS) -> issue_refund (effect on payments, undone by a reversal a person confirms, within 30 days) ->
notify_customer (effect on email, the last step: the demo fault `{"notify_customer": ["fatal"]}` makes it fail for
good after the refund was paid, and the run asks whether to undo the refund: runs.compensations).

`support_agent`, an agent (runs.agent). Input: {customer_id, message, order_id?}. One agent stage, `support`,
whose model looks the customer and their orders up (read tools on the CRM), may refund an order (an effect on
payments, approved by a person from AUTO_APPROVE_CENTS up), emails the customer (on email, always approved) and
writes a note on the customer's record (on crm, never asked), then answers.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from django.conf import settings
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from demo.sandbox import orders_of
from runs.currencies import ISO_4217, check_currency
from runs.gates import ApprovalRequest
from runs.tools import tool
from runs.webhooks import Source, register_source
from runs.workflow import Compensation, Display, Fatal, Pii, Workflow, register

# The JSON Schema lists the codes check_currency takes, so that POST /api/runs' document says which.
Currency = Annotated[StrictStr, AfterValidator(check_currency), Field(json_schema_extra={"enum": sorted(ISO_4217)})]
Cents = Annotated[StrictInt, Field(gt=0, le=100_000_000)]  # up to one million in major units
CustomerId = Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]
# Personal data (docs/personal-data.md): the customer is the data subject, named by their id; their name and email
# come from the CRM (sealed by the reads that return them) and travel as references (`pii:<id>`), which a proposal
# that holds one must accept. The effects that write to the customer open them (`ctx.pii`).
CUSTOMER_PII = Pii(fields=("name", "email"), subject="id")
EmailAddress = Annotated[
    StrictStr, Field(pattern=r"^(?:[^@\s]+@[^@\s]+|pii:[0-9a-f]{32})$", json_schema_extra={"x-pii": True})
]


def _faults_schema(schema: dict) -> None:
    if not settings.DEMO_FAULTS_ENABLED:
        for option in schema["anyOf"]:
            if option.get("type") == "object":
                option["maxProperties"] = 0


class DemoInput(BaseModel):
    """A demo workflow's input: nothing beyond its fields, and demo fault injection in development only."""

    model_config = ConfigDict(extra="forbid")

    # Demo fault injection (demo.sandbox), development only: elsewhere the schema admits none (null or {}).
    faults: dict[str, list[StrictStr]] | None = Field(None, json_schema_extra=_faults_schema)

    @field_validator("faults")
    @classmethod
    def _faults_in_development_only(cls, faults):
        if faults and not settings.DEMO_FAULTS_ENABLED:
            raise ValueError("fault injection is only available in development")
        return faults


class RefundInput(DemoInput):
    """What a caller submits (POST /api/runs, webhooks, demo_traffic): validated before the run exists. The customer
    is its data subject: an erased customer's refund is refused, and erasing one cancels their runs in flight."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"x-pii-subject": "customer_id"})
    customer_id: CustomerId
    amount_cents: Cents
    currency: Currency
    reason: Annotated[StrictStr, Field(min_length=1, max_length=2000)]


class RefundOrder(BaseModel):
    model_config = ConfigDict(extra="forbid")

    customer_id: StrictStr
    amount_cents: Cents
    currency: Currency
    reason: StrictStr


class CustomerEmail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: EmailAddress
    subject: Annotated[StrictStr, Field(min_length=1, max_length=200)]
    body: Annotated[StrictStr, Field(min_length=1, max_length=10_000)]


class RefundProposal(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"x-pii-subject": "refund.customer_id"})

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


@refund.read(pii=CUSTOMER_PII)
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


def _reverse(ctx, key: str, refund: dict) -> dict:
    """Undo a refund (runs.compensations): reversed by the payment system, by the refund's id, once per key."""
    return ctx.tools.payments.reverse(refund["id"], idempotency_key=key)


def _describe_refund(refund: dict) -> str:
    amount = int(refund.get("amount_cents") or 0)
    return (
        f"the refund {refund.get('id')} of {amount / 100:.2f} {refund.get('currency')} to {refund.get('customer_id')}"
    )


# A refund can be reversed for 30 days, and a person confirms each reversal; an email can never be unsent.
REVERSE_REFUND = Compensation(
    call=_reverse,
    lookup=lambda ctx, key: ctx.tools.payments.lookup_reversal(key),
    within=timedelta(days=30),
    approval=True,
    describe=_describe_refund,
)


@refund.effect("payments", compensate=REVERSE_REFUND)
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
    # The email system gets the customer's address and name in clear (ctx.pii); the preview keeps the references.
    clear = ctx.pii(arguments)
    return ctx.effect(lambda key: email.send(**clear, idempotency_key=key), preview={"call": "email.send", **arguments})


# The demo's webhook source (DESIGN "Fixed names"): its body is the refund input, as POST /api/runs takes it.
register_source(Source("demo", workflow="refund", to_input=lambda payload: payload))


# --- support_agent: the same systems, driven by a tool-calling model --------------------------------------------


class SupportInput(DemoInput):
    """A customer's message to support (POST /api/runs, demo_traffic): validated before the run exists. The customer
    is its data subject, as RefundInput's."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"x-pii-subject": "customer_id"})
    customer_id: CustomerId
    message: Annotated[StrictStr, Field(min_length=1, max_length=4000)]
    order_id: CustomerId | None = None  # the order the customer wrote about, when they named one


def _recorded(ctx, tool_name: str):
    """The latest successful result of `tool_name` in this run (the agent's recorded tool calls)."""
    found = None
    for output in ctx.outputs.values():
        if isinstance(output, dict) and output.get("tool") == tool_name and "result" in output:
            found = output["result"]
    return found


@tool(name="lookup_customer", pii=CUSTOMER_PII)  # not to shadow refund's step of that name in this module
def find_customer(ctx, customer_id: str) -> dict:
    """Look a customer up in the CRM: name, email, lifetime value, refunds in the last 90 days."""
    return ctx.tools.crm.get_customer(customer_id)


@tool
def list_orders(ctx, customer_id: str) -> list[dict]:
    """A customer's orders, newest first: id, item, total and refunded amounts (cents), currency, status."""
    return ctx.tools.crm.list_orders(customer_id)


class OrderRefund(BaseModel):
    model_config = ConfigDict(extra="forbid")

    customer_id: CustomerId
    order_id: CustomerId
    amount_cents: Cents
    currency: Currency
    reason: Annotated[StrictStr, Field(min_length=1, max_length=500)]


def _order_refund_state(ctx, args: OrderRefund) -> dict:
    """The order's refund as it stands (the card's "Now" column): what has been refunded on it so far."""
    order = next((o for o in orders_of(args.customer_id) if o["id"] == args.order_id), None)
    return {
        "customer_id": args.customer_id,
        "order_id": args.order_id,
        "amount_cents": order["refunded_cents"] if order else 0,
        "currency": order["currency"] if order else args.currency,
        "reason": "",
    }


def _needs_a_person(args: OrderRefund, history: list[dict]) -> bool:
    """From AUTO_APPROVE_CENTS up (as refund's gate: below it, approved by itself), counting what this run has
    refunded already: three refunds just under the threshold are not three refunds without a person."""
    refunded = sum(
        call["arguments"]["amount_cents"]
        for call in history
        if call["tool"] == "refund_order" and isinstance(call.get("result"), dict) and "error" not in call["result"]
    )
    return refunded + args.amount_cents >= settings.AUTO_APPROVE_CENTS


@tool(
    kind="effect",
    channel="payments",
    approval=_needs_a_person,
    current=_order_refund_state,
    display=Display(headline="reason", amount_minor="amount_cents", currency="currency"),
    risk="high",
    compensate=REVERSE_REFUND,
)
def refund_order(ctx, args: OrderRefund) -> dict:
    """Refund (part of) one of the customer's orders, in the order's currency; amount in cents, no more than the
    order's total less what was already refunded. From a threshold up, a person approves it first."""
    # The orders as they stand (what has been refunded so far changes): recorded, for a replay to see them as this
    # call did (runs.replay).
    orders = ctx.recorded("orders", orders_of, args.customer_id)
    order = next((o for o in orders if o["id"] == args.order_id), None)
    if order is None:
        return {"error": f"the customer has no order {args.order_id}", "refunded": False}
    refundable = order["total_cents"] - order["refunded_cents"]
    if args.amount_cents > refundable or args.currency != order["currency"]:
        return {
            "error": f"at most {refundable} {order['currency']} cents can be refunded on {args.order_id}",
            "refunded": False,
        }
    payments = ctx.tools.payments
    arguments = {
        "customer_id": args.customer_id,
        "order_id": args.order_id,
        "amount_cents": args.amount_cents,
        "currency": args.currency,
    }
    return ctx.effect(
        lambda key: payments.refund(**arguments, idempotency_key=key),
        lookup=payments.lookup,
        preview={"call": "payments.refund", **arguments},
    )


class SupportEmail(CustomerEmail):
    """An email to the customer the agent writes to: their id names whose address and name it holds."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"x-pii-subject": "customer_id"})

    customer_id: CustomerId


def _email_now(ctx, args: SupportEmail) -> dict:
    """Nothing is sent yet; the address on the customer's record, to compare with the one the agent wrote."""
    customer = _recorded(ctx, "lookup_customer") or {}
    return {"to": customer.get("email", ""), "subject": "", "body": ""}


@tool(
    kind="effect",
    channel="email",
    approval="always",
    current=_email_now,
    display=Display(headline="subject"),
    risk="medium",
)
def send_email(ctx, args: SupportEmail) -> dict:
    """Email the customer (their id, and the address and name as the CRM lookup gave them). A person reads every
    email before it is sent."""
    email = ctx.tools.email
    arguments = args.model_dump(exclude={"customer_id"})
    # The email system cannot be asked whether it sent a message: an ambiguous send parks for a person. It gets the
    # address and name in clear (ctx.pii); the preview keeps the references.
    clear = ctx.pii(arguments)
    return ctx.effect(lambda key: email.send(**clear, idempotency_key=key), preview={"call": "email.send", **arguments})


@tool(kind="effect", channel="crm", approval="never", risk="low")
def add_note(ctx, customer_id: str, text: str) -> dict:
    """Write a note on the customer's CRM record: what was asked, what was done and why."""
    crm = ctx.tools.crm
    return ctx.effect(
        lambda key: crm.add_note(customer_id=customer_id, text=text[:4000], idempotency_key=key),
        lookup=crm.lookup_note,
        preview={"call": "crm.add_note", "customer_id": customer_id, "text": text[:4000]},
    )


SUPPORT_PROMPT = """You are a customer support agent for an online shop. Look the customer up, then their \
orders. When the customer is owed a refund on an order, refund it with refund_order (never more than the order's \
total less what was refunded, in the order's currency), then email the customer what you did, then write a note \
on their record with add_note. If a tool answers an error or a reviewer rejects a call, do not try it again: \
write the note saying why, and answer. Finish with a short answer for the support team."""

support = register(
    Workflow(
        "support_agent",
        version=1,
        description="Answer a customer's message with a tool-calling agent: refunds and emails need a person.",
        input_schema=SupportInput,
    )
)


@support.agent(
    tools=[find_customer, list_orders, refund_order, send_email, add_note], max_turns=8, prompt_version="support-1"
)
def support_agent(ctx):
    order = ctx.input.get("order_id") or "none given"
    return [
        {"role": "system", "content": SUPPORT_PROMPT},
        {
            "role": "user",
            "content": f"Customer id: {ctx.input['customer_id']}\nOrder id: {order}\n"
            f"Message from the customer:\n{ctx.input['message']}",
        },
    ]
