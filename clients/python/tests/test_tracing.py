"""The trace context of every call the client makes (hitl_client._tracing) while no OpenTelemetry span is current:
a W3C `traceparent` on each, one trace per approval request (its ask, waits, consume and result, whether one
decorated call or separate calls of the client), a fresh span id per call. And the client without opentelemetry at
all. With a span current (the agent's trace continued) and the gated tool's span: test_tracing_spans.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
from conftest import BASE_URL, run_coroutine
from fake_console import FakeConsole

from hitl_client import AsyncClient, Client, arguments_digest, require_approval
from hitl_client._tracing import Traces

REFUND = {"order_id": "o-42", "amount_cents": 500}
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")


def traceparents(console: FakeConsole) -> list[tuple[str, str]]:
    """(trace id, span id) of every call the console saw, in order; each call must carry a valid one."""
    parsed = []
    for (method, path), headers in zip(console.seen, console.seen_headers, strict=True):
        match = TRACEPARENT.fullmatch(headers.get("traceparent", ""))
        assert match, f"{method} {path} carried no valid traceparent: {headers.get('traceparent')!r}"
        trace_id, span_id = match.groups()
        assert trace_id.strip("0") and span_id.strip("0"), "an all-zero id is invalid (W3C)"
        parsed.append((trace_id, span_id))
    return parsed


def test_a_decorated_call_is_one_trace_with_a_span_id_per_call(client: Client, console: FakeConsole):
    console.approves_while_waiting()

    @require_approval(client, channel="payments", rationale="late parcel")
    def refund(order_id: str, amount_cents: int) -> dict:
        return {"refunded_cents": amount_cents}

    refund("o-42", amount_cents=500)
    refund("o-43", amount_cents=700)  # another action: another request, another trace

    calls = traceparents(console)
    assert [method for method, _ in console.seen] == ["POST", "GET", "POST", "POST"] * 2
    first, second = calls[:4], calls[4:]
    assert len({trace_id for trace_id, _ in first}) == 1 and len({trace_id for trace_id, _ in second}) == 1
    assert first[0][0] != second[0][0]
    assert len({span_id for _, span_id in calls}) == len(calls)


def test_separate_calls_about_one_request_share_its_trace(client: Client, console: FakeConsole):
    request = client.request_approval("payments", "refund", REFUND, idempotency_key="k-1", rationale="late")
    other = client.request_approval("payments", "refund", {**REFUND, "order_id": "o-9"}, idempotency_key="k-2")
    console.approve(request.id)
    decision = client.wait(request.id, timeout=5)
    client.consume(request.id, arguments_digest(decision.arguments or {}))
    client.report(request.id, ok=True, result={"refund_id": "r-1"})
    client.get(other.id)
    # The same ask again (a re-run): the same request, in the same trace.
    client.request_approval("payments", "refund", REFUND, idempotency_key="k-1", rationale="late")

    calls = traceparents(console)
    ours = {calls[n][0] for n in (0, 2, 3, 4, 6)}
    assert len(ours) == 1
    assert calls[1][0] == calls[5][0] and calls[1][0] not in ours


def test_a_retried_call_stays_in_its_request_trace_with_a_new_span_id(client: Client, console: FakeConsole):
    console.approves_while_waiting()
    console.fail("POST", "/consume", 503)

    @require_approval(client, channel="payments", rationale="late parcel")
    def refund(order_id: str, amount_cents: int) -> dict:
        return {"refunded_cents": amount_cents}

    refund("o-42", amount_cents=500)

    assert console.calls("POST", "/consume") == 2
    calls = traceparents(console)
    assert len({trace_id for trace_id, _ in calls}) == 1 and len({span_id for _, span_id in calls}) == len(calls)


def test_the_async_client_sends_it_too(console: FakeConsole):
    console.approves_while_waiting()

    async def main() -> None:
        transport = httpx.MockTransport(console.handler)
        async with AsyncClient(BASE_URL, "tok-alice", transport=transport, backoff=0, max_backoff=0) as client:

            @require_approval(client, channel="payments", rationale="late parcel")
            async def refund(order_id: str, amount_cents: int) -> dict:
                return {"refunded_cents": amount_cents}

            await refund("o-42", amount_cents=500)
            await client.get(console.only().id)

    run_coroutine(main())

    calls = traceparents(console)
    assert len(calls) == 5 and len({trace_id for trace_id, _ in calls}) == 1


def test_the_client_works_without_opentelemetry():
    """opentelemetry is an optional extra: with its import refused, the client imports, asks, runs and reports,
    and still sends a traceparent per call, one trace for the request."""
    here = Path(__file__).resolve().parent
    script = textwrap.dedent(
        """
        import json, sys

        class NoOpenTelemetry:
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoOpenTelemetry())
        sys.path[:0] = sys.argv[1:3]
        try:
            import opentelemetry
        except ImportError:
            pass
        else:
            raise SystemExit("opentelemetry was not blocked")

        import httpx
        from fake_console import FakeConsole
        from hitl_client import Client, require_approval
        from hitl_client import _tracing

        console = FakeConsole()
        console.approves_while_waiting()
        transport = httpx.MockTransport(console.handler)
        with Client("http://console.test", "tok-alice", transport=transport, backoff=0, max_backoff=0) as client:

            @require_approval(client, channel="payments", rationale="late parcel")
            def refund(order_id: str, amount_cents: int) -> dict:
                return {"refunded_cents": amount_cents}

            result = refund("o-42", amount_cents=500)
        print(json.dumps({
            "result": result,
            "otel": _tracing._OTEL,
            "imported": sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"),
            "traceparents": [headers.get("traceparent") for headers in console.seen_headers],
        }))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(here.parent / "src"), str(here)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["result"] == {"refunded_cents": 500}
    assert seen["otel"] is False and seen["imported"] == []
    parsed = [TRACEPARENT.fullmatch(header or "") for header in seen["traceparents"]]
    assert len(parsed) == 4 and all(parsed)
    assert len({match.group(1) for match in parsed if match}) == 1


def test_a_client_remembers_a_bounded_number_of_requests():
    """A long-running agent asks about many requests: the oldest ones' traces are forgotten (a later call about one
    starts a trace of its own), the newest kept."""
    traces = Traces(size=2)

    def trace_of(key: str) -> str:
        return traces.headers(key)["traceparent"].split("-")[1]

    first = trace_of("id:a")
    assert trace_of("id:a") == first
    second, _ = trace_of("id:b"), trace_of("id:c")
    assert trace_of("id:b") == second
    assert trace_of("id:a") != first
