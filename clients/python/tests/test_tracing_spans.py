"""With OpenTelemetry (the `[otel]` extra, and the SDK to record): the client's calls continue the agent's current
trace (its context injected: traceparent, baggage), and a gated tool call is a span `hitl.gated_tool <tool>` in it,
around the request's calls and the tool's own spans, naming the tool, the channel, the request and the decision,
never the arguments."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fake_console import FakeConsole

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry import baggage, context, trace  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

from hitl_client import Client, Rejected, require_approval  # noqa: E402

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")  # flags: sampled, and random (W3C level 2)
# Values no span may carry: they are the call's arguments (personal data, in real calls).
SECRET_ORDER, SECRET_AMOUNT = "ord-alice-8d2f", 48_213


class _WhileListening(SimpleSpanProcessor):
    """Exports only while a test listens: the provider (global, set once) outlives the test, and the console's
    suite, which runs these tests too, must not pile its own spans up in the exporter."""

    listening = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.listening:
            super().on_end(span)


_EXPORTER = InMemorySpanExporter()
_PROCESSOR = _WhileListening(_EXPORTER)


def _record_spans() -> None:
    """The global tracer provider records into _EXPORTER: an SDK provider set here, or the one the process has."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        trace.set_tracer_provider(TracerProvider())
        provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider), "a tracer provider that is not the SDK's is set"
    if _PROCESSOR not in provider._active_span_processor._span_processors:
        provider.add_span_processor(_PROCESSOR)


@pytest.fixture
def spans():
    _record_spans()
    _EXPORTER.clear()
    _PROCESSOR.listening = True
    try:
        yield _EXPORTER
    finally:
        _PROCESSOR.listening = False
        _EXPORTER.clear()


def called(console: FakeConsole) -> list[tuple[int, int]]:
    """(trace id, parent span id) of every call the console saw."""
    parsed = []
    for headers in console.seen_headers:
        match = TRACEPARENT.fullmatch(headers.get("traceparent", ""))
        assert match, f"no valid traceparent: {headers.get('traceparent')!r}"
        parsed.append((int(match.group(1), 16), int(match.group(2), 16)))
    return parsed


def gated(exporter: InMemorySpanExporter, tool: str) -> ReadableSpan:
    (span,) = [span for span in exporter.get_finished_spans() if span.name == f"hitl.gated_tool {tool}"]
    return span


def no_arguments_in(span: ReadableSpan, *values: Any) -> None:
    """No attribute, event or status of the span quotes an argument."""
    texts = [str(value) for value in (span.attributes or {}).values()]
    texts += [str(event.attributes) + event.name for event in span.events]
    texts.append(span.status.description or "")
    for value in values:
        assert not any(str(value) in text for text in texts), f"{value!r} is in span {span.name}"


def test_the_calls_continue_the_agents_trace_with_its_baggage(client: Client, console: FakeConsole, spans):
    tracer = trace.get_tracer("agent")
    token = context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with tracer.start_as_current_span("agent.turn") as turn:
            request = client.request_approval("payments", "refund", {"order_id": "o-1"}, idempotency_key="k")
            client.get(request.id)
    finally:
        context.detach(token)
    client.get(request.id)  # outside the span: the request's own trace, not the agent's

    ours = turn.get_span_context()
    (ask, poll, later) = called(console)
    assert ask == poll == (ours.trace_id, ours.span_id)
    assert later[0] != ours.trace_id
    assert [headers.get("baggage") for headers in console.seen_headers] == ["tenant=acme", "tenant=acme", None]


def test_a_gated_call_is_a_span_around_its_calls_and_the_tool(client: Client, console: FakeConsole, spans):
    tracer = trace.get_tracer("agent")
    console.approves_while_waiting(edit={"order_id": SECRET_ORDER, "amount_cents": 1_000})

    @require_approval(client, channel="payments", rationale="late parcel")
    def refund(order_id: str, amount_cents: int) -> dict:
        with tracer.start_as_current_span("payments.refund"):
            return {"refunded_cents": amount_cents}

    with tracer.start_as_current_span("agent.turn") as turn:
        refund(SECRET_ORDER, amount_cents=SECRET_AMOUNT)

    span = gated(spans, "refund")
    assert dict(span.attributes or {}) == {
        "hitl.tool.name": "refund",
        "hitl.channel": "payments",
        "hitl.approval_request.id": console.only().id,
        "hitl.decision": "edited",
    }
    assert span.status.status_code is StatusCode.UNSET and span.kind is trace.SpanKind.INTERNAL
    no_arguments_in(span, SECRET_ORDER, SECRET_AMOUNT)
    ours = span.get_span_context()
    assert span.parent is not None and span.parent.span_id == turn.get_span_context().span_id
    assert ours.trace_id == turn.get_span_context().trace_id
    # The ask, the wait, the consume and the result: each a child of the gated span at the console.
    assert called(console) == [(ours.trace_id, ours.span_id)] * 4
    (tool,) = [s for s in spans.get_finished_spans() if s.name == "payments.refund"]
    assert tool.parent is not None and tool.parent.span_id == ours.span_id


def test_a_rejected_call_is_a_decision_not_an_error(client: Client, console: FakeConsole, spans):
    console.rejects_while_waiting(comment=f"not for {SECRET_ORDER}")

    @require_approval(client, channel="payments", rationale="late parcel")
    def refund(order_id: str, amount_cents: int) -> dict:
        raise AssertionError("a rejected call must not run")

    with pytest.raises(Rejected):
        refund(SECRET_ORDER, amount_cents=SECRET_AMOUNT)

    span = gated(spans, "refund")
    assert span.attributes is not None and span.attributes["hitl.decision"] == "rejected"
    assert span.attributes["hitl.approval_request.id"] == console.only().id
    assert span.status.status_code is StatusCode.UNSET
    no_arguments_in(span, SECRET_ORDER, SECRET_AMOUNT)
    # No span was current: the request's calls are in the gated span's trace all the same.
    assert {trace_id for trace_id, _ in called(console)} == {span.get_span_context().trace_id}


def test_a_tool_that_fails_is_an_error_named_by_its_type_only(client: Client, console: FakeConsole, spans):
    console.approves_while_waiting()

    @require_approval(client, channel="payments", rationale="late parcel")
    def refund(order_id: str, amount_cents: int) -> dict:
        raise RuntimeError(f"card declined for {order_id}")

    with pytest.raises(RuntimeError):
        refund(SECRET_ORDER, amount_cents=SECRET_AMOUNT)

    span = gated(spans, "refund")
    assert span.status.status_code is StatusCode.ERROR and span.status.description == "RuntimeError"
    assert span.attributes is not None and span.attributes["hitl.decision"] == "approved"
    assert span.attributes["error.type"] == "RuntimeError"
    no_arguments_in(span, SECRET_ORDER, SECRET_AMOUNT)


def test_the_mcp_gateway_gates_a_call_in_one_span(console: FakeConsole, spans):
    pytest.importorskip("mcp")
    from test_adapter_mcp import Refunds, call  # noqa: PLC0415 - the mcp extra is optional

    refunds = Refunds()
    console.approves_while_waiting(by="carol")

    (result,) = call(console, refunds, ("refund_order", {"order_id": SECRET_ORDER, "amount_cents": SECRET_AMOUNT}))

    assert not result.is_error and refunds.made == [(SECRET_ORDER, SECRET_AMOUNT)]
    span = gated(spans, "refund_order")  # one span, though the gateway's guard is require_approval's
    assert dict(span.attributes or {}) == {
        "hitl.tool.name": "refund_order",
        "hitl.channel": "payments",
        "hitl.approval_request.id": console.only().id,
        "hitl.decision": "approved",
    }
    no_arguments_in(span, SECRET_ORDER, SECRET_AMOUNT)
    ours = span.get_span_context()
    assert called(console) and all(call == (ours.trace_id, ours.span_id) for call in called(console))


def test_langgraph_gates_a_call_in_a_span(client: Client, console: FakeConsole, spans):
    pytest.importorskip("langgraph")
    from test_langgraph_adapter import THREAD, Shop, ask  # noqa: PLC0415 - the langgraph extra is optional

    from hitl_client.adapters.langgraph import invoke_with_approvals  # noqa: PLC0415 - the same

    shop = Shop()
    console.approves_while_waiting(edit={"order_id": SECRET_ORDER, "amount_cents": 3_000})
    graph = shop.graph(client, [("refund_order", {"order_id": SECRET_ORDER, "amount_cents": SECRET_AMOUNT})])
    invoke_with_approvals(graph, ask(), THREAD, client=client)

    assert shop.refunds == [{"order_id": SECRET_ORDER, "amount_cents": 3_000}]
    span = gated(spans, "refund_order")
    assert dict(span.attributes or {}) == {
        "hitl.tool.name": "refund_order",
        "hitl.channel": "payments",
        "hitl.approval_request.id": console.only().id,
        "hitl.decision": "edited",
    }
    no_arguments_in(span, SECRET_ORDER, SECRET_AMOUNT)
    # The go and the result inside the span (the ask and the wait came before, while the graph stopped).
    ours = span.get_span_context()
    inside = [
        traced
        for (method, path), traced in zip(console.seen, called(console), strict=True)
        if path.endswith(("/consume", "/result"))
    ]
    assert inside == [(ours.trace_id, ours.span_id)] * 2


@pytest.mark.parametrize("framework", ["openai_agents", "pydantic_ai"])
def test_a_run_with_approvals_gates_the_approved_call_in_a_span(framework: str, console: FakeConsole, spans):
    pytest.importorskip("openai")
    from approval_runs import ADAPTERS, Model, Refunds  # noqa: PLC0415 - the frameworks' extras are optional

    adapter = ADAPTERS[framework]()
    asked = {"order_id": SECRET_ORDER, "amount_cents": SECRET_AMOUNT}
    refunds, model = Refunds(adapter), Model([("refund_order", asked)])
    console.approves_while_waiting(edit={**asked, "amount_cents": 300})

    adapter.run(console, adapter.agent(model, refunds.tool()))

    assert refunds.made == [(SECRET_ORDER, 300)]
    span = gated(spans, "refund_order")
    assert dict(span.attributes or {}) == {
        "hitl.tool.name": "refund_order",
        "hitl.channel": "payments",
        "hitl.approval_request.id": console.only().id,
        "hitl.decision": "edited",
    }
    no_arguments_in(span, SECRET_ORDER, SECRET_AMOUNT)
    ours = span.get_span_context()
    inside = [
        traced
        for (method, path), traced in zip(console.seen, called(console), strict=True)
        if path.endswith(("/consume", "/result"))
    ]
    assert inside == [(ours.trace_id, ours.span_id)] * 2
