"""The Pydantic AI adapter against the production web server and real workers (issue 19, item 4).

The agent is examples/pydantic_ai_refund.py, run as a real process: Pydantic AI talks to the local OpenAI-compatible
stub (tests/openai_stub.py) over TCP, the console over HTTP with the demo agent's token, and refunds through a
fake payment system this test owns, which counts every refund it is sent (deliberately not idempotent). The
reviewer decides through the API. What is checked: what the payment system received, what the model was sent,
and what the console recorded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.conf import settings

from external.models import ActionRequest
from tests.openai_stub import API_KEY, OpenAIStub, text, tool_calls
from tests.serving import serve_in_thread

pytestmark = pytest.mark.slow

EXAMPLE = settings.BASE_DIR / "examples" / "pydantic_ai_refund.py"
TICKET_TEXT = "Order ord_7 never arrived: please refund the 42.00 EUR."
ASKED = {"order_id": "ord_7", "amount_cents": 4_200, "currency": "EUR"}


class Payments:
    """The payment system: every POST /refunds is a refund, recorded with its Idempotency-Key header (and never
    deduplicated). While `holding`, a refund is recorded and its answer held back (the agent is then inside the
    tool, after its consume and before its report)."""

    def __init__(self) -> None:
        self.refunds: list[dict] = []
        self.holding = False
        self.released = threading.Event()
        payments = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                payments.refunds.append({**body, "key": self.headers.get("Idempotency-Key")})
                if payments.holding:
                    payments.released.wait(60)
                answer = json.dumps({"refund_id": f"re_{len(payments.refunds)}", **body}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except OSError:
                    pass  # the agent was killed while it waited

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        serve_in_thread(self.server)

    def stop(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def answer_from_conversation(request: dict):
    """The model: asks for the refund the ticket wants; once a tool's output is in, repeats it as its answer."""
    last = request["messages"][-1]
    if last["role"] == "tool":
        return text(f"Final answer. The refund tool said: {last['content']}")
    return tool_calls([("refund_order", ASKED)])


@pytest.fixture
def payments():
    payments = Payments()
    yield payments
    payments.stop()


@pytest.fixture
def model():
    with OpenAIStub(default=answer_from_conversation) as stub:
        yield stub


class AgentProcess:
    """examples/pydantic_ai_refund.py for one ticket, its output kept in a file."""

    def __init__(self, system, model, payments, tmp_path, ticket="ticket-42"):
        self.log_path = tmp_path / f"agent-{time.monotonic_ns()}.log"
        # This checkout's client first, whatever the virtualenv has installed.
        source = str(settings.BASE_DIR / "clients" / "python" / "src")
        env = {
            **os.environ,
            "HITL_URL": system.url,
            "HITL_TOKEN": system.agent.token,
            "OPENAI_BASE_URL": model.url,
            "OPENAI_API_KEY": API_KEY,
            "OPENAI_MODEL": "stub-model",
            "PAYMENTS_URL": payments.url,
            "STATE_DIR": str(tmp_path / "state"),
            "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(EXAMPLE), ticket, TICKET_TEXT], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def finish(self, timeout: float = 60) -> str:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the agent did not finish within {timeout} s:\n{self.output()[-3000:]}") from None
        assert code == 0, f"the agent exited with {code}:\n{self.output()[-3000:]}"
        return self.output()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def wait_for(condition, what: str, agent: AgentProcess, timeout: float = 45):
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        assert agent.proc.poll() is None, f"the agent exited while waiting for {what}:\n{agent.output()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{agent.output()[-3000:]}"
        time.sleep(0.1)


def pending_card(system, agent: AgentProcess) -> dict:
    def card():
        cards = system.reviewer.get("/api/approvals?status=pending").body
        return cards[0] if cards else None

    return wait_for(card, "card in the inbox", agent)


def decide(system, card: dict, decision: str, **fields) -> None:
    body = {"decision": decision, "version": card["version"], **fields}
    response = system.reviewer.post(f"/api/approvals/{card['id']}/decision", body)
    assert response.status == 200, response


def request_of(system, card: dict) -> dict:
    """The approval request as its agent reads it (GET with the agent's token)."""
    request = ActionRequest.objects.get(card_id=card["id"])
    response = system.agent.get(f"/api/approval-requests/{request.id}")
    assert response.status == 200, response
    return {**response.body, "idempotency_key": request.idempotency_key}


def tool_messages(model) -> list[str]:
    return [m["content"] for r in model.requests for m in r["messages"] if m["role"] == "tool"]


def test_an_edited_refund_runs_once_with_the_edited_amount(system, model, payments, tmp_path):
    agent = AgentProcess(system, model, payments, tmp_path)
    card = pending_card(system, agent)
    assert card["proposed"] == ASKED
    edited = {**ASKED, "amount_cents": 2_500}
    decide(system, card, "edit", payload=edited, comment="Half was refunded by voucher already.")

    output = agent.finish()

    assert [(r["order_id"], r["amount_cents"]) for r in payments.refunds] == [("ord_7", 2_500)]
    request = request_of(system, card)
    assert request["status"] == "approved" and request["edited"] and request["arguments"] == edited
    assert request["execution"]["status"] == "succeeded"
    assert request["execution"]["result"]["amount_cents"] == 2_500
    # One request per tool call: the session and the call's id; the payment system got the same call id.
    call_id = request["idempotency_key"].removeprefix("ticket-42:")
    assert call_id.startswith("call_") and payments.refunds[0]["key"] == call_id
    # The model was told that a person changed the amount, and what ran (its own call stays as it made it).
    (told,) = tool_messages(model)
    assert "A person edited the arguments" in told and '"amount_cents": 2500' in told
    assert "Final answer" in output


def test_a_rejected_refund_reaches_the_model_with_the_comment_and_runs_nothing(system, model, payments, tmp_path):
    agent = AgentProcess(system, model, payments, tmp_path)
    card = pending_card(system, agent)
    decide(system, card, "reject", comment="The parcel was delivered: tracking shows a signature.")

    output = agent.finish()

    assert payments.refunds == []
    request = request_of(system, card)
    assert request["status"] == "rejected" and request["execution"]["status"] == "not_started"
    (told,) = tool_messages(model)
    assert "rejected" in told and "it did not run" in told
    assert "The parcel was delivered: tracking shows a signature." in told
    assert "tracking shows a signature" in output


def test_an_agent_killed_after_its_go_is_restarted_and_does_not_refund_again(system, model, payments, tmp_path):
    payments.holding = True
    agent = AgentProcess(system, model, payments, tmp_path)
    card = pending_card(system, agent)
    decide(system, card, "approve", comment="ok")
    # The refund reached the payment system; the agent waits for its answer: consumed, nothing reported yet.
    wait_for(lambda: payments.refunds, "refund at the payment system", agent)
    agent.kill()
    payments.released.set()
    assert request_of(system, card)["execution"]["status"] == "pending"
    tools_before, asked_before = len(tool_messages(model)), len(model.requests)

    output = AgentProcess(system, model, payments, tmp_path).finish()

    assert len(payments.refunds) == 1  # never twice
    request = request_of(system, card)
    assert request["execution"]["status"] == "pending"  # outcome unknown: a person checks the payment system
    # The restarted run went on from its saved history and told the model the outcome is unknown.
    told = tool_messages(model)[tools_before:]
    assert len(told) == 1 and "no outcome was reported" in told[0] and "It is not run again" in told[0]
    # It did not ask the model for the refund again: one request, for the answer.
    assert len(model.requests) == asked_before + 1
    assert "not run again" in output
