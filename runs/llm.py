"""The model a step sees as `ctx.model` (settings.AGENT_MODEL): `complete(task, **payload) -> dict` for a JSON
answer, and `chat(messages, tools)` for one turn of a tool-calling agent.

An OpenAI-compatible endpoint when MODEL_BASE_URL is set (OpenAI, vLLM, Ollama, LiteLLM: through the official
`openai` SDK); otherwise SCRIPTED_MODEL, in development and tests the demo's deterministic scripted fake
(demo.model), so that demo runs and tests are repeatable.
"""

from __future__ import annotations

import functools
import json
import os
from decimal import Decimal

import openai
from django.conf import settings
from django.utils.module_loading import import_string

from core import tracing
from runs import breakers
from runs.errors import Fatal, Retryable
from runs.models import Run
from runs.steps import Usage


def model_for_run(run: Run, step: str):
    """The OpenAI-compatible endpoint when MODEL_BASE_URL is set, else the fallback (SCRIPTED_MODEL: the demo's
    scripted fake in development and tests)."""
    if settings.MODEL_BASE_URL:
        return OpenAICompatibleModel(run, step)
    if not settings.SCRIPTED_MODEL:
        raise Fatal("no model is configured: set MODEL_BASE_URL (an OpenAI-compatible endpoint)")
    return import_string(settings.SCRIPTED_MODEL)(run, step)


def cost(model: str, tokens_in: int, tokens_out: int) -> Decimal:
    """What the tokens cost in USD, from the model's (input, output) price per million tokens (MODEL_PRICES)."""
    price_in, price_out = settings.MODEL_PRICES.get(model, settings.MODEL_DEFAULT_PRICE)
    return (Decimal(price_in) * tokens_in + Decimal(price_out) * tokens_out) / 1_000_000


class Model:
    """A step's model: what it answers, and the tokens it used (`usage`, which the step's Context records on the
    step). `name` is the model's name as the price table (MODEL_PRICES) knows it."""

    name = ""
    provider = "_OTHER"  # its provider as traces name it (gen_ai.provider.name: runs.tape.model_span)

    def __init__(self, run: Run, step: str):
        self.run = run
        self.step = step
        self.usage = Usage()  # the step's Context reports it on the step

    def _account(self, tokens_in: int, tokens_out: int) -> None:
        self.usage.add(tokens_in, tokens_out, cost(self.name, tokens_in, tokens_out))

    def chat(self, messages: list[dict], tools: list[dict], *, tool_choice="auto") -> dict:
        """One assistant turn (see OpenAICompatibleModel.chat). A model that cannot call tools says so, rather than
        an agent step failing on an AttributeError that would be retried."""
        raise Fatal("this model cannot call tools")


@functools.lru_cache(maxsize=8)
def _client(base_url: str, api_key: str, timeout: float, pid: int) -> openai.OpenAI:
    """One SDK client (and its connection pool) per endpoint and process, shared by the steps; a forked process
    makes its own. The SDK never retries: the engine does, with its backoff and attempt budget."""
    # Local servers (vLLM, Ollama) take any key, but the SDK refuses to start without one.
    return openai.OpenAI(base_url=base_url, api_key=api_key or "unused", timeout=timeout, max_retries=0)


def client() -> openai.OpenAI:
    return _client(settings.MODEL_BASE_URL, settings.MODEL_API_KEY, settings.MODEL_TIMEOUT_SECONDS, os.getpid())


class OpenAICompatibleModel(Model):
    """Chat completions on MODEL_BASE_URL with MODEL_NAME. Errors are classified for the engine: Retryable (429,
    5xx, timeouts, connection errors, an answer that is not what was asked) or Fatal (other 4xx, a refusal)."""

    provider = "openai"

    def __init__(self, run: Run, step: str):
        super().__init__(run, step)
        self.name = settings.MODEL_NAME

    def complete(self, task: str, **payload) -> dict:
        """The model's answer to `task` on `payload`, as the JSON object it was asked for."""
        message = self._create(
            messages=[
                {"role": "system", "content": f"You are a support agent. Task: {task}. Answer one JSON object."},
                {"role": "user", "content": json.dumps(payload, default=str)},
            ],
            response_format={"type": "json_object"},
        )
        try:
            answer = json.loads(message.content or "")
        except ValueError as exc:
            raise Retryable(f"model answer is not the JSON asked for: {exc}") from exc
        if not isinstance(answer, dict):
            raise Retryable(f"model answer is not the JSON object asked for: {type(answer).__name__}")
        return answer

    def chat(self, messages: list[dict], tools: list[dict], *, tool_choice="auto") -> dict:
        """One chat completion with tool calling. `tools` are OpenAI function tools ({"type": "function",
        "function": {name, description, parameters}}). Returns the assistant message as a plain JSON-able dict
        in the chat format, {"role": "assistant", "content", "tool_calls": [{id, type, function: {name,
        arguments}}]} (`arguments` the JSON string as the model sent it; `tool_calls` [] when there are none), so
        that it can be recorded as a step's output and sent back as a message of the next turn."""
        request: dict = {"messages": [_wire(m) for m in messages]}
        if tools:  # OpenAI refuses an empty tool list, and a tool_choice without tools
            request |= {"tools": tools, "tool_choice": tool_choice}
        message = self._create(**request)
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls or []
            if call.type == "function"  # the only kind of tool offered
        ]
        if not message.content and not calls:
            raise Retryable("model answer is empty: no content and no tool calls")
        return {"role": "assistant", "content": message.content, "tool_calls": calls}

    def _create(self, **request):
        """One chat completion: its tokens accounted, its errors classified; the first choice's message."""
        # Through the model's circuit breaker, which sees the errors as classified here (a 4xx is an answer).
        with breakers.guard("model"):
            try:
                response = client().chat.completions.create(model=self.name, **request)
            except openai.APIError as exc:
                raise _classified(exc) from exc
        if tracing.ENABLED:  # on the call's span (runs.tape.model_span): ids, never content
            tracing.note("gen_ai.response.model", response.model or self.name)
            tracing.note("gen_ai.response.id", response.id or "")
            tracing.note("gen_ai.response.finish_reasons", [c.finish_reason or "" for c in response.choices or []])
        if response.usage is not None:  # spent even when the answer is refused
            self._account(response.usage.prompt_tokens or 0, response.usage.completion_tokens or 0)
        if not response.choices:
            raise Retryable("model answer has no choices")
        choice = response.choices[0]
        if choice.message.refusal:
            raise Fatal(f"model refused: {choice.message.refusal[:500]}")
        if choice.finish_reason == "content_filter":
            raise Fatal("model answer was withheld by its content filter")
        return choice.message


def _classified(exc: openai.APIError) -> Exception:
    """The engine's error for an SDK error: the messages name the status or the timeout, which is how the engine
    tells retry causes apart (runs.engine.record_retry)."""
    if isinstance(exc, openai.APITimeoutError):
        return Retryable(f"model timed out after {settings.MODEL_TIMEOUT_SECONDS:g}s")
    if isinstance(exc, openai.APIConnectionError):
        return Retryable(f"model unreachable: {exc.__cause__ or exc}")
    if isinstance(exc, openai.APIStatusError):
        if exc.status_code == 429 or exc.status_code >= 500:
            return Retryable(f"model answered {exc.status_code}")
        return Fatal(f"model answered {exc.status_code}: {exc.response.text[:500]!r}")
    return Retryable(f"model answer is not what was asked: {exc}")  # e.g. a body the SDK cannot read


def _wire(message: dict) -> dict:
    """A message as the API takes it: a recorded assistant turn without tool calls keeps `tool_calls: []`, which
    OpenAI refuses (an empty array), so it is left out."""
    if message.get("role") == "assistant" and "tool_calls" in message and not message["tool_calls"]:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    return message
