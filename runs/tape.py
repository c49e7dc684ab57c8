"""A step's tape: what its code drew from outside the run, in the order it drew it, recorded with the step's
checkpoint (runs.models.Step.tape) so that a replay (runs.replay) can feed it back instead of calling anything.

Each entry names the call and hashes what was asked (`asked`, a canonical hash of the arguments), and keeps the
answer where the record holds it nowhere else:

- `model.<method>`: a model call through `ctx.model` (`complete`, `chat`); its answer. A chat's `parts` hash each
  message, so a replay can say which one changed (the system prompt, the user's message, a tool result).
- `tools.<system>.<method>`: a tool call through `ctx.tools` (a read); its answer. Calls made inside an effect
  (its `call` and `lookup`) are not recorded: the effect is, and its answer is its receipt's.
- `effect`: `ctx.effect`; its receipt key, and the hash of its preview (what it would send). The answer is the
  receipt's response.
- `gate`: `ctx.gate`; the hash of what it proposed (the card's args hash). The answer is the card's decision.
- `now`, `new_id`, `recorded.<name>`: `ctx.now()`, `ctx.new_id()`, `ctx.recorded(name, fn, ...)`: anything
  else that is not the same twice (the time, an id, a read the step makes without a tool client); its answer.

An answer that cannot be kept as JSON is recorded as `unrecordable` (its type): the step then cannot be replayed,
which the replay says. A step that drew nothing has no tape (NULL), which costs nothing to write."""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from core import tracing
from runs.gates import canonical_hash

SHORT = 12  # characters of a part's hash: enough to tell the messages of one request apart


def asked(args: tuple = (), kwargs: dict | None = None) -> str:
    """The hash of what a call was asked: its arguments, canonically."""
    return canonical_hash([list(args), kwargs or {}])


def parts_of(args: tuple) -> list[str] | None:
    """A chat's messages, each hashed (the first argument when it is a list of messages)."""
    if args and isinstance(args[0], list) and all(isinstance(m, dict) for m in args[0]):
        return [canonical_hash(m)[:SHORT] for m in args[0]]
    return None


class Tape(list):
    """The entries of one step's attempt. `paused` while an effect calls its tool (the effect is the entry)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = 0

    def record(self, call: str, asked_hash: str | None, answer: Any = None, *, keep: bool = True, **extra) -> None:
        if self.paused:
            return
        entry: dict[str, Any] = {"call": call, "asked": asked_hash, **extra}
        if keep:
            try:
                entry["answer"] = json.loads(json.dumps(answer, cls=DjangoJSONEncoder))
            except (TypeError, ValueError):
                entry["unrecordable"] = type(answer).__name__
        self.append(entry)

    def stored(self) -> list | None:
        """What the checkpoint writes: None for a step that drew nothing."""
        return list(self) or None


class Recorder:
    """`ctx.model` and `ctx.tools` as a step sees them: the object the deployment configured, whose public methods
    record each call on the step's tape. `ctx.tools.<system>` is itself recorded, one level down."""

    def __init__(self, target: Any, tape: Tape, path: str, systems: bool = False):
        self._target, self._tape, self._path, self._systems = target, tape, path, systems

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name.startswith("_"):
            return value
        if callable(value) and not isinstance(value, type):
            return functools.partial(self._call, f"{self._path}.{name}", value)
        if self._systems and value is not None and not isinstance(value, str | int | float | bool | dict | list):
            return Recorder(value, self._tape, f"{self._path}.{name}")
        return value

    def _call(self, path: str, fn, *args, **kwargs):
        with self._span(path) if tracing.ENABLED else tracing.NULL:
            answer = fn(*args, **kwargs)
        parts = parts_of(args)
        self._tape.record(path, asked(args, kwargs), answer, **({"parts": parts} if parts else {}))
        return answer

    def _span(self, path: str):
        """The call's span (core.tracing): a model call as a GenAI client span, a tool call as `tool.read` (or
        `tool.call` inside an effect, whose span it is under). Names and counts only, never what was asked."""
        if self._path == "model":
            return model_span(self._target, path.rpartition(".")[2])
        name = "tool.call" if self._tape.paused else "tool.read"
        return tracing.span(name, {"hitl.tool": path.removeprefix("tools.")}, kind=tracing.CLIENT)


@contextlib.contextmanager
def model_span(model: Any, method: str):
    """A model call as the OpenTelemetry GenAI conventions describe it (`gen_ai.*`: the operation, the provider, the
    model asked for, the tokens used, from the model's `usage`), never the prompt or the completion. `provider` and
    `name` are the model's (runs.llm.Model)."""
    name = getattr(model, "name", "") or "unknown"
    provider = getattr(model, "provider", "") or "_OTHER"
    usage = getattr(model, "usage", None)
    before = (usage.tokens_in, usage.tokens_out) if usage is not None else (0, 0)
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.system": provider,
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": name,
        "hitl.model.method": method,
    }
    with tracing.span(f"chat {name}", attributes, kind=tracing.CLIENT) as span:
        try:
            yield span
        finally:
            if span is not None and usage is not None:
                span.set_attribute("gen_ai.usage.input_tokens", usage.tokens_in - before[0])
                span.set_attribute("gen_ai.usage.output_tokens", usage.tokens_out - before[1])


def unwrap(value: Any) -> Any:
    """The configured object behind a Recorder (what the engine made)."""
    return value._target if isinstance(value, Recorder) else value
