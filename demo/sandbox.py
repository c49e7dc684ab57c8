"""The demo's fake external systems (payments, email, crm), deliberately NOT idempotent: every call they
receive is a `SandboxCall` row, so a duplicate side effect that the engine let through is visible in
`manage.py sandbox_stats`. Faults are injected on request through the run input:

    {"faults": {"issue_refund": ["429", "hang"], "classify": ["latency:300"]}}

The n-th call a step makes to a system gets the n-th fault of its list:
`429` / `5xx` (refused, not applied: Retryable), `fatal` (refused: Fatal), `timeout` (applied, then the
answer is lost), `hang` (applied, then the call blocks, as if the worker died before the answer: the crash
tests kill it there), `latency:MS` (slow, then fine), `ok`.

These systems stand for the external ones: what they receive (a `SandboxCall`'s payload) is what an email
provider or a CRM would keep, personal data in clear included (docs/personal-data.md: what erasure does not
cover).
"""

from __future__ import annotations

import hashlib
import time
import uuid

from django.conf import settings
from django.db.models import Count, Q

from demo.models import SandboxCall
from runs import breakers
from runs.models import Run
from runs.workflow import Fatal, Retryable

HANG_SECONDS = 120  # a hang ends (as a timeout) if nobody kills the worker, so no test can block forever


def next_fault(run: Run, system: str, operation: str) -> str:
    if not settings.DEMO_FAULTS_ENABLED:
        return "ok"  # fault injection is a development tool: a run's input cannot make a production worker hang
    faults = (run.input.get("faults") or {}).get(operation, []) if isinstance(run.input, dict) else []
    made = SandboxCall.objects.filter(run_id=run.id, system=system, operation=operation).count()
    return faults[made] if made < len(faults) else "ok"


def refuse_or_delay(fault: str, what: str) -> None:
    """Faults that happen before the call is applied."""
    if fault.startswith("latency:"):
        time.sleep(int(fault.split(":", 1)[1]) / 1000)
    elif fault == "429":
        raise Retryable(f"{what}: 429 Too Many Requests")
    elif fault == "5xx":
        raise Retryable(f"{what}: 503 Service Unavailable")
    elif fault == "fatal":
        raise Fatal(f"{what}: 400 Bad Request (refused)")


def lose_the_answer(fault: str, what: str) -> None:
    """Faults that happen after the call was applied: the caller cannot know it was."""
    if fault == "hang":
        time.sleep(HANG_SECONDS)
        raise TimeoutError(f"{what}: no answer after {HANG_SECONDS} s")
    if fault == "timeout":
        raise TimeoutError(f"{what}: timed out")


class _System:
    system = ""

    def __init__(self, run: Run, operation: str):
        self.run = run
        self.operation = operation

    def _call(self, payload: dict, key: str = "") -> SandboxCall:
        # Through the system's circuit breaker: while it is open the call is not made (BreakerOpen, a Wait).
        with breakers.guard(self.system):
            fault = next_fault(self.run, self.system, self.operation)
            what = f"{self.system}.{self.operation}"
            try:
                refuse_or_delay(fault, what)
            except (Retryable, Fatal):
                SandboxCall.objects.create(
                    system=self.system,
                    operation=self.operation,
                    idempotency_key=key,
                    run_id=self.run.id,
                    payload=payload,
                    applied=False,
                )
                raise
            call = SandboxCall.objects.create(
                system=self.system,
                operation=self.operation,
                idempotency_key=key,
                run_id=self.run.id,
                payload=payload,
                external_id=f"{self.system[:2]}_{uuid.uuid4().hex[:12]}",
            )
            lose_the_answer(fault, what)
            return call


class Payments(_System):
    system = "payments"

    def refund(
        self, *, customer_id: str, amount_cents: int, currency: str, idempotency_key: str, order_id: str = ""
    ) -> dict:
        payload = {"customer_id": customer_id, "amount_cents": amount_cents, "currency": currency}
        if order_id:  # support_agent refunds one order; refund's refunds are the customer's
            payload["order_id"] = order_id
        call = self._call(payload, idempotency_key)
        return {"id": call.external_id, "status": "refunded", **payload}

    @staticmethod
    def lookup(idempotency_key: str) -> dict | None:
        """The payment system can say whether a refund with this key exists (reconciles ambiguous writes)."""
        call = SandboxCall.objects.filter(system="payments", idempotency_key=idempotency_key, applied=True).first()
        if call is None:
            return None
        return {"id": call.external_id, "status": "refunded", **call.payload}

    def reverse(self, refund_id: str, *, idempotency_key: str) -> dict:
        """Reverse a refund (the money goes back), by the refund's id: a payment of its amount, recorded with a
        negative amount and the refund it reverses. Refused (Fatal, 404) for a refund the system never made."""
        refund = SandboxCall.objects.filter(system="payments", external_id=refund_id, applied=True).first()
        if refund is None or "reverses" in refund.payload:
            raise Fatal(f"payments.reverse: 404 no refund {refund_id}")
        payload = {**refund.payload, "amount_cents": -int(refund.payload["amount_cents"]), "reverses": refund_id}
        call = self._call(payload, idempotency_key)
        return {"id": call.external_id, "status": "reversed", **payload}

    @staticmethod
    def lookup_reversal(idempotency_key: str) -> dict | None:
        """Whether a reversal with this key was made (reconciles an ambiguous reversal)."""
        call = SandboxCall.objects.filter(system="payments", idempotency_key=idempotency_key, applied=True).first()
        if call is None:
            return None
        return {"id": call.external_id, "status": "reversed", **call.payload}


class Email(_System):
    system = "email"

    def send(self, *, to: str, subject: str, body: str, idempotency_key: str) -> dict:
        call = self._call({"to": to, "subject": subject, "body": body}, idempotency_key)
        return {"id": call.external_id, "status": "sent", "to": to}


class Crm(_System):
    system = "crm"

    def get_customer(self, customer_id: str) -> dict:
        self._call({"customer_id": customer_id})
        return customer_record(customer_id)

    def list_orders(self, customer_id: str) -> list[dict]:
        self._call({"customer_id": customer_id})
        return orders_of(customer_id)

    def add_note(self, *, customer_id: str, text: str, idempotency_key: str) -> dict:
        call = self._call({"customer_id": customer_id, "text": text}, idempotency_key)
        return {"id": call.external_id, "status": "noted", "customer_id": customer_id}

    def remove_note(self, note_id: str, *, idempotency_key: str) -> dict:
        """Strike a note from the customer's record (recorded as a call naming the note it removes)."""
        note = SandboxCall.objects.filter(system="crm", external_id=note_id, applied=True).first()
        if note is None:
            raise Fatal(f"crm.remove_note: 404 no note {note_id}")
        call = self._call({"customer_id": note.payload.get("customer_id"), "removes": note_id}, idempotency_key)
        return {"id": call.external_id, "status": "removed", "note": note_id}

    @staticmethod
    def lookup_note(idempotency_key: str) -> dict | None:
        """The CRM can say whether a note with this key exists (reconciles ambiguous writes)."""
        call = SandboxCall.objects.filter(system="crm", idempotency_key=idempotency_key, applied=True).first()
        if call is None:
            return None
        return {"id": call.external_id, "status": "noted", "customer_id": call.payload.get("customer_id")}


def customer_record(customer_id: str) -> dict:
    """A customer as the CRM holds them (deterministic from the id). Their name and email are personal data: the
    demo's reads declare them (demo.workflows.CUSTOMER_PII), so the runs hold references to them."""
    seed = int(hashlib.sha256(customer_id.encode()).hexdigest(), 16)
    first = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken"][seed % 8]
    return {
        "id": customer_id,
        "name": f"{first} {customer_id[-4:].upper()}",
        "email": f"{customer_id}@example.com",
        "lifetime_value_cents": 5_000 + seed % 200_000,
        "refunds_last_90d": seed % 3,
        "balance_cents": seed % 10_000,
    }


def orders_of(customer_id: str) -> list[dict]:
    """A customer's orders, newest first (deterministic from the id), with what has been refunded on each so far
    (the seeded history plus the fake payment system's refunds naming the order)."""
    seed = int(hashlib.sha256(f"orders:{customer_id}".encode()).hexdigest(), 16)
    currency = ["EUR", "USD", "GBP"][seed % 3]
    items = ["headphones", "desk lamp", "running shoes", "coffee grinder", "backpack", "phone case", "kettle"]
    orders = []
    for i in range(3):
        part = seed >> (24 * i)
        order_id = f"ord_{customer_id[-4:].lower()}{i + 1}"
        total = 2_500 + part % 80_000
        refunded = total if i == 2 and part % 2 else 0  # some customers' oldest order was refunded already
        orders.append(
            {
                "id": order_id,
                "item": items[part % len(items)],
                "total_cents": total,
                "currency": currency,
                "status": "delivered" if i else "shipped",
                "placed_days_ago": 3 + 17 * i + part % 9,
                "refunded_cents": refunded,
            }
        )
    paid = (
        SandboxCall.objects.filter(system="payments", applied=True, payload__customer_id=customer_id)
        .filter(payload__has_key="order_id")
        .values_list("payload", flat=True)
    )
    for payload in paid:
        for order in orders:
            if order["id"] == payload.get("order_id"):
                order["refunded_cents"] += int(payload.get("amount_cents") or 0)
    return orders


class Tools:
    """The tool clients a step sees as `ctx.tools` (settings.AGENT_TOOLS), bound to the run and the step."""

    def __init__(self, run: Run, step: str):
        self.payments = Payments(run, step)
        self.email = Email(run, step)
        self.crm = Crm(run, step)


def stats(effects_only: bool = False) -> dict:
    """Side effects received per system, and duplicates: calls beyond the first for one idempotency key.
    `effects_only`: count only writes (calls with an idempotency key), not the CRM's reads."""
    applied = SandboxCall.objects.filter(applied=True)
    if effects_only:
        applied = applied.exclude(idempotency_key="")
    per_system = dict(applied.values_list("system").annotate(n=Count("id")))
    duplicates = sum(
        n - 1
        for n in applied.exclude(idempotency_key="")
        .filter(~Q(system="model"))
        .values("system", "idempotency_key")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .values_list("n", flat=True)
    )
    return {
        "channels": {name: per_system.get(name, 0) for name in ("payments", "email", "crm")},
        "duplicates": duplicates,
    }
