"""Every adapter of the Python client (`hitl_client.adapters`: the OpenAI Agents SDK, Pydantic AI, LangGraph, the
MCP gateway) through the same scenarios, against the production web server and real workers (issues 19, 25).

The agent is each adapter's example (examples/), run as a real process: the three agent frameworks talk to the
local OpenAI-compatible stub (tests/openai_stub.py) over TCP; the MCP client example starts the gateway, which
starts the upstream refund server. All of them talk to the console over HTTP with the demo agent's token and
refund through a payment system this test owns, which makes every refund it is sent (deliberately not
idempotent). The reviewer decides through the API. What is checked: what the payment system received, what the
agent was told (the model, or the MCP client), and what the console recorded; and that a process SIGKILLed while
it waits, or after its go and before its report, is restarted with the same command and never refunds twice.
What only the gateway does is in test_adapter_mcp.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from external.models import ActionRequest
from tests.openai_stub import API_KEY, OpenAIStub, text, tool_calls
from tests.system.refunds import WAIT, Payments, decide, kill_if, pending_card, request_of, wait_for
from tests.worker import database_url

pytestmark = pytest.mark.slow

EXAMPLES = settings.BASE_DIR / "examples"
CLIENT_SOURCE = str(settings.BASE_DIR / "clients" / "python" / "src")
TICKET = "Order ord_7 never arrived: please refund the 42.00 EUR."


class Adapter:
    """An adapter's example agent, as the scenarios start it and read what it was told."""

    name: str
    asked: dict
    # The request's idempotency key, as the adapter names the call.
    key: str
    # Words in what the agent is told of an edited call, a rejected one, and one whose outcome is unknown.
    edited: tuple[str, ...]
    rejected: tuple[str, ...]
    unknown: tuple[str, ...]
    # Whether a model asks for the call (the gateway's client asks it itself).
    model = True
    # Whether the example hands the call's id to the payment system (its Idempotency-Key header).
    passes_call_id = False

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return {}

    def told(self, agent: AgentProcess, model: OpenAIStub) -> str:
        """What the agent was told of the call, the last time: the tool's output the model was sent."""
        (told,) = [m["content"] for m in model.requests[-1]["messages"] if m["role"] == "tool"]
        return told

    def holder(self, agent: AgentProcess) -> int:
        """The process that takes the go and runs the refund: the one a crash kills."""
        return agent.proc.pid


class OpenAIAgents(Adapter):
    name, example = "openai_agents", "openai_agents_refund.py"
    asked = {"order_id": "ord_7", "amount_cents": 4_200, "currency": "EUR"}
    key = r"ticket-42:call_\w+"
    edited = ("A person edited the arguments",)
    rejected = ("rejected", "it did not run")
    unknown = ("no outcome was reported", "It is not run again")
    passes_call_id = True

    def command(self) -> list[str]:
        return [str(EXAMPLES / self.example), "ticket-42", TICKET]


class PydanticAI(OpenAIAgents):
    name, example = "pydantic_ai", "pydantic_ai_refund.py"


class LangGraph(Adapter):
    name = "langgraph"
    asked = {"order_id": "ord_7", "amount_cents": 4_200}
    key = r"langgraph:thread-\w+:call_\w+"
    edited = ("A reviewer edited the arguments",)
    rejected = ("rejected", "did not run")
    unknown = ("outcome unknown", "not run again")

    def __init__(self, checkpoint_db: str) -> None:
        self.checkpoints, self.thread = checkpoint_db, f"thread-{uuid.uuid4().hex[:8]}"

    def command(self) -> list[str]:
        return [str(EXAMPLES / "langgraph_refund.py"), "--thread", self.thread, TICKET]

    def env(self) -> dict[str, str]:
        return {"CHECKPOINT_DATABASE_URL": self.checkpoints}


class McpGateway(Adapter):
    name = "mcp"
    asked = OpenAIAgents.asked
    # Its session, the digest of the tool and its arguments, the first such call.
    key = r"mcp:ticket-42:[0-9a-f]{64}:1"
    edited = ("Edited by reviewer: amount_cents 4200 -> 2500.", "forwarded once")
    rejected = ("Rejected by reviewer", "nothing was forwarded")
    unknown = ("Not forwarded again", "no outcome was reported: it may or may not have run")
    model = False

    def command(self) -> list[str]:
        arguments = json.dumps(self.asked)
        return [str(EXAMPLES / "mcp_gateway_client.py"), "refund_order", arguments, "--session", "ticket-42"]

    def told(self, agent: AgentProcess, model: OpenAIStub) -> str:
        """The call's result, as the example client prints it (its texts: the decision, the upstream's answer)."""
        answer = json.loads(agent.stdout().strip().splitlines()[-1])
        return "\n".join(answer["text"])

    def holder(self, agent: AgentProcess) -> int:
        # The gateway, the client's child: its log (on the client's stderr) names its pid.
        found = wait_for(
            lambda: re.search(r"MCP gateway \(pid (\d+)\)", agent.stderr()), "the gateway's pid", agent.alive
        )
        return int(found.group(1))


class AgentProcess:
    """The adapter's example, a process of its own (`start()` again: the same command, a new process); its stdout
    and stderr kept in files."""

    def __init__(self, adapter: Adapter, env: dict[str, str], tmp_path: Path) -> None:
        self.adapter, self.env, self.tmp_path = adapter, env, tmp_path
        self.runs = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProcess:
        self.runs += 1
        self.out, self.err = self.tmp_path / f"agent{self.runs}.out", self.tmp_path / f"agent{self.runs}.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *self.adapter.command()], env=self.env, stdout=out, stderr=err
            )
        return self

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def alive(self) -> str | None:
        """None while the process runs; else how it ended, with its output."""
        if self.proc.poll() is None:
            return None
        return f"the agent exited {self.proc.returncode}:\n{self.stdout()[-3000:]}\n{self.stderr()[-3000:]}"

    def finish(self, timeout: float = WAIT) -> None:
        """Waits for the agent to end, having said what it was told (the MCP client ends 1 on an error result)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(
                f"the agent did not finish within {timeout} s:\n{self.stdout()[-3000:]}\n{self.stderr()[-3000:]}"
            )
        assert code in ((0,) if self.adapter.model else (0, 1)), self.alive()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def pids_named(self, pattern: str) -> list[int]:
        """Pids its logs name (the MCP gateway's upstream server, left behind when the gateway is killed)."""
        logs = [self.tmp_path / f"agent{n}.err" for n in range(1, self.runs + 1)]
        return [
            int(pid) for log in logs if log.exists() for pid in re.findall(pattern, log.read_text(errors="replace"))
        ]


def the_model(asked: dict):
    """The stub model: asks for the refund; once a tool's output is in, says what the tool said."""

    def answer(request: dict) -> dict:
        told = [m["content"] for m in request["messages"] if m["role"] == "tool"]
        if told:
            return text(f"Final answer. The refund tool said: {told[-1]}")
        return tool_calls([("refund_order", asked)])

    return answer


@pytest.fixture
def payments():
    payments = Payments()
    yield payments
    payments.stop()


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


@pytest.fixture(params=["openai_agents", "pydantic_ai", "langgraph", "mcp"])
def adapter(request: pytest.FixtureRequest) -> Adapter:
    if request.param == "langgraph":
        return LangGraph(request.getfixturevalue("checkpoint_db"))
    return {"openai_agents": OpenAIAgents, "pydantic_ai": PydanticAI, "mcp": McpGateway}[request.param]()


@pytest.fixture
def model(adapter):
    with OpenAIStub(default=the_model(adapter.asked)) as stub:
        yield stub


@pytest.fixture
def agent(system, adapter, model, payments, tmp_path):
    env = {
        **os.environ,
        "HITL_URL": system.url,
        "HITL_TOKEN": system.agent.token,
        "OPENAI_BASE_URL": model.url,
        "OPENAI_API_KEY": API_KEY,
        "OPENAI_MODEL": "stub-model",
        "PAYMENTS_URL": payments.url,
        "STATE_DIR": str(tmp_path / "state"),
        # This checkout's client first, whatever the virtualenv has installed.
        "PYTHONPATH": os.pathsep.join(filter(None, [CLIENT_SOURCE, os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        **adapter.env(),
    }
    agent = AgentProcess(adapter, env, tmp_path)
    yield agent
    agent.kill()
    # An upstream whose gateway was SIGKILLed exits when it reads the end of its stdin; make sure of it.
    for pid in agent.pids_named(r"mcp_refund_server pid (\d+)"):
        kill_if(pid, "mcp_refund_server")


def test_an_edited_refund_runs_once_with_the_edited_amount(system, adapter, agent, model, payments):
    agent.start()
    card = pending_card(system, agent.alive)
    assert card["proposed"] == adapter.asked
    assert payments.refunds == []  # nothing runs before a person decides
    edited = {**adapter.asked, "amount_cents": 2_500}
    decide(system, card, "edit", payload=edited, comment="Half was refunded by voucher already.")

    agent.finish()

    assert payments.made() == [("ord_7", 2_500)]  # once, with the edited amount
    request = request_of(system, card)
    assert request["status"] == "approved" and request["edited"] and request["arguments"] == edited
    assert request["execution"]["status"] == "succeeded"
    assert "2500" in json.dumps(request["execution"]["result"])
    # One request per tool call, named by the adapter's key.
    assert re.fullmatch(adapter.key, request["idempotency_key"]), request["idempotency_key"]
    if adapter.passes_call_id:  # the payment system got the same call id
        assert payments.refunds[0]["key"] == request["idempotency_key"].rpartition(":")[2]
    # The agent was told that a person changed the amount, why, and what the refund answered.
    told = adapter.told(agent, model)
    assert all(words in told for words in adapter.edited), told
    assert "Half was refunded by voucher already." in told and "2500" in told and "re_1" in told


def test_a_rejected_refund_reaches_the_agent_with_the_comment_and_runs_nothing(system, adapter, agent, model, payments):
    agent.start()
    card = pending_card(system, agent.alive)
    decide(system, card, "reject", comment="The parcel was delivered: tracking shows a signature.")

    agent.finish()

    assert payments.refunds == []
    request = request_of(system, card)
    assert request["status"] == "rejected" and request["execution"]["status"] == "not_started"
    told = adapter.told(agent, model)
    assert all(words in told for words in adapter.rejected), told
    assert "The parcel was delivered: tracking shows a signature." in told


def test_an_agent_killed_after_its_go_is_restarted_and_does_not_refund_again(system, adapter, agent, model, payments):
    payments.holding = True
    agent.start()
    card = pending_card(system, agent.alive)
    decide(system, card, "approve", comment="ok")
    # The refund reached the payment system; the agent waits for its answer: consumed, nothing reported yet.
    wait_for(lambda: payments.refunds, "a refund at the payment system", agent.alive)
    os.kill(adapter.holder(agent), signal.SIGKILL)
    agent.kill()
    payments.released.set()
    assert request_of(system, card)["execution"]["status"] == "pending"
    asked_model = model.calls

    agent.start().finish()  # the same command again

    assert len(payments.refunds) == 1  # never twice
    request = request_of(system, card)
    assert request["execution"]["status"] == "pending"  # outcome unknown: a person checks the payment system
    told = adapter.told(agent, model)
    assert all(words in told for words in adapter.unknown), told
    # The restart went on from where it stopped: the model was asked for the answer, not for the refund again.
    assert model.calls == asked_model + (1 if adapter.model else 0)
    assert ActionRequest.objects.count() == 1


def test_an_agent_killed_while_it_waits_asks_the_same_request_when_restarted(system, adapter, agent, model, payments):
    agent.start()
    card = pending_card(system, agent.alive)
    os.kill(adapter.holder(agent), signal.SIGKILL)  # nobody has decided yet
    agent.kill()
    asked_model = model.calls

    agent.start()
    # The same command again finds its request by its key: the same card, and the model not asked again.
    wait_for(lambda: agent.runs == 2 and _asked_again(agent, adapter), "the restarted agent's wait", agent.alive)
    assert ActionRequest.objects.count() == 1 and model.calls == asked_model
    decide(system, card, "approve", comment="ok")

    agent.finish()

    assert payments.made() == [("ord_7", 4_200)]
    assert request_of(system, card)["execution"]["status"] == "succeeded"
    assert [c["id"] for c in system.reviewer.get("/api/approvals?status=all").body] == [card["id"]]
    assert model.calls == asked_model + (1 if adapter.model else 0)


def _asked_again(agent: AgentProcess, adapter: Adapter) -> bool:
    """The restarted agent waits for a decision: the examples say so on stdout, the gateway on its log."""
    if adapter.model:
        return "Waiting for a person" in agent.stdout()
    return "tools:" in agent.stderr()
