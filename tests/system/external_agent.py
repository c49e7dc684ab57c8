"""An external agent, as a process of its own (tests/system/test_client_live.py starts it and SIGKILLs it): one
refund through `hitl_client.require_approval`, paid at a fake payment system over HTTP.

    python tests/system/external_agent.py ORDER_ID AMOUNT_CENTS

Environment: HITL_URL and HITL_TOKEN (the console and the agent's token), PAYMENTS_URL (the payment system),
SETTLE_SECONDS (how long the refund waits after paying, for the bank's confirmation: the test kills the process
then, so the payment has happened and its outcome was never reported). AGENT_OTLP_ENDPOINT: the agent traces itself
with OpenTelemetry's SDK, as an instrumented agent does, exporting to that OTLP/HTTP endpoint (service `agent`): its
turn is one span, `agent.turn`, inside which the client gates the call (tests/system/test_tracing.py).

It prints one JSON line per event on stdout (`entered`: the function runs; `paid`: the payment system took it;
then the outcome) and exits 0 with the refund's result, or 3 when the console says the outcome is unknown.
It imports nothing of the console: only the client, as any agent would.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.request

from hitl_client import Client, OutcomeUnknown, require_approval

OUTCOME_UNKNOWN_EXIT = 3


def say(event: str, **data) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def traced() -> contextlib.AbstractContextManager:
    """The agent's turn as a span of its own trace when AGENT_OTLP_ENDPOINT is set; nothing otherwise."""
    endpoint = os.environ.get("AGENT_OTLP_ENDPOINT")
    if not endpoint:
        return contextlib.nullcontext()
    from opentelemetry import trace  # noqa: PLC0415 - only an agent that traces itself loads the SDK
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: PLC0415

    provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
    trace.set_tracer_provider(provider)
    return trace.get_tracer("agent").start_as_current_span("agent.turn")


def main(order_id: str, amount_cents: int) -> int:
    with traced():
        return _turn(order_id, amount_cents)


def _turn(order_id: str, amount_cents: int) -> int:
    payments_url = os.environ["PAYMENTS_URL"]
    settle = float(os.environ.get("SETTLE_SECONDS", "0"))
    with Client(os.environ["HITL_URL"], os.environ["HITL_TOKEN"], timeout=10) as client:

        @require_approval(client, channel="payments", rationale="The parcel never arrived.", risk="high")
        def refund(order_id: str, amount_cents: int) -> dict:
            say("entered", order_id=order_id, amount_cents=amount_cents)
            request = urllib.request.Request(
                f"{payments_url}/refunds",
                data=json.dumps({"order_id": order_id, "amount_cents": amount_cents}).encode(),
                headers={"Content-Type": "application/json", "Idempotency-Key": f"refund-{order_id}"},
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                receipt = json.loads(response.read())
            say("paid", receipt=receipt)
            time.sleep(settle)  # waiting for the bank's confirmation: the test kills the agent here
            return receipt

        try:
            result = refund(order_id, amount_cents)
        except OutcomeUnknown as unknown:
            say("outcome_unknown", request_id=unknown.request.id, message=str(unknown))
            return OUTCOME_UNKNOWN_EXIT
        say("result", result=result)
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
