"""W3C trace context for the client's calls, and the span around a gated tool call (README, "Tracing").

Every call carries a `traceparent`, so that the console's spans of one approval request form one trace, joined to
the agent's own when it has one:

- with opentelemetry-api installed (the `[otel]` extra) and a valid span current, the current context is injected
  (the global propagator's headers: tracestate and baggage come along);
- otherwise the client makes a trace id per approval request and remembers it by the request's idempotency key and
  id, so that its ask, its polls, its consume and its result share one trace (each call a fresh span id), even when
  they are separate calls of the client (`request_approval`, then `wait`, `consume`, `report`).

`gate()` is the span an adapter (or `require_approval`) opens around the tool call it gates; without OpenTelemetry
it costs nothing and records nothing. Its attributes never hold the call's arguments (they may be personal data).
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import httpx

from hitl_client.models import ApprovalRequest, RequestStatus

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _OTEL = True
except ImportError:  # opentelemetry-api is optional (the [otel] extra): the client makes its own trace ids
    _OTEL = False

_TRACER = "hitl_client"
# The span attributes of a gated tool call: what ran, where it was asked, which request, what a person decided.
TOOL, CHANNEL, REQUEST_ID, DECISION = "hitl.tool.name", "hitl.channel", "hitl.approval_request.id", "hitl.decision"
# Sampled: the client records nothing itself, and an unsampled parent would make a parent-based sampler at the
# console drop the request's spans, which is the trace this header exists for.
_FLAGS = "01"
# Requests remembered per client (by key and by id): enough for the requests in flight, bounded for a long process.
_REMEMBERED = 4096


def carried() -> dict[str, str] | None:
    """The headers of the current OpenTelemetry context, or None when OpenTelemetry is absent or no valid span is
    current. A `traceparent` is always among them, whatever propagators the application configured."""
    if not _OTEL or not trace.get_current_span().get_span_context().is_valid:
        return None
    headers: dict[str, str] = {}
    propagate.inject(headers)
    if "traceparent" not in headers:  # the application's propagators are not W3C's (B3, say): add it
        TraceContextTextMapPropagator().inject(headers)
    return headers


class Traces:
    """The trace id of each approval request this client called about while no span was current, by the keys its
    calls name it with (`ask:<channel>:<idempotency key>` for the ask, `id:<id>` after): one per client, shared by
    its threads."""

    def __init__(self, size: int = _REMEMBERED) -> None:
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def headers(self, trace_key: str | None) -> dict[str, str]:
        """The trace headers of one call about the request named `trace_key` (None: a call about no one
        request, in a trace of its own)."""
        active = carried()
        if active is not None:
            return active
        trace_id = self._trace_of(trace_key)
        return {"traceparent": f"00-{trace_id}-{_random_hex(8)}-{_FLAGS}"}

    def answered(self, trace_key: str | None, response: httpx.Response) -> None:
        """The ask's answer names the request: its later calls (by id) join the ask's trace."""
        if trace_key is None or not trace_key.startswith("ask:") or not response.is_success:
            return
        with self._lock:
            trace_id = self._ids.get(trace_key)
        if trace_id is None:  # asked within a span: the span's trace is the agent's, not remembered here
            return
        try:
            request_id = response.json().get("id")
        except (ValueError, AttributeError):
            return  # not the contract's answer: the flow says so
        if isinstance(request_id, str):
            self._remember(f"id:{request_id}", trace_id)

    def _trace_of(self, trace_key: str | None) -> str:
        if trace_key is None:
            return _random_hex(16)
        with self._lock:  # one check-and-set: two threads asking about one request get one trace
            trace_id = self._ids.get(trace_key) or _random_hex(16)
            self._keep(trace_key, trace_id)
        return trace_id

    def _remember(self, trace_key: str, trace_id: str) -> None:
        with self._lock:
            self._keep(trace_key, self._ids.get(trace_key, trace_id))

    def _keep(self, trace_key: str, trace_id: str) -> None:
        """Under the lock: the key is the newest, and the oldest beyond the size are forgotten."""
        self._ids[trace_key] = trace_id
        self._ids.move_to_end(trace_key)
        while len(self._ids) > self._size:
            self._ids.popitem(last=False)


def _random_hex(size: int) -> str:
    """A random id of `size` bytes, never all zeros (W3C: an invalid id)."""
    while True:
        value = secrets.token_hex(size)
        if value.strip("0"):
            return value


class Gate:
    """The span of one gated tool call, told what the console said about its request (`saw`). A no-op without
    OpenTelemetry, or when no tracer provider records."""

    def __init__(self, span: Any, tool: str, channel: str) -> None:
        self.span, self.tool, self.channel = span, tool, channel

    def saw(self, request: ApprovalRequest) -> None:
        """The request's id, and its decision once there is one: approved, edited (approved with a reviewer's
        changes), rejected, expired or cancelled."""
        if self.span is None:
            return
        self.span.set_attribute(REQUEST_ID, request.id)
        if request.decided:
            edited = request.status is RequestStatus.APPROVED and request.edited
            self.span.set_attribute(DECISION, "edited" if edited else request.status.value)

    def failed(self, exc: BaseException) -> None:
        """An exception out of the gated call: the request it names is seen; unless it was declined (a decision,
        not an error), the span's status is an error, with the exception's type only (its message may quote the
        arguments)."""
        if self.span is None:
            return
        request = getattr(exc, "request", None)
        if isinstance(request, ApprovalRequest):
            self.saw(request)
            if request.status in (RequestStatus.REJECTED, RequestStatus.EXPIRED, RequestStatus.CANCELLED):
                return
        self.span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__qualname__))
        self.span.set_attribute("error.type", type(exc).__qualname__)


_NO_SPAN = Gate(None, "", "")
_open: ContextVar[Gate | None] = ContextVar("hitl_client_gate", default=None)


@contextmanager
def gate(tool: str, channel: str) -> Iterator[Gate]:
    """The span `hitl.gated_tool <tool>` around one gated call, current while it runs, so the request's calls
    share its trace and the tool's own spans are its children. Within a gate already open for the same tool and
    channel (an adapter's around `require_approval`'s), that one: one span per gated call."""
    outer = _open.get()
    if outer is not None and (outer.tool, outer.channel) == (tool, channel):
        try:
            yield outer
        except BaseException as exc:
            outer.failed(exc)
            raise
        return
    if not _OTEL:
        yield _NO_SPAN
        return
    with trace.get_tracer(_TRACER).start_as_current_span(
        f"hitl.gated_tool {tool}",
        attributes={TOOL: tool, CHANNEL: channel},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        opened = Gate(span, tool, channel)
        token = _open.set(opened)
        try:
            yield opened
        except BaseException as exc:
            opened.failed(exc)
            raise
        finally:
            _open.reset(token)
