"""The LangGraph adapter against the production web server and real workers (issue 19).

The agent is the repository's example (`examples/langgraph_refund.py`), run as a real process: a LangGraph graph
with LangChain's ChatOpenAI pointed at the stub model, the refund tool behind `ApprovalToolNode`, its checkpoints
in a Postgres database of its own. The refunds go to a fake payment service that counts every call and is
deliberately not idempotent: a refund it receives twice is made twice. The reviewer decides over the API.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from external.models import ActionRequest
from tests.openai_stub import API_KEY, text, tool_calls
from tests.serving import serve_in_thread
from tests.worker import database_url

pytestmark = pytest.mark.slow

EXAMPLE = settings.BASE_DIR / "examples" / "langgraph_refund.py"
CLIENT_SOURCE = settings.BASE_DIR / "clients" / "python" / "src"
ASKED = {"order_id": "ord_1", "amount_cents": 5_000}
CUSTOMER = "Order ord_1 arrived broken: please refund it."


class Payments:
    """A payment service that makes every refund it is sent (no deduplication), counted here. With `hold` set, a
    refund is made and recorded, and its answer is held back until `release()`: the agent is then past the go and
    has not reported."""

    def __init__(self) -> None:
        self.refunds: list[dict] = []
        self.hold = False
        self._released = threading.Event()
        payments = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                payments.refunds.append(body)
                if payments.hold:
                    payments._released.wait(60)
                answer = json.dumps({"refund_id": f"re_{len(payments.refunds)}", **body}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except OSError:
                    pass  # the agent died waiting for this answer

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        serve_in_thread(self._server, name="payments")
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def release(self) -> None:
        self._released.set()

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def payments():
    service = Payments()
    yield service
    service.stop()


@pytest.fixture
def checkpoint_db():
    """A database of its own for LangGraph's checkpoints, on the test database's server; dropped at the end."""
    name = f"langgraph_ckpt_{uuid.uuid4().hex[:12]}"
    server = {**connection.settings_dict, "NAME": "postgres"}
    with psycopg.connect(database_url(server), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield database_url({**connection.settings_dict, "NAME": name})
    finally:
        with psycopg.connect(database_url(server), autocommit=True) as admin:
            # WITH (FORCE): the connections left to it are this test's own agents'.
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def the_model(request: dict) -> dict:
    """The stub model: asks for the refund; once the tool answered, says what the tool said."""
    results = [m["content"] for m in request["messages"] if m["role"] == "tool"]
    if results:
        return text(f"Done. The refund tool said: {results[-1]}")
    return tool_calls([("refund_order", ASKED)])


class Agent:
    """The example, run as a process of its own (`start()` again: the same command, a new process)."""

    def __init__(self, system, openai_stub, payments, checkpoint_db, tmp_path, thread: str):
        self.command = [sys.executable, str(EXAMPLE), "--thread", thread, CUSTOMER]
        self.env = {
            **os.environ,
            # This checkout's client, whatever the virtualenv has installed.
            "PYTHONPATH": os.pathsep.join([str(CLIENT_SOURCE), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
            "HITL_URL": system.url,
            "HITL_TOKEN": system.agent.token,
            "OPENAI_BASE_URL": openai_stub.url,
            "OPENAI_API_KEY": API_KEY,
            "OPENAI_MODEL": "stub",
            "CHECKPOINT_DATABASE_URL": checkpoint_db,
            "PAYMENTS_URL": payments.url,
        }
        self.tmp_path = tmp_path
        self.runs = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> Agent:
        self.runs += 1
        self.log_path = self.tmp_path / f"agent{self.runs}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def waiting_for(self, timeout: float = 30) -> str:
        """The id of the request the agent waits for, once it says it waits (it is then in its long poll)."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(r"Waiting for a person .*\(request ([0-9a-f-]+)\)", self.output())):
            assert self.proc.poll() is None, f"the agent exited {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"the agent did not wait for a decision:\n{self.output()}"
            time.sleep(0.05)
        return found.group(1)

    def finish(self, timeout: float = 40) -> list[dict]:
        """The conversation the agent printed when it ended (it must end well)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the agent did not finish within {timeout} s:\n{self.output()}")
        assert self.proc.returncode == 0, f"the agent exited {self.proc.returncode}:\n{self.output()}"
        return [json.loads(line) for line in self.output().splitlines() if line.startswith("{")]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def agent(system, openai_stub, payments, checkpoint_db, tmp_path):
    openai_stub.default = the_model
    made = Agent(system, openai_stub, payments, checkpoint_db, tmp_path, thread=f"thread-{uuid.uuid4().hex[:8]}")
    yield made
    if made.proc is not None and made.proc.poll() is None:
        made.kill()


def card_of(system, request_id: str) -> dict:
    card_id = system.agent.get(f"/api/approval-requests/{request_id}").body["card_id"]
    (card,) = [c for c in system.reviewer.get("/api/approvals?status=all").body if c["id"] == card_id]
    return card


def decide(system, request_id: str, decision: str, **fields) -> None:
    card = card_of(system, request_id)
    body = {"decision": decision, "version": card["version"], **fields}
    response = system.reviewer.post(f"/api/approvals/{card['id']}/decision", body)
    assert response.status == 200, response


def request_state(system, request_id: str) -> dict:
    return system.agent.get(f"/api/approval-requests/{request_id}").body


def tool_messages_sent(openai_stub) -> list[str]:
    """What the model was told the tools answered, in the last conversation it was sent."""
    return [m["content"] for m in openai_stub.requests[-1]["messages"] if m["role"] == "tool"]


def test_an_edited_refund_runs_once_with_the_edited_amount(system, agent, payments, openai_stub):
    request_id = agent.start().waiting_for()
    assert payments.refunds == []  # nothing runs before a person decides
    edited = {**ASKED, "amount_cents": 3_000}
    decide(system, request_id, "edit", payload=edited, comment="The box only: 30 EUR.")

    conversation = agent.finish()
    assert payments.refunds == [edited]
    state = request_state(system, request_id)
    assert state["edited"] and state["arguments"] == edited
    assert state["execution"]["status"] == "succeeded" and '"refund_id": "re_1"' in state["execution"]["result"]
    # The model hears the result of what ran, and that a reviewer changed it.
    (told,) = tool_messages_sent(openai_stub)
    assert '"amount_cents": 3000' in told and "A reviewer edited the arguments" in told and "30 EUR" in told
    assert conversation[-1]["type"] == "ai" and "re_1" in conversation[-1]["content"]


def test_a_rejection_reaches_the_model_with_the_comment_and_runs_nothing(system, agent, payments, openai_stub):
    request_id = agent.start().waiting_for()
    decide(system, request_id, "reject", comment="Refunds need a photo of the damage first.")

    conversation = agent.finish()
    assert payments.refunds == []
    state = request_state(system, request_id)
    assert (state["status"], state["execution"]["status"]) == ("rejected", "not_started")
    (told,) = tool_messages_sent(openai_stub)
    assert "rejected" in told and "Refunds need a photo of the damage first." in told and "did not run" in told
    assert [m["type"] for m in conversation] == ["human", "ai", "tool", "ai"]


def test_an_agent_killed_after_the_go_is_not_run_again_when_restarted(system, agent, payments, openai_stub):
    payments.hold = True  # the refund is made; its answer never reaches the agent
    request_id = agent.start().waiting_for()
    decide(system, request_id, "approve", comment="ok")
    deadline = time.monotonic() + 30
    while not payments.refunds:
        assert agent.proc.poll() is None and time.monotonic() < deadline, agent.output()
        time.sleep(0.02)
    agent.kill()  # after consume, before the report
    payments.release()
    assert request_state(system, request_id)["execution"]["status"] == "pending"
    asked_model = openai_stub.calls

    conversation = agent.start().finish()  # the same command again
    assert payments.refunds == [ASKED]  # made once, never again
    assert request_state(system, request_id)["execution"]["status"] == "pending"  # for a person to check
    (told,) = tool_messages_sent(openai_stub)
    assert "outcome unknown" in told and "not run again" in told
    # The restart continued the thread from its checkpoint: the model was not asked for the refund again.
    assert openai_stub.calls == asked_model + 1
    assert "outcome unknown" in conversation[-2]["content"]
    assert ActionRequest.objects.count() == 1


def test_an_agent_killed_while_it_waits_resumes_from_its_checkpoint(system, agent, payments, openai_stub):
    request_id = agent.start().waiting_for()
    agent.kill()  # nobody has decided yet
    assert openai_stub.calls == 1

    # The same command again waits for the same request: the thread's checkpoint has the model's call.
    assert agent.start().waiting_for() == request_id
    assert openai_stub.calls == 1 and ActionRequest.objects.count() == 1
    assert [c["id"] for c in system.reviewer.get("/api/approvals?status=all").body] == [
        card_of(system, request_id)["id"]
    ]
    decide(system, request_id, "approve", comment="ok")

    conversation = agent.finish()
    assert payments.refunds == [ASKED]
    assert request_state(system, request_id)["execution"]["status"] == "succeeded"
    assert openai_stub.calls == 2
    assert conversation[-1]["type"] == "ai" and "re_1" in conversation[-1]["content"]
