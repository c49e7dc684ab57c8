"""The demo's scripted model: a deterministic fake seeded by the run input, so that demo runs and tests are
repeatable. It records each call (a `SandboxCall` of system "model"), which is how the tests count that a done
step is never computed again, and it takes the same injected faults as the fake tools (demo.sandbox): 429, 5xx,
timeout, latency, hang."""

from __future__ import annotations

import hashlib
import json
import random

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
