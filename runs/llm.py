"""The model a step sees as `ctx.model` (settings.AGENT_MODEL): `complete(task, **payload) -> dict`.

Unless MODEL_BASE_URL points at an OpenAI-compatible endpoint, a deterministic scripted fake answers, seeded
by the run input, so that demo runs and tests are repeatable. It records each call (a `SandboxCall` of system
"model"), which is how the tests count that a done step is never computed again, and it takes the same
injected faults as the fake tools (runs.sandbox): 429, 5xx, timeout, latency, hang.
"""

from __future__ import annotations

import hashlib
import json
import random
import urllib.error
import urllib.request
from decimal import Decimal

from django.conf import settings

from runs import breakers
from runs.models import Run, SandboxCall
from runs.sandbox import lose_the_answer, next_fault, refuse_or_delay
from runs.workflow import Fatal, Retryable, Usage

PRICE_PER_1K_TOKENS = Decimal("0.0006")


def model_for_run(run: Run, step: str):
    if settings.MODEL_BASE_URL:
        return OpenAICompatibleModel(run, step)
    return ScriptedModel(run, step)


class Model:
    def __init__(self, run: Run, step: str):
        self.run = run
        self.step = step
        self.usage = Usage()  # the step's Context reports it on the step

    def _account(self, tokens_in: int, tokens_out: int) -> None:
        self.usage.add(tokens_in, tokens_out, PRICE_PER_1K_TOKENS * (tokens_in + tokens_out) / 1000)


class ScriptedModel(Model):
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


class OpenAICompatibleModel(Model):
    """Chat completions on MODEL_BASE_URL, answering JSON. Errors are classified for the engine."""

    TIMEOUT_SECONDS = 60

    def complete(self, task: str, **payload) -> dict:
        body = {
            "model": settings.MODEL_NAME,
            "response_format": {"type": "json_object"},
            "messages": [
                {
                    "role": "system",
                    "content": f"You are a support agent. Task: {task}. Answer one JSON object.",
                },
                {"role": "user", "content": json.dumps(payload, default=str)},
            ],
        }
        request = urllib.request.Request(
            settings.MODEL_BASE_URL.rstrip("/") + "/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {settings.MODEL_API_KEY}"},
        )
        # Through the model's circuit breaker, which sees the errors as classified here (a 4xx is an answer).
        with breakers.guard("model"):
            try:
                with urllib.request.urlopen(request, timeout=self.TIMEOUT_SECONDS) as response:
                    answer = json.load(response)
            except urllib.error.HTTPError as exc:
                if exc.code == 429 or exc.code >= 500:
                    raise Retryable(f"model answered {exc.code}") from exc
                raise Fatal(f"model answered {exc.code}: {exc.read()[:500]!r}") from exc
            except (urllib.error.URLError, TimeoutError) as exc:
                raise Retryable(f"model unreachable: {exc}") from exc
        try:
            content = json.loads(answer["choices"][0]["message"]["content"])
        except (KeyError, IndexError, ValueError) as exc:
            raise Retryable(f"model answer is not the JSON asked for: {exc}") from exc
        usage = answer.get("usage", {})
        self._account(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        return content
