"""What only the MCP gateway does, against the production web server and real workers (issues 19, 24): the
scenarios it shares with the other adapters (an edit, a rejection, a gateway killed while it waits or after its
go) are in test_adapters.py.

A real MCP client session (the SDK's `Client` over stdio) starts the gateway (`python -m
hitl_client.adapters.mcp_gateway`) as a real process, which starts the upstream refund server
(examples/mcp_refund_server.py) as its own; the refunds go to the payment system the tests own (refunds.py). The
reviewer decides through the API.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import mcp_types as types
import pytest
from django.conf import settings
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from external.models import ActionRequest
from tests.system.refunds import WAIT, Payments, kill_if, request_of

pytestmark = pytest.mark.slow

CLIENT_SRC = str(settings.BASE_DIR / "clients" / "python" / "src")
REFUND_SERVER = settings.BASE_DIR / "examples" / "mcp_refund_server.py"
EXAMPLE_CLIENT = settings.BASE_DIR / "examples" / "mcp_gateway_client.py"
ASKED = {"order_id": "ord_7", "amount_cents": 4_200, "currency": "EUR"}


@pytest.fixture
def payments():
    payments = Payments()
    yield payments
    payments.stop()


class Gateways:
    """Every gateway process a test started, through the MCP client's stdio transport: their stderr (the gateway's
    log and its upstream's) in one file per process, where their pids are read; all stopped at the end."""

    def __init__(self, system, payments: Payments, tmp_path: Path) -> None:
        self.system, self.payments, self.tmp_path = system, payments, tmp_path
        self.logs: list[Path] = []

    def env(self) -> dict[str, str]:
        return {
            "HITL_URL": self.system.url,
            "HITL_TOKEN": self.system.agent.token,
            "PAYMENTS_URL": self.payments.url,
            # This checkout's client first, whatever the virtualenv has installed.
            "PYTHONPATH": os.pathsep.join(filter(None, [CLIENT_SRC, os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }

    def arguments(self, approve: tuple[str, ...] = ("refund_order",), session: str | None = "ticket-42") -> list[str]:
        """The gateway's command line after the interpreter: the refund server upstream, `--approve` each of
        `approve`, and `--session` unless None (then each gateway process has its own)."""
        upstream = shlex.join([sys.executable, str(REFUND_SERVER)])
        return [
            "-m",
            "hitl_client.adapters.mcp_gateway",
            "--upstream",
            upstream,
            "--channel",
            "payments",
            *[argument for name in approve for argument in ("--approve", name)],
            *(["--session", session] if session is not None else []),
            "--display",
            "amount_minor=amount_cents",
        ]

    def parameters(self, **options) -> StdioServerParameters:
        return StdioServerParameters(command=sys.executable, args=self.arguments(**options), env=self.env())

    @asynccontextmanager
    async def client(self, **options):
        """An MCP client session with a new gateway process (`options`: the gateway's `arguments`)."""
        log_path = self.tmp_path / f"gateway-{len(self.logs)}.log"
        self.logs.append(log_path)
        with open(log_path, "w") as errlog:
            async with Client(stdio_client(self.parameters(**options), errlog=errlog)) as client:
                yield client

    def log(self) -> str:
        return "\n".join(f"--- {path.name} ---\n{path.read_text(errors='replace')[-3000:]}" for path in self.logs)

    def stop_orphans(self) -> None:
        """An upstream whose gateway was SIGKILLed exits when it reads the end of its stdin; make sure of it."""
        for path in self.logs:
            for pid in re.findall(r"mcp_refund_server pid (\d+)", path.read_text(errors="replace")):
                kill_if(int(pid), "mcp_refund_server")


@pytest.fixture
def gateways(system, payments, tmp_path):
    gateways = Gateways(system, payments, tmp_path)
    yield gateways
    gateways.stop_orphans()


class Reviewer(threading.Thread):
    """A person at the console: decides the first pending card as it appears (through the API)."""

    def __init__(self, system, decision: str, **fields) -> None:
        super().__init__(daemon=True)
        self.system, self.decision, self.fields = system, decision, fields
        self.card: dict | None = None
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            cards = self.system.reviewer.get("/api/approvals?status=pending").body
            if cards:
                self.card = cards[0]
                body = {"decision": self.decision, "version": self.card["version"], **self.fields}
                response = self.system.reviewer.post(f"/api/approvals/{self.card['id']}/decision", body)
                if response.status != 200:
                    self.error = f"the decision was refused: {response}"
                return
            time.sleep(0.1)
        self.error = f"no card in the inbox within {WAIT} s"

    def decided(self) -> dict:
        self.join(WAIT)
        assert self.error is None and self.card is not None, self.error
        return self.card


def call(gateways: Gateways, tool: str, arguments: dict, **options) -> types.CallToolResult:
    """One call through a new gateway process, in a new MCP client session (`options`: the gateway's)."""

    async def main():
        async with gateways.client(**options) as client:
            return await asyncio.wait_for(client.call_tool(tool, arguments), WAIT)

    try:
        return asyncio.run(main())
    except BaseException:
        print(gateways.log())
        raise


def text(result: types.CallToolResult) -> str:
    return "\n".join(part.text for part in result.content if isinstance(part, types.TextContent))


def test_a_rejection_says_its_decision_as_data_too(system, payments, gateways):
    reviewer = Reviewer(system, "reject", comment="The parcel was delivered: tracking shows a signature.")

    result = call(gateways, "refund_order", ASKED)

    card = reviewer.decided()
    assert payments.refunds == [] and result.is_error and text(result).startswith("Rejected by reviewer")
    request = request_of(system, card)
    # The decision as data, besides the text every adapter's agent reads (test_adapters.py), as
    # docs/external-agents.md says of every decided call (issue 24).
    decision = result.meta["hitl/decision"]
    assert decision["request_id"] == request["id"] and decision["status"] == "rejected"
    assert decision["decided_by"] == "reviewer" and decision["forwarded"] is False
    assert decision["comment"] == "The parcel was delivered: tracking shows a signature."


def test_a_tool_the_gateway_is_not_told_about_passes_through_without_a_card(system, payments, gateways):
    # The example client, as a process: it starts the gateway, which starts the refund server.
    env = {**os.environ, **gateways.env()}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE_CLIENT), "lookup_order", json.dumps({"order_id": "ord_7"})],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )

    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout)
    assert answer["is_error"] is False and answer["decision"] is None
    assert json.loads(answer["text"][0])["status"] == "lost in transit"
    assert ActionRequest.objects.count() == 0
    assert system.reviewer.get("/api/approvals?status=pending").body == []
    assert payments.refunds == []


def test_a_misspelt_approve_name_stops_the_gateway_before_anything_is_forwarded(system, payments, gateways):
    # Issue 24, defect 13. The upstream's tool is refund_order; the operator typed `--approve refund`. A gateway
    # that started anyway would guard nothing and forward every refund_order without a card.
    async def main():
        async with gateways.client(approve=("refund",)) as client:
            return await asyncio.wait_for(client.call_tool("refund_order", ASKED), WAIT)

    with pytest.raises(Exception) as raised:  # noqa: PT011 - whatever the SDK raises for a server that exited
        result = asyncio.run(main())
        pytest.fail(f"the gateway served the call: {text(result)}\n{gateways.log()}")

    assert payments.refunds == [], gateways.log()
    assert ActionRequest.objects.count() == 0
    log = gateways.logs[-1].read_text(errors="replace")
    assert "the upstream server has no tool named 'refund'" in log, (raised.value, log)
    assert "refund_order" in log  # what it does have (and the likely meant name)

    # The same gateway, as a process of its own: it exits non-zero, with one clear line and no traceback.
    done = subprocess.run(
        [sys.executable, *gateways.arguments(approve=("refund",))],
        env={**os.environ, **gateways.env()},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [errors[0]] and "no tool named 'refund'" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert payments.refunds == []


def test_two_gateway_processes_of_one_token_do_not_share_their_calls(system, payments, gateways):
    # Issue 24: with the default session, every gateway process of a token made the same key for the same call,
    # so a second conversation's refund got the first one's recorded result (and was never asked or made).
    first_reviewer = Reviewer(system, "approve", comment="first conversation")
    first = call(gateways, "refund_order", ASKED, session=None)
    first_card = first_reviewer.decided()

    second_reviewer = Reviewer(system, "approve", comment="second conversation")
    second = call(gateways, "refund_order", ASKED, session=None)
    second_card = second_reviewer.decided()

    assert not first.is_error and not second.is_error, (text(first), text(second))
    assert text(second).startswith("Approved by reviewer. refund_order was forwarded once."), text(second)
    assert "second conversation" in text(second)
    assert len(payments.refunds) == 2  # each conversation's own refund, each asked on its own card
    assert first_card["id"] != second_card["id"] and ActionRequest.objects.count() == 2
    keys = [request_of(system, card)["idempotency_key"] for card in (first_card, second_card)]
    assert keys[0] != keys[1]
    # Each process its own session: its own external run (one timeline per conversation).
    assert request_of(system, first_card)["run_id"] != request_of(system, second_card)["run_id"]
