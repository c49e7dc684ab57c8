"""The demo's scripted model: a deterministic fake seeded by the run input, so that demo runs and tests are
repeatable. It records each call (a `SandboxCall` of system "model"), which is how the tests count that a done
step is never computed again, and it takes the same injected faults as the fake tools (demo.sandbox): 429, 5xx,
timeout, latency, hang.

`complete(task, ...)` answers the fixed steps of `refund`; `chat(messages, tools)` is the tool-calling agent of
`support_agent`: it decides its next call from the conversation so far (customer, then orders, then a refund,
an email, a CRM note, then its answer), and changes course when a tool answers an error or a reviewer rejects a
call (no refund, no email about one: a note saying why, and an answer)."""

from __future__ import annotations

import hashlib
import json
import random
import re

from demo.models import SandboxCall
from demo.sandbox import lose_the_answer, next_fault, refuse_or_delay
from runs import breakers
from runs.llm import Model


class ScriptedModel(Model):
    name = "scripted"  # its price in MODEL_PRICES

    def complete(self, task: str, **payload) -> dict:
        with breakers.guard("model"):  # while the model's breaker is open, no call (BreakerOpen, a Wait)
            return self._complete(task, **payload)

    def _complete(self, task: str, **payload) -> dict:
        fault = next_fault(self.run, "model", self.step)
        SandboxCall.objects.create(
            system="model",
            operation=self.step,
            run_id=self.run.id,
            payload={"task": task},
            applied=fault not in ("429", "5xx", "fatal"),
        )
        refuse_or_delay(fault, f"model {task}")
        lose_the_answer(fault, f"model {task}")
        seed = int(hashlib.sha256(json.dumps([task, payload], sort_keys=True, default=str).encode()).hexdigest(), 16)
        answer = getattr(self, f"_{task}")(random.Random(seed), **payload)
        # A scripted model has no tokenizer: about four characters a token, like English text.
        self._account(len(json.dumps([task, payload], default=str)) // 4 + 20, len(json.dumps(answer)) // 4 + 5)
        return answer

    def _classify(self, rng: random.Random, *, reason: str, amount_cents: int, **_) -> dict:
        category = next(
            (
                c
                for word, c in (
                    ("damag", "damaged_item"),
                    ("late", "late_delivery"),
                    ("charge", "double_charge"),
                )
                if word in reason.lower()
            ),
            rng.choice(["damaged_item", "late_delivery", "not_as_described"]),
        )
        risk = "high" if amount_cents >= 50_000 else "medium" if amount_cents >= 5_000 else "low"
        return {"category": category, "risk": risk, "confidence": round(rng.uniform(0.7, 0.99), 2)}

    def _draft_refund(
        self,
        rng: random.Random,
        *,
        customer: dict,
        amount_cents: int,
        currency: str,
        reason: str,
        category: str,
        **_,
    ) -> dict:
        rule = {"damaged_item": "RF-2", "late_delivery": "RF-3", "double_charge": "RF-1"}.get(category, "RF-9")
        amount = f"{amount_cents / 100:.2f} {currency}"
        return {
            "refund": {
                "customer_id": customer["id"],
                "amount_cents": amount_cents,
                "currency": currency,
                "reason": reason,
            },
            "email": {
                "to": customer["email"],
                "subject": "Your refund is on its way",
                "body": f"Hello {customer['name']},\n\nWe have refunded {amount} for: {reason}.\n"
                f"It should reach your account within 5 business days.\n\nThe support team",
            },
            "rationale": {
                "summary": f"Refund {amount} to {customer['name']} ({category.replace('_', ' ')}); "
                f"{customer['refunds_last_90d']} refunds in the last 90 days.",
                "rule_id": rule,
                "confidence": round(rng.uniform(0.75, 0.98), 2),
                "citations": [
                    {"title": f"Refund policy {rule}", "url": f"https://policies.example.com/refunds#{rule}"},
                    {
                        "title": "Customer record",
                        "url": f"https://crm.example.com/customers/{customer['id']}",
                    },
                ],
            },
        }

    # --- the support agent -------------------------------------------------------------------------------------

    def chat(self, messages: list[dict], tools: list[dict]) -> dict:
        with breakers.guard("model"):
            return self._chat(messages, tools)

    def _chat(self, messages: list[dict], tools: list[dict]) -> dict:
        turn = sum(1 for m in messages if m.get("role") == "assistant") + 1
        fault = next_fault(self.run, "model", self.step)
        SandboxCall.objects.create(
            system="model",
            operation=self.step,
            run_id=self.run.id,
            payload={"task": "chat", "turn": turn},
            applied=fault not in ("429", "5xx", "fatal"),
        )
        refuse_or_delay(fault, "model chat")
        lose_the_answer(fault, "model chat")
        say, call = _support_next(messages, {t["function"]["name"] for t in tools})
        answer: dict = {"role": "assistant", "content": say, "tool_calls": []}
        if call is not None:
            name, arguments = call
            answer["tool_calls"] = [
                {
                    "id": f"call_{turn}_{name}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
            ]
        self._account(len(json.dumps([messages, tools], default=str)) // 4 + 20, len(json.dumps(answer)) // 4 + 5)
        return answer


def _support_next(messages: list[dict], tools: set[str]) -> tuple[str, tuple[str, dict] | None]:
    """The support agent's next move: (what it says, the call it makes or None for its final answer)."""
    opening = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
    customer_id = _header(opening, "Customer id") or ""
    order_id = _header(opening, "Order id")
    if order_id == "none given":
        order_id = None
    said = opening.split("Message from the customer:", 1)[-1].strip()
    results = _tool_results(messages)

    if "lookup_customer" not in results:
        return f"Let me look up customer {customer_id}.", ("lookup_customer", {"customer_id": customer_id})
    customer, failed = results["lookup_customer"]
    if failed:
        return f"I could not look the customer up ({failed}); a person should take this one.", None
    if "list_orders" not in results:
        return "Now their orders.", ("list_orders", {"customer_id": customer_id})
    orders, failed = results["list_orders"]
    orders = orders if isinstance(orders, list) else []

    if "refund_order" not in results:
        order = _order_to_refund(orders, order_id)
        if order is not None:
            refundable = order["total_cents"] - order["refunded_cents"]
            asked = _amount_asked(said)
            amount = refundable if asked is None else min(asked, refundable)
            reason = _reason(said)
            return (
                f"{customer.get('name', 'The customer')} writes about order {order['id']} ({order['item']}, "
                f"{_money(order['total_cents'], order['currency'])}, {order['status']} "
                f"{order['placed_days_ago']} days ago): {reason.rstrip('.')}. "
                f"Refunding {_money(amount, order['currency'])}; "
                f"{customer.get('refunds_last_90d', 0)} refunds in the last 90 days.",
                (
                    "refund_order",
                    {
                        "customer_id": customer_id,
                        "order_id": order["id"],
                        "amount_cents": amount,
                        "currency": order["currency"],
                        "reason": reason,
                    },
                ),
            )
        results["refund_order"] = (None, f"no refundable order {order_id or ''}".strip())

    refund, refund_failed = results["refund_order"]
    if not refund_failed and "send_email" not in results and "send_email" in tools:
        amount = _money(refund.get("amount_cents", 0), refund.get("currency", ""))
        name = customer.get("name", "")
        return (
            f"The refund went through; telling {name} by email.",
            (
                "send_email",
                {
                    "customer_id": customer_id,
                    "to": customer.get("email", ""),
                    "subject": "Your refund is on its way",
                    "body": f"Hello {name},\n\nWe have refunded {amount} on order {refund.get('order_id', '')}.\n"
                    f"It should reach your account within 5 business days.\n\nThe support team",
                },
            ),
        )

    if "add_note" not in results:
        if refund_failed:
            text = f"Customer wrote: {said[:500]}\nNo refund: {refund_failed}."
        else:
            _, email_failed = results.get("send_email", (None, None))
            text = (
                f"Customer wrote: {said[:500]}\nRefunded {refund.get('amount_cents')} {refund.get('currency')} "
                f"cents on {refund.get('order_id')}. "
                + (f"Email not sent: {email_failed}." if email_failed else "Customer emailed.")
            )
        return "Writing a note on the customer's record.", ("add_note", {"customer_id": customer_id, "text": text})

    if refund_failed:
        return f"I did not refund the customer: {refund_failed}. The note on their record says why.", None
    _, email_failed = results.get("send_email", (None, None))
    return (
        f"Refunded {_money(refund.get('amount_cents', 0), refund.get('currency', ''))} on order "
        f"{refund.get('order_id')}"
        + (f"; the email was not sent ({email_failed})." if email_failed else " and emailed the customer.")
        + " A note is on their record.",
        None,
    )


def _header(text: str, label: str) -> str | None:
    found = re.search(rf"^{re.escape(label)}: (\S+)$", text, re.MULTILINE)
    return found.group(1) if found else None


def _tool_results(messages: list[dict]) -> dict[str, tuple]:
    """Each tool's latest outcome: (its result, None) or (the arguments it was called with, why it failed)."""
    called = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            function = call.get("function") or {}
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except ValueError:
                arguments = {}
            called[call.get("id")] = (function.get("name"), arguments)
    results: dict[str, tuple] = {}
    for m in messages:
        if m.get("role") != "tool" or m.get("tool_call_id") not in called:
            continue
        name, arguments = called[m["tool_call_id"]]
        try:
            content = json.loads(m.get("content") or "{}")
        except ValueError:
            content = {"error": "unreadable tool result"}
        result = content.get("result")
        if "error" in content:
            failed = content["error"]
            if content.get("comment"):
                failed = f"a reviewer rejected it: {content['comment']}"
            results[name] = (arguments, failed)
        elif isinstance(result, dict) and "error" in result:
            results[name] = (arguments, result["error"])
        else:
            if isinstance(result, dict) and name == "refund_order":
                result = {**arguments, **content.get("executed_arguments", {}), **result}
            results[name] = (result, None)
    return results


def _order_to_refund(orders: list[dict], order_id: str | None) -> dict | None:
    if order_id:
        return next((o for o in orders if o.get("id") == order_id and _refundable(o)), None)
    return next((o for o in orders if _refundable(o)), None)


def _refundable(order: dict) -> bool:
    return order.get("total_cents", 0) - order.get("refunded_cents", 0) > 0


def _amount_asked(text: str) -> int | None:
    """An amount the customer asked for ("12.50"), in cents."""
    found = re.search(r"(\d{1,7})[.,](\d{2})\b", text)
    return int(found.group(1)) * 100 + int(found.group(2)) if found else None


def _reason(text: str) -> str:
    first = re.split(r"(?<=[.!?])\s", text.strip(), maxsplit=1)[0]
    return (first or "customer request")[:200]


def _money(cents: int, currency: str) -> str:
    return f"{int(cents or 0) / 100:.2f} {currency}".strip()
