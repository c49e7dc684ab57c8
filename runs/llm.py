"""The model a step sees as `ctx.model` (settings.AGENT_MODEL): `complete(task, **payload) -> dict`.

An OpenAI-compatible endpoint when MODEL_BASE_URL is set; otherwise SCRIPTED_MODEL, in development and tests the
demo's deterministic scripted fake (demo.model), so that demo runs and tests are repeatable.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from decimal import Decimal

from django.conf import settings
from django.utils.module_loading import import_string

from runs import breakers
from runs.models import Run
from runs.workflow import Fatal, Retryable, Usage

PRICE_PER_1K_TOKENS = Decimal("0.0006")


def model_for_run(run: Run, step: str):
    """The OpenAI-compatible endpoint when MODEL_BASE_URL is set, else the fallback (SCRIPTED_MODEL: the demo's
    scripted fake in development and tests)."""
    if settings.MODEL_BASE_URL:
        return OpenAICompatibleModel(run, step)
    if not settings.SCRIPTED_MODEL:
        raise Fatal("no model is configured: set MODEL_BASE_URL (an OpenAI-compatible endpoint)")
    return import_string(settings.SCRIPTED_MODEL)(run, step)


class Model:
    def __init__(self, run: Run, step: str):
        self.run = run
        self.step = step
        self.usage = Usage()  # the step's Context reports it on the step

    def _account(self, tokens_in: int, tokens_out: int) -> None:
        self.usage.add(tokens_in, tokens_out, PRICE_PER_1K_TOKENS * (tokens_in + tokens_out) / 1000)


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
