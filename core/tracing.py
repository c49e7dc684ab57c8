"""OpenTelemetry traces (docs/observability.md): the one place that knows the SDK.

Off unless OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) or OTEL_TRACES_EXPORTER is set, and
OTEL_TRACES_EXPORTER is not `none`. On, every process (the web server, each worker) exports its spans through a
BatchSpanProcessor to the OTLP/HTTP exporter, both configured by the SDK's own OTEL_* variables (OTEL_SERVICE_NAME,
OTEL_EXPORTER_OTLP_*, OTEL_BSP_*, OTEL_TRACES_SAMPLER). `setup()` runs once per process (core.apps).

Off, nothing of the SDK is imported or made: `span()` returns one shared null context manager after a check of a
module-level bool, and callers that would build attributes check `ENABLED` first, so a step allocates nothing for
tracing. A W3C `traceparent` sent by a caller is still honoured when off (`server_span`): the run it creates takes
its trace id, so that its log lines correlate with the caller's trace.

Spans carry ids, names, kinds and counts, never a prompt, a completion, an argument or an exception's message: what
a run handles may be personal data (core.pii), and a trace goes to another system.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

from django.conf import settings
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ENABLED = False  # set once by setup(); read by every caller on its fast path
NULL = contextlib.nullcontext()  # what span() returns when off: shared, reentrant, yields None
CLIENT, SERVER = SpanKind.CLIENT, SpanKind.SERVER  # the kinds callers name (a call out; a request served)
SERVICE_NAME = "hitl-console"

_tracer: trace.Tracer | None = None
_provider: Any = None  # the SDK's TracerProvider, when on
_propagator = TraceContextTextMapPropagator()
# When off: the trace a request continues (trace id, traceparent), so that the run it creates takes that trace id.
_incoming: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("hitl_incoming_trace", default=None)


def configured() -> bool:
    """Whether the environment asks for traces: an OTLP endpoint or an exporter, and the exporter is not `none`."""
    exporter = _exporter_name()
    if exporter == "none" or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return bool(exporter or endpoint)


def _exporter_name() -> str:
    return os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()


def setup(exporter: Any = None) -> bool:
    """Turn tracing on for this process when the environment asks for it (or with `exporter`, a SpanExporter that a
    test passes: spans are then exported as each ends). Idempotent; True when on."""
    global ENABLED, _tracer, _provider
    if ENABLED:
        return True
    if exporter is None and not configured():
        return False
    # The SDK is imported only when traces are on: a process without them never loads it.
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415 - loaded only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415 - loaded only when tracing is on
    from opentelemetry.sdk.trace.export import (  # noqa: PLC0415 - loaded only when tracing is on
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": SERVICE_NAME}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif _exporter_name() == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415 - only when on
            OTLPSpanExporter,
        )

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _provider, _tracer = provider, provider.get_tracer("hitl")
    ENABLED = True
    return True


def shutdown() -> None:
    """Export what is buffered and turn tracing off (tests; a process exits through the SDK's own atexit hook)."""
    global ENABLED, _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    ENABLED, _tracer, _provider = False, None, None


def flush(timeout_ms: int = 5000) -> None:
    """Export the spans still buffered (a worker shutting down)."""
    if _provider is not None:
        _provider.force_flush(timeout_ms)


# --- spans ----------------------------------------------------------------------------------------------------------


def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    parent: str | otel_context.Context | None = None,
    links: Iterable[str] = (),
    kind: SpanKind = SpanKind.INTERNAL,
    ok: tuple[type[BaseException], ...] = (),
):
    """A context manager: the span `name`, current inside it, yielding it (None when off). `parent`: a traceparent
    or a Context (default: the current span). `links`: traceparents of spans this one follows from. An exception
    leaving it marks it an error with the exception's class only (its message may hold personal data), unless it is
    one of `ok` (control flow)."""
    if not ENABLED:
        return NULL
    return _span(name, attributes, parent, links, kind, ok)


@contextlib.contextmanager
def _span(name, attributes, parent, links, kind, ok) -> Iterator[trace.Span]:
    assert _tracer is not None
    parent_context = context_of(parent) if isinstance(parent, str) else parent
    with _tracer.start_as_current_span(
        name,
        context=parent_context,
        kind=kind,
        attributes=attributes,
        links=_links(links),
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        try:
            yield current
        except BaseException as exc:
            if not isinstance(exc, ok):
                failed(current, exc)
            raise


def failed(current: trace.Span, exc: BaseException) -> None:
    """Mark `current` failed by `exc`: its class, never its message."""
    current.set_attribute("error.type", exc.__class__.__name__)
    current.set_status(Status(StatusCode.ERROR, exc.__class__.__name__))


def start_span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    parent: str | None = None,
    start_time: datetime | None = None,
) -> trace.Span | None:
    """A span started now (or at `start_time`), not made current, for its caller to end (`end_span`): one that
    covers what happened before it was made, such as a person's wait for a card. None when off."""
    if not ENABLED:
        return None
    assert _tracer is not None
    return _tracer.start_span(
        name,
        context=context_of(parent) if parent else None,
        attributes=attributes,
        start_time=nanoseconds(start_time) if start_time is not None else None,
    )


def end_span(started: trace.Span | None, end_time: datetime | None = None) -> None:
    if started is not None:
        started.end(end_time=nanoseconds(end_time) if end_time is not None else None)


def note(key: str, value: Any) -> None:
    """Set an attribute on the current span, when there is one (off: nothing)."""
    if ENABLED:
        trace.get_current_span().set_attribute(key, value)


def link(traceparent: str) -> None:
    """Link the current span to the span `traceparent` names (a resumed step to the wait that resumed it)."""
    if not ENABLED or not traceparent:
        return
    linked = _span_context(traceparent)
    if linked is not None:
        trace.get_current_span().add_link(linked)


def nanoseconds(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000_000)


# --- W3C trace context ----------------------------------------------------------------------------------------------


def context_of(traceparent: str | None) -> otel_context.Context | None:
    """The Context a traceparent names (a remote parent); None when it is missing or malformed: a new trace."""
    if not traceparent:
        return None
    extracted = _propagator.extract({"traceparent": traceparent})
    return extracted if trace.get_current_span(extracted).get_span_context().is_valid else None


def _span_context(traceparent: str) -> SpanContext | None:
    extracted = context_of(traceparent)
    return None if extracted is None else trace.get_current_span(extracted).get_span_context()


def _links(traceparents: Iterable[str]) -> list[Link]:
    return [Link(found) for tp in traceparents if tp and (found := _span_context(tp)) is not None]


def traceparent_of(current: trace.Span | None = None) -> str:
    """The W3C traceparent of `current` (default: the current span); "" when there is none."""
    current = trace.get_current_span() if current is None else current
    found = current.get_span_context()
    if not found.is_valid:
        return ""
    return f"00-{found.trace_id:032x}-{found.span_id:016x}-{int(found.trace_flags):02x}"


def parent_of(traceparent: str, trace_id: str, span_id: str) -> str:
    """A run's place in its trace: its root's traceparent, or, for a run made without one (before traces, or by
    a process with traces off and no caller's traceparent), a remote parent in the run's own trace (`trace_id`,
    with `span_id` standing for its root), so that its spans still share the run's trace id."""
    if traceparent:
        return traceparent
    return f"00-{trace_id}-{span_id}-{int(TraceFlags.SAMPLED):02x}"


def current() -> tuple[str, str] | None:
    """(trace id, traceparent) of the trace being served: the current span's when on, else the one a request
    continues (`server_span` with tracing off); None when neither."""
    if ENABLED:
        found = trace.get_current_span().get_span_context()
        if found.is_valid:
            return f"{found.trace_id:032x}", traceparent_of()
    return _incoming.get()


@contextlib.contextmanager
def server_span(name: str, headers: Mapping[str, str], attributes: Mapping[str, Any] | None = None):
    """A request that may start a run (POST /api/runs, a webhook delivery, an approval request): a SERVER span
    continuing the caller's `traceparent` when it sent a valid one (a malformed one is ignored: a new trace), or,
    with tracing off, that traceparent remembered for the run the request creates (`current`). Yields the span or
    None."""
    traceparent = headers.get("traceparent") or ""
    if ENABLED:
        parent = context_of(traceparent)
        if parent is not None and (tracestate := headers.get("tracestate")):
            parent = _propagator.extract({"traceparent": traceparent, "tracestate": tracestate})
        with span(name, attributes, parent=parent, kind=SpanKind.SERVER) as started:
            yield started
        return
    found = _span_context(traceparent) if traceparent else None
    if found is None:
        yield None
        return
    token = _incoming.set((f"{found.trace_id:032x}", traceparent.strip().lower()))
    try:
        yield None
    finally:
        _incoming.reset(token)


# --- logs -----------------------------------------------------------------------------------------------------------


def add_span_id(logger: Any, method: str, event: dict) -> dict:
    """A structlog processor: the current span's id on each log line written inside one, and its trace id where none
    is bound (a run's is, runs.engine: the same id). Off: one check of a bool."""
    if ENABLED:
        found = trace.get_current_span().get_span_context()
        if found.is_valid:
            event.setdefault("trace_id", f"{found.trace_id:032x}")
            event.setdefault("span_id", f"{found.span_id:016x}")
    return event


def trace_url(trace_id: str) -> str:
    """The trace's page in a tracing UI (TRACE_URL_TEMPLATE, `{trace_id}` replaced); "" when none is configured."""
    template = settings.TRACE_URL_TEMPLATE
    return template.replace("{trace_id}", trace_id) if template and trace_id else ""
