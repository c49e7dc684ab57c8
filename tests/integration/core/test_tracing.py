"""Traces (core.tracing, docs/observability.md), in the test process: off by default (no span, no SDK), a caller's
`traceparent` continued (the run's trace id is the caller's, on or off), a malformed one ignored, and, with an
in-memory exporter, the tree a gated support_agent run makes (the root from POST /api/runs, a `run.step` per
attempt, GenAI model spans, tool reads, `effect.call` with its receipt's outcome, `approval.wait` from the card's
opening to its decision, which the resumed step links to). Through real processes: tests/system/test_tracing.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from django.conf import settings
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from approvals.models import Approval
from core import tracing
from core.models import ApiToken
from jobs.models import DeadLetter
from runs import submission
from runs.errors import Ambiguous
from runs.models import Run, Step
from tests.engine_helpers import REFUND, SMALL_REFUND, SUPPORT, drive
from tests.unit.test_webhook_signing import SECRET, signed

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
MALFORMED = [
    "not a traceparent",
    f"00-{'0' * 32}-{CALLER_SPAN}-01",  # an all-zero trace id is invalid
    f"00-{CALLER_TRACE}-{'0' * 16}-01",  # an all-zero span id too
    f"00-{CALLER_TRACE[:-1]}-{CALLER_SPAN}-01",  # a short trace id
    f"ff-{CALLER_TRACE}-{CALLER_SPAN}-01",  # version ff is forbidden
    "",
]


@pytest.fixture
def spans():
    """Traces on in this process, exported to memory as each span ends; off again after the test."""
    exporter = InMemorySpanExporter()
    tracing.setup(exporter=exporter)
    yield exporter
    tracing.shutdown()


def bearer(user) -> dict:
    _, raw = ApiToken.issue(user)
    return {"Authorization": f"Bearer {raw}"}


def post_run(client, user, headers: dict | None = None, workflow: str = "support_agent", run_input=SUPPORT):
    response = client.post(
        "/api/runs",
        json.dumps({"workflow": workflow, "input": run_input}),
        content_type="application/json",
        headers={**bearer(user), **(headers or {})},
    )
    assert response.status_code == 202, response.content
    return Run.objects.get(pk=response.json()["id"])


def hex_trace(span) -> str:
    return f"{span.context.trace_id:032x}"


# --- off -------------------------------------------------------------------------------------------------------------


def test_off_a_span_is_the_shared_null_context_and_nothing_is_made():
    assert tracing.ENABLED is False
    assert tracing.span("run.step", {"hitl.step": "x"}) is tracing.NULL
    with tracing.span("run.step") as started:
        assert started is None
    assert tracing.start_span("approval.wait") is None
    assert tracing.current() is None
    assert tracing.add_span_id(None, "info", {"event": "x"}) == {"event": "x"}


def test_off_no_process_loads_the_sdk():
    """A process with no OTEL_* variables (a worker, the web server) never imports the SDK: Django set up, the
    engine and the API imported, a span asked for."""
    code = (
        "import sys, django; django.setup(); "
        "import runs.engine, runs.api, external.api, approvals.gates; from core import tracing; "
        "tracing.span('x').__enter__(); "
        "print(tracing.ENABLED, sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"DATABASE_URL": "postgres://nobody@127.0.0.1:1/none", "LOG_LEVEL": "WARNING"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=settings.BASE_DIR, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False []", out.stderr[-2000:]


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
        ({"OTEL_SERVICE_NAME": "console"}, False),  # a name alone exports nothing
    ],
)
def test_on_only_when_the_environment_names_an_endpoint_or_an_exporter(monkeypatch, environ, on):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert tracing.configured() is on


def test_off_the_callers_traceparent_still_sets_the_runs_trace_id(client, demo):
    run = post_run(client, demo["agent"], {"traceparent": TRACEPARENT})
    assert (run.trace_id, run.trace_parent) == (CALLER_TRACE, TRACEPARENT)


@pytest.mark.parametrize("traceparent", MALFORMED)
def test_a_malformed_traceparent_is_ignored_a_new_trace(client, demo, traceparent):
    run = post_run(client, demo["agent"], {"traceparent": traceparent})
    assert run.trace_id != CALLER_TRACE and len(run.trace_id) == 32
    int(run.trace_id, 16)
    assert run.trace_parent == ""


def test_without_a_traceparent_a_run_keeps_a_random_trace_id(client, demo):
    first, second = post_run(client, demo["agent"]), post_run(client, demo["agent"])
    assert first.trace_id != second.trace_id and first.trace_parent == second.trace_parent == ""


# --- links ------------------------------------------------------------------------------------------------------------


def test_the_trace_is_linked_from_the_api_and_the_run_page(client, demo, settings):
    run = post_run(client, demo["agent"], {"traceparent": TRACEPARENT})
    settings.TRACE_URL_TEMPLATE = ""
    assert client.get(f"/api/runs/{run.pk}", headers=bearer(demo["agent"])).json()["trace_url"] == ""
    settings.TRACE_URL_TEMPLATE = "http://jaeger:16686/trace/{trace_id}"
    body = client.get(f"/api/runs/{run.pk}", headers=bearer(demo["agent"])).json()
    assert (body["trace_id"], body["trace_url"]) == (CALLER_TRACE, f"http://jaeger:16686/trace/{CALLER_TRACE}")
    client.force_login(demo["admin"])
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert f'href="http://jaeger:16686/trace/{CALLER_TRACE}"' in page


# --- on ---------------------------------------------------------------------------------------------------------------


def test_a_gated_support_agent_run_makes_one_trace_from_the_api_call(
    client, demo, spans, django_capture_on_commit_callbacks
):
    run = post_run(client, demo["agent"], {"traceparent": TRACEPARENT})
    (root,) = [s for s in spans.get_finished_spans() if s.name == "POST /api/runs"]
    assert root.kind == SpanKind.SERVER
    assert hex_trace(root) == CALLER_TRACE and f"{root.parent.span_id:016x}" == CALLER_SPAN
    assert run.trace_id == CALLER_TRACE and run.trace_parent == f"00-{CALLER_TRACE}-{root.context.span_id:016x}-01"

    run = drive(run)
    cards = 0
    while run.status == Run.Status.WAITING_HUMAN and cards < 6:
        card = Approval.objects.get(run=run, status=Approval.Status.PENDING)
        with django_capture_on_commit_callbacks(execute=True):
            card.decide(demo["reviewer"], "approve")
        run = drive(run)
        cards += 1
    assert run.status == Run.Status.SUCCEEDED, run.error
    assert cards >= 2  # the refund's card and the email's

    finished = spans.get_finished_spans()
    assert {hex_trace(s) for s in finished} == {CALLER_TRACE}, "one trace"
    by_id = {s.context.span_id: s for s in finished}
    steps = [s for s in finished if s.name == "run.step"]
    assert all(s.parent.span_id == root.context.span_id for s in steps), "every step under the API call"
    seqs = [s.attributes["hitl.step.seq"] for s in steps]
    assert seqs == sorted(seqs) and seqs[0] == 0
    assert {s.attributes["hitl.workflow"] for s in steps} == {"support_agent"}
    assert all(s.attributes["hitl.attempt"] == 1 and s.attributes["hitl.run_id"] == str(run.pk) for s in steps)

    chats = [s for s in finished if s.name.startswith("chat ")]
    assert chats and all(by_id[s.parent.span_id].name == "run.step" for s in chats)
    for chat in chats:
        assert chat.kind == SpanKind.CLIENT
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.request.model"] == "scripted"
        assert chat.attributes["gen_ai.provider.name"] == chat.attributes["gen_ai.system"] == "_OTHER"
        assert chat.attributes["gen_ai.usage.input_tokens"] > 0 and chat.attributes["gen_ai.usage.output_tokens"] > 0
    reads = {s.attributes["hitl.tool"] for s in finished if s.name == "tool.read"}
    assert {"crm.get_customer", "crm.list_orders"} <= reads

    effects = [s for s in finished if s.name == "effect.call"]
    assert {s.attributes["hitl.channel"] for s in effects} >= {"payments", "email"}
    assert {s.attributes["hitl.effect.outcome"] for s in effects} == {"new"}
    assert all(s.attributes["hitl.receipt.key"].startswith(str(run.pk)) for s in effects)

    waits = [s for s in finished if s.name == "approval.wait"]
    assert len(waits) == cards
    for wait in waits:
        card = Approval.objects.get(pk=wait.attributes["hitl.approval_id"])
        parked = by_id[wait.parent.span_id]
        assert parked.name == "run.step", "the wait hangs under the step that parked"
        assert wait.start_time == tracing.nanoseconds(card.created_at)
        assert wait.end_time == tracing.nanoseconds(card.decided_at)
        assert wait.attributes["hitl.decision"] == "approved" and wait.attributes["hitl.edited"] is False
        assert wait.attributes["hitl.decided_by"] == str(demo["reviewer"].pk), "an id, never a name"
        assert "hitl.policy.stage" in wait.attributes and wait.attributes["hitl.channel"] == card.channel.name
        resumed = [s for s in steps if any(link.context.span_id == wait.context.span_id for link in s.links)]
        assert resumed and resumed[0].start_time > parked.start_time, "the resumed step links to the wait"

    texts = json.dumps([dict(s.attributes) for s in finished])
    for secret in (SUPPORT["message"], "Refund ord_10421"):
        assert secret not in texts, "no prompt, argument or answer in a span"


def test_on_a_malformed_traceparent_starts_a_new_trace(client, demo, spans):
    run = post_run(client, demo["agent"], {"traceparent": f"00-{'0' * 32}-{CALLER_SPAN}-01"})
    (root,) = spans.get_finished_spans()
    assert root.parent is None and hex_trace(root) == run.trace_id != "0" * 32


def test_a_run_made_without_a_root_still_traces_in_its_own_trace_id(demo, spans):
    """A run made before traces (no trace_parent): its steps share its trace id all the same."""
    run = Run.objects.create(workflow="support_agent", workflow_version=1, input=SUPPORT, trace_parent="")
    Run.objects.filter(pk=run.pk).update(trace_parent="")
    run.refresh_from_db()
    assert run.trace_parent == ""
    drive(run)
    steps = [s for s in spans.get_finished_spans() if s.name == "run.step"]
    assert steps and {hex_trace(s) for s in steps} == {run.trace_id}


def test_a_log_line_inside_a_span_carries_its_span_id(spans):
    with tracing.span("x") as started:
        event = tracing.add_span_id(None, "info", {"event": "e"})
    assert event["span_id"] == f"{started.get_span_context().span_id:016x}"
    assert event["trace_id"] == f"{started.get_span_context().trace_id:032x}"
    assert "span_id" not in tracing.add_span_id(None, "info", {"event": "e"})


def test_an_exception_marks_its_span_with_its_class_never_its_message(spans):
    with pytest.raises(ValueError), tracing.span("x"):
        raise ValueError("customer jane@example.com")
    (failed,) = spans.get_finished_spans()
    assert failed.attributes["error.type"] == "ValueError" and failed.status.description == "ValueError"
    assert not failed.events, "no exception event (its message)"


def test_an_external_agents_approval_request_joins_the_agents_trace(
    client, demo, spans, django_capture_on_commit_callbacks
):
    body = {
        "channel": "payments",
        "action": "refund_order",
        "arguments": {"order_id": "ord_42", "amount_cents": 12_500},
        "idempotency_key": "traced-1",
    }
    agent = {**bearer(demo["agent"]), "traceparent": TRACEPARENT}
    response = client.post("/api/approval-requests", json.dumps(body), content_type="application/json", headers=agent)
    assert response.status_code == 202, response.content
    asked = response.json()
    (served,) = [s for s in spans.get_finished_spans() if s.name == "POST /api/approval-requests"]
    assert hex_trace(served) == CALLER_TRACE and f"{served.parent.span_id:016x}" == CALLER_SPAN
    card = Approval.objects.get(pk=asked["card_id"])
    assert card.trace_parent == f"00-{CALLER_TRACE}-{served.context.span_id:016x}-01"

    with django_capture_on_commit_callbacks(execute=True):
        card.decide(demo["reviewer"], "approve")
    (wait,) = [s for s in spans.get_finished_spans() if s.name == "approval.wait"]
    assert hex_trace(wait) == CALLER_TRACE and wait.parent.span_id == served.context.span_id
    assert (wait.attributes["hitl.decision"], wait.attributes["hitl.edited"]) == ("approved", False)

    polled = client.get(f"/api/approval-requests/{asked['id']}", headers=agent)
    assert polled.status_code == 200 and polled.json()["status"] == "approved"
    (poll,) = [s for s in spans.get_finished_spans() if s.name == "GET /api/approval-requests/{request_id}"]
    assert hex_trace(poll) == CALLER_TRACE


def test_a_signed_webhook_delivery_roots_its_runs_trace_in_the_senders(client, demo, spans, settings):
    settings.WEBHOOK_SECRETS = {"demo": [SECRET]}
    data = json.dumps(SMALL_REFUND).encode()
    response = client.post(
        "/api/webhooks/demo",
        data=data,
        content_type="application/json",
        headers={**signed(data), "traceparent": TRACEPARENT},
    )
    assert response.status_code == 202, response.content
    run = Run.objects.get(pk=response.json()["id"])
    (served,) = [s for s in spans.get_finished_spans() if s.name == "POST /api/webhooks/{source}"]
    assert served.attributes["hitl.webhook.source"] == "demo" and f"{served.parent.span_id:016x}" == CALLER_SPAN
    assert (run.trace_id, run.trace_parent) == (CALLER_TRACE, f"00-{CALLER_TRACE}-{served.context.span_id:016x}-01")


def _outcomes(spans) -> dict:
    return {
        s.attributes["hitl.channel"]: s.attributes["hitl.effect.outcome"]
        for s in spans.get_finished_spans()
        if s.name == "effect.call"
    }


def test_an_effect_done_before_is_replayed_from_its_receipt(demo, spans):
    run = drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    assert _outcomes(spans) == {"payments": "new", "email": "new"}
    spans.clear()
    # The payment step again, as if its checkpoint had been lost after the receipt was written.
    Step.objects.filter(run=run, name__in=["issue_refund", "notify_customer"]).delete()
    Run.objects.filter(pk=run.pk).update(status="queued", cursor=4, finished_at=None)
    assert drive(run).status == Run.Status.SUCCEEDED
    assert _outcomes(spans) == {"payments": "replayed", "email": "replayed"}


def test_an_ambiguous_effect_is_reconciled_and_its_failed_attempt_marked(demo, spans):
    faults = {**SMALL_REFUND, "faults": {"issue_refund": ["timeout"]}}
    run, _ = submission.submit(workflow="refund", input=faults)
    with pytest.raises(Ambiguous):
        drive(run)
    (failed,) = [s for s in spans.get_finished_spans() if s.name == "effect.call"]
    assert failed.attributes["error.type"] == "Ambiguous" and "hitl.effect.outcome" not in failed.attributes
    (step,) = [
        s for s in spans.get_finished_spans() if s.name == "run.step" and s.attributes["hitl.step"] == "issue_refund"
    ]
    assert step.attributes["error.type"] == "Ambiguous" and step.attributes["hitl.attempt"] == 1
    spans.clear()
    assert drive(run, attempts=1).status == Run.Status.SUCCEEDED
    assert _outcomes(spans)["payments"] == "reconciled"
    (retried,) = [
        s for s in spans.get_finished_spans() if s.name == "run.step" and s.attributes["hitl.step"] == "issue_refund"
    ]
    assert retried.attributes["hitl.attempt"] == 2


def test_a_card_opened_outside_any_span_waits_under_its_runs_root(demo, spans, django_capture_on_commit_callbacks):
    """A budget card (opened between steps), or one opened by a process with traces off: its wait is still in the
    run's trace."""
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    card = Approval.objects.get(run=run, status=Approval.Status.PENDING)
    Approval.objects.filter(pk=card.pk).update(trace_parent="")
    card.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=True):
        card.decide(demo["reviewer"], "approve")
    (wait,) = [s for s in spans.get_finished_spans() if s.name == "approval.wait"]
    assert hex_trace(wait) == run.trace_id and f"{wait.parent.span_id:016x}" == run.pk.hex[:16]


def test_a_dead_letter_links_to_its_runs_trace(client, demo, settings):
    run = drive(submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {"issue_refund": ["fatal"]}})[0])
    letter = DeadLetter.objects.get(run_id=run.pk)
    assert letter.trace_id == run.trace_id
    client.force_login(demo["admin"])
    settings.TRACE_URL_TEMPLATE = "https://tempo.example/trace/{trace_id}"
    page = client.get(f"/admin/jobs/deadletter/{letter.pk}/change/").content.decode()
    assert f'href="https://tempo.example/trace/{run.trace_id}"' in page
    settings.TRACE_URL_TEMPLATE = ""
    page = client.get(f"/admin/jobs/deadletter/{letter.pk}/change/").content.decode()
    assert run.trace_id in page and "tempo.example" not in page
