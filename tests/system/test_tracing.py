"""Traces through real processes (core.tracing, docs/observability.md): the production web server and real workers
export over OTLP/HTTP to a small receiver in the test, which decodes each export with `opentelemetry-proto`, as a
collector would. A gated support_agent run created by POST /api/runs with the caller's `traceparent`, its worker
SIGKILLed in the middle of a read, its cards approved over the API, is one trace: the root from the API call, its
steps in order (the killed step's retry as a second attempt), the model's `gen_ai.*` attributes, the effect with its
receipt's outcome, each person's wait (`approval.wait`) under the step that parked and linked from the one that
resumed. An external agent's approval request joins the agent's own trace."""

from __future__ import annotations

import gzip
import json
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from demo.models import SandboxCall
from runs.models import Run, Step
from tests.serving import serve_in_thread
from tests.system.conftest import Approver
from tests.system.refunds import decide
from tests.system.test_client_live import Agent, Payments, pending_card
from tests.worker import wait_with_logs

pytestmark = pytest.mark.slow

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
LIST_ORDERS = "support_agent.turn2.1.list_orders"
SUPPORT = {
    "customer_id": "cus_1042",
    "message": "Refund ord_10421 please, 20 EUR",
    "order_id": "ord_10421",
    # The CRM answers the orders read, then the call blocks as if the worker died: it is killed there.
    "faults": {LIST_ORDERS: ["hang"]},
}


@dataclass
class Span:
    """A span as the receiver decoded it: ids in hex, attributes as plain values."""

    service: str
    trace_id: str
    span_id: str
    parent: str
    name: str
    kind: int
    start: int
    end: int
    attributes: dict
    links: list[tuple[str, str]] = field(default_factory=list)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, a protobuf ExportTraceServiceRequest (gzip or not)."""

    def __init__(self):
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.receive(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        serve_in_thread(self.server, "otlp-receiver")

    def receive(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(
                        Span(
                            service=resource.get("service.name", ""),
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        )
                    )
        with self.lock:
            self.spans.extend(spans)

    def named(self, name: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.name == name]

    def all(self) -> list[Span]:
        with self.lock:
            return list(self.spans)


@pytest.fixture
def otlp():
    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


@pytest.fixture
def payments():
    payments = Payments()
    yield payments
    payments.stop()


@pytest.fixture
def system_env(otlp) -> dict:
    """The web server and the workers export their spans to the test's receiver, every 100 ms."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": "hitl-system-test",
    }


def post(system, path: str, body: dict, traceparent: str) -> dict:
    request = urllib.request.Request(
        system.url + path,
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {system.agent.token}",
            "Content-Type": "application/json",
            "traceparent": traceparent,
        },
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 202
        return json.loads(response.read())


def test_a_gated_run_with_a_killed_worker_is_one_trace_from_the_api_call(system, otlp):
    run_id = post(system, "/api/runs", {"workflow": "support_agent", "input": SUPPORT}, TRACEPARENT)["id"]
    wait_with_logs(
        lambda: SandboxCall.objects.filter(run_id=run_id, operation=LIST_ORDERS).exists(),
        "the orders read to hang",
        system.workers.all,
        60,
    )
    # The steps before the hung one ended: their spans leave within a batch delay (100 ms); a SIGKILL loses what a
    # worker has not exported yet, and only the hung attempt's span is meant to be lost.
    time.sleep(1)
    for worker in system.workers.alive:
        worker.kill(signal.SIGKILL)
        worker.wait(10)
    system.workers.start()
    approver = Approver(system.reviewer)
    approver.start()
    try:
        statuses = system.wait_for_runs([run_id], timeout=90)
    finally:
        approver.stopping.set()
        approver.join(10)
    run = Run.objects.get(pk=run_id)
    assert run.status == Run.Status.SUCCEEDED, (statuses, run.error, approver.errors)
    assert run.trace_id == CALLER_TRACE, "the run's trace id is the caller's trace"
    cards = sum(approver.decided.values())
    assert cards >= 2, approver.decided  # the refund's card and the email's
    steps_done = Step.objects.filter(run_id=run_id).count()

    # Every step's last attempt, and every wait, exported (each process's batch every 100 ms).
    wait_with_logs(
        lambda: (
            len({s.attributes["hitl.step.seq"] for s in otlp.named("run.step")}) >= steps_done
            and len(otlp.named("approval.wait")) >= cards
        ),
        "the spans of every step and wait",
        system.workers.all,
        30,
    )
    spans = otlp.all()
    assert {s.trace_id for s in spans} == {CALLER_TRACE}, "one trace, the caller's"
    assert {s.service for s in spans} == {"hitl-system-test"}
    by_id = {s.span_id: s for s in spans}

    (root,) = otlp.named("POST /api/runs")
    assert root.parent == CALLER_SPAN and root.kind == 2  # SPAN_KIND_SERVER, under the caller's span

    steps = sorted(otlp.named("run.step"), key=lambda s: s.start)
    assert all(s.parent == root.span_id for s in steps), "every step under the API call"
    seqs = [s.attributes["hitl.step.seq"] for s in steps]
    assert seqs == sorted(seqs) and seqs[0] == 0, f"the steps in order: {seqs}"
    assert all(s.attributes["hitl.job_id"] > 0 and s.attributes["hitl.run_id"] == run_id for s in steps)
    (retried,) = [s for s in steps if s.attributes["hitl.step"] == LIST_ORDERS]
    assert retried.attributes["hitl.attempt"] == 2, "the SIGKILLed step's retry, a second attempt in the trace"

    chats = otlp.named("chat scripted")
    assert chats and all(by_id[s.parent].name == "run.step" for s in chats)
    for chat in chats:
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.request.model"] == "scripted"
        assert chat.attributes["gen_ai.system"] == chat.attributes["gen_ai.provider.name"]
        assert chat.attributes["gen_ai.usage.input_tokens"] > 0 < chat.attributes["gen_ai.usage.output_tokens"]
    assert "crm.list_orders" in {s.attributes["hitl.tool"] for s in otlp.named("tool.read")}

    effects = otlp.named("effect.call")
    assert {"payments", "email"} <= {s.attributes["hitl.channel"] for s in effects}
    assert all(s.attributes["hitl.effect.outcome"] == "new" and s.attributes["hitl.receipt.key"] for s in effects)

    waits = otlp.named("approval.wait")
    assert len(waits) == cards
    for wait in waits:
        parked = by_id[wait.parent]
        assert parked.name == "run.step", "the wait hangs under the step that parked"
        resumed = [s for s in steps if (CALLER_TRACE, wait.span_id) in s.links]
        assert resumed, "the step that resumed links to the wait"
        assert parked.start < wait.start < wait.end <= resumed[0].start + 1_000_000_000
        assert resumed[0].attributes["hitl.job_id"] != parked.attributes["hitl.job_id"], "across two jobs"
        assert wait.attributes["hitl.decision"] == "approved" and wait.attributes["hitl.edited"] is False
        assert wait.attributes["hitl.decided_by"].isdigit(), "a user id, never a name"

    assert SUPPORT["message"] not in json.dumps([s.attributes for s in spans]), "no content in a span"


def test_an_external_agents_approval_request_joins_the_agents_trace(system, otlp):
    agent_trace, agent_span = "5c1c63257de34c67b2a3d7c0b1e1a2b3", "a1b2c3d4e5f60718"
    asked = post(
        system,
        "/api/approval-requests",
        {
            "channel": "payments",
            "action": "refund",
            "arguments": {"order_id": "ord_7", "amount_cents": 4_200},
            "idempotency_key": "traced",
        },
        f"00-{agent_trace}-{agent_span}-01",
    )
    (card,) = [c for c in system.reviewer.get("/api/approvals").body if c["id"] == asked["card_id"]]
    decided = system.reviewer.post(
        f"/api/approvals/{card['id']}/decision", {"decision": "approve", "version": card["version"], "comment": "ok"}
    )
    assert decided.status == 200, decided
    wait_with_logs(lambda: otlp.named("approval.wait"), "the wait's span", system.workers.all, 30)
    (served,) = otlp.named("POST /api/approval-requests")
    assert (served.trace_id, served.parent) == (agent_trace, agent_span), "the console continues the agent's trace"
    (wait,) = otlp.named("approval.wait")
    assert (wait.trace_id, wait.parent) == (agent_trace, served.span_id)
    assert wait.attributes["hitl.channel"] == "payments" and wait.attributes["hitl.decision"] == "approved"


def test_an_agent_using_the_client_sees_the_consoles_spans_in_its_own_trace(system, otlp, payments):
    """A real agent process (tests/system/external_agent.py: `hitl_client.require_approval`, its own OpenTelemetry
    SDK exporting to the same collector): its turn, the client's gated span and the console's spans of the request
    (ask, wait, consume, result, the person's wait) are one trace."""
    agent = Agent(system, payments, "ord_9", 9_100, settle=0, AGENT_OTLP_ENDPOINT=otlp.url)
    try:
        card = pending_card(system)
        decide(system, card, "approve")
        code, events, stderr = agent.finish()
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
    assert code == 0, stderr
    assert payments.made() == [("ord_9", 9_100)]
    wait_with_logs(lambda: otlp.named("agent.turn"), "the agent's turn span", system.workers.all, 30)
    (turn,) = otlp.named("agent.turn")
    (gated,) = otlp.named("hitl.gated_tool refund")
    assert turn.service == "agent" and (gated.trace_id, gated.parent) == (turn.trace_id, turn.span_id)
    assert gated.attributes["hitl.decision"] == "approved" and gated.attributes["hitl.channel"] == "payments"
    assert not {"order_id", "amount_cents"} & set(gated.attributes), "no argument values on the agent's span"
    console = [s for s in otlp.all() if s.service == "hitl-system-test"]
    served = {s.name for s in console if s.trace_id == turn.trace_id}
    assert "POST /api/approval-requests" in served and "approval.wait" in served, served
    assert any(name.endswith("/consume") for name in served) and any(name.endswith("/result") for name in served), (
        served
    )
