"""The MCP gateway against the production web server and real workers (issue 19, item 4).

A real MCP client session (the SDK's `Client` over stdio) starts the gateway (`python -m
hitl_client.adapters.mcp_gateway`) as a real process, which starts the upstream refund server
(examples/mcp_refund_server.py) as its own; the refunds go to a fake payment system this test owns, which counts
every refund it is sent (deliberately not idempotent). The reviewer decides through the API. What is checked:
what the payment system received, what the MCP client got back, and what the console recorded.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import mcp_types as types
import pytest
from django.conf import settings
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from external.models import ActionRequest
from tests.serving import serve_in_thread

pytestmark = pytest.mark.slow

CLIENT_SRC = str(settings.BASE_DIR / "clients" / "python" / "src")
REFUND_SERVER = settings.BASE_DIR / "examples" / "mcp_refund_server.py"
EXAMPLE_CLIENT = settings.BASE_DIR / "examples" / "mcp_gateway_client.py"
ASKED = {"order_id": "ord_7", "amount_cents": 4_200, "currency": "EUR"}
WAIT = 45  # seconds for anything the test waits on


class Payments:
    """The payment system: every POST /refunds is a refund, recorded (and never deduplicated). While `holding`,
    a refund is recorded and its answer held back (the gateway has taken the go and forwarded the call, and the
    upstream's answer has not come back)."""

    def __init__(self) -> None:
        self.refunds: list[dict] = []
        self.holding = False
        self.released = threading.Event()
        payments = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                payments.refunds.append(body)
                if payments.holding:
                    payments.released.wait(WAIT)
                answer = json.dumps({"refund_id": f"re_{len(payments.refunds)}", **body}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except OSError:
                    pass  # its caller is gone

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        serve_in_thread(self.server)

    def stop(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


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

    def pid(self, pattern: str) -> int:
        """A pid the last gateway's log names: the gateway's ("MCP gateway (pid N)") or its upstream's."""
        deadline = time.monotonic() + WAIT
        while not (found := re.search(pattern, self.logs[-1].read_text(errors="replace"))):
            assert time.monotonic() < deadline, f"no {pattern!r} in the log:\n{self.log()}"
            time.sleep(0.05)
        return int(found.group(1))

    def stop_orphans(self) -> None:
        """An upstream whose gateway was SIGKILLed exits when it reads the end of its stdin; make sure of it."""
        for path in self.logs:
            for pid in re.findall(r"mcp_refund_server pid (\d+)", path.read_text(errors="replace")):
                _kill_if(int(pid), "mcp_refund_server")


def _kill_if(pid: int, marker: str) -> None:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return  # gone
    if marker.encode() in cmdline:
        os.kill(pid, signal.SIGKILL)


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


def request_of(system, card: dict) -> dict:
    """The approval request as its agent reads it (GET with the agent's token)."""
    request = ActionRequest.objects.get(card_id=card["id"])
    response = system.agent.get(f"/api/approval-requests/{request.id}")
    assert response.status == 200, response
    return {**response.body, "idempotency_key": request.idempotency_key}


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


def test_an_edited_refund_is_forwarded_once_with_the_edited_amount(system, payments, gateways):
    edited = {**ASKED, "amount_cents": 2_500}
    reviewer = Reviewer(system, "edit", payload=edited, comment="Half was refunded by voucher already.")

    result = call(gateways, "refund_order", ASKED)

    card = reviewer.decided()
    assert card["proposed"] == ASKED
    assert payments.refunds == [edited]  # once, with the edited amount
    assert not result.is_error, text(result)
    decision, answer = result.content
    assert decision.text.startswith("Edited by reviewer: amount_cents 4200 -> 2500.")
    assert "Their comment: Half was refunded by voucher already." in decision.text
    assert json.loads(answer.text) == {"refund_id": "re_1", **edited}
    request = request_of(system, card)
    assert request["status"] == "approved" and request["edited"] and request["arguments"] == edited
    assert request["execution"]["status"] == "succeeded"
    assert json.loads(request["execution"]["result"]["content"][0]["text"])["amount_cents"] == 2_500
    # The key the gateway made: its session, the digest of the tool and its arguments, the first such call.
    assert re.fullmatch(r"mcp:ticket-42:[0-9a-f]{64}:1", request["idempotency_key"])


def test_a_rejected_refund_is_an_error_result_with_the_comment_and_forwards_nothing(system, payments, gateways):
    reviewer = Reviewer(system, "reject", comment="The parcel was delivered: tracking shows a signature.")

    result = call(gateways, "refund_order", ASKED)

    card = reviewer.decided()
    assert payments.refunds == []
    assert result.is_error
    assert text(result).startswith("Rejected by reviewer")
    assert "nothing was forwarded" in text(result)
    assert "The parcel was delivered: tracking shows a signature." in text(result)
    request = request_of(system, card)
    assert request["status"] == "rejected" and request["execution"]["status"] == "not_started"
    # The decision as data too, as docs/external-agents.md says of every decided call (issue 24).
    decision = result.meta["hitl/decision"]
    assert decision["request_id"] == request["id"] and decision["status"] == "rejected"
    assert decision["decided_by"] == "reviewer" and decision["forwarded"] is False
    assert decision["comment"] == "The parcel was delivered: tracking shows a signature."


def test_a_gateway_killed_after_its_go_is_restarted_and_the_retried_call_does_not_refund_again(
    system, payments, gateways
):
    payments.holding = True
    reviewer = Reviewer(system, "approve", comment="ok")

    async def first_gateway_dies_while_the_refund_is_on_its_way():
        async with gateways.client() as client:
            call = asyncio.ensure_future(client.call_tool("refund_order", ASKED))
            deadline = time.monotonic() + WAIT
            # The refund reached the payment system; its answer is held back: consumed, nothing reported.
            while not payments.refunds:
                assert not call.done(), f"the call ended before the refund: {call.result()}\n{gateways.log()}"
                assert time.monotonic() < deadline, f"no refund within {WAIT} s:\n{gateways.log()}"
                await asyncio.sleep(0.05)
            os.kill(gateways.pid(r"MCP gateway \(pid (\d+)\)"), signal.SIGKILL)
            with pytest.raises(Exception):  # noqa: B017, PT011 - whatever the SDK raises for a server that died
                await asyncio.wait_for(call, WAIT)

    asyncio.run(first_gateway_dies_while_the_refund_is_on_its_way())
    payments.released.set()
    card = reviewer.decided()
    assert request_of(system, card)["execution"]["status"] == "pending"

    # The client retries the same call through a gateway started again with the same session.
    result = call(gateways, "refund_order", ASKED)

    assert len(payments.refunds) == 1  # never twice
    assert result.is_error
    assert text(result).startswith("Not forwarded again: refund_order (request ")
    assert "no outcome was reported: it may or may not have run" in text(result)
    request = request_of(system, card)
    assert request["execution"]["status"] == "pending"  # outcome unknown: a person checks the payment system
    assert ActionRequest.objects.count() == 1


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
