"""What the client's and the adapters' system tests (test_client_live.py, test_adapters.py, test_adapter_mcp.py)
share: the payment system the example agents refund through (test_client_live.py keeps its own, which answers a
refund as the decorated functions' results there expect), the reviewer's side of a card (through the console's
API), and the clean-up of processes a killed agent leaves behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from external.models import ActionRequest
from tests.serving import serve_in_thread

WAIT = 45  # seconds for anything the tests wait on


class Payments:
    """The payment system: every POST /refunds is a refund, recorded with its Idempotency-Key header if it has
    one (and never deduplicated). While `holding`, a refund is recorded and its answer held back until
    `released` (the agent is then past its go and has not reported)."""

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
                    payments.released.wait(WAIT)
                answer = json.dumps({"refund_id": f"re_{len(payments.refunds)}", **body}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except OSError:
                    pass  # its caller was killed while it waited

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        serve_in_thread(self.server, name="payments")

    def made(self) -> list[tuple[str, int]]:
        """Each refund made: its order and amount."""
        return [(refund["order_id"], refund["amount_cents"]) for refund in self.refunds]

    def stop(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def wait_for(condition: Callable[[], Any], what: str, alive: Callable[[], str | None], timeout: float = WAIT) -> Any:
    """`condition()` once it is true; fails as soon as `alive()` says why the agent cannot get there any more."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        dead = alive()
        assert dead is None, f"waiting for {what}: {dead}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def pending_card(system, alive: Callable[[], str | None]) -> dict:
    """The card in the inbox, once the agent has asked."""

    def card():
        cards = system.reviewer.get("/api/approvals?status=pending").body
        return cards[0] if cards else None

    return wait_for(card, "a card in the inbox", alive)


def decide(system, card: dict, decision: str, **fields) -> None:
    body = {"decision": decision, "version": card["version"], **fields}
    response = system.reviewer.post(f"/api/approvals/{card['id']}/decision", body)
    assert response.status == 200, f"{response}\n{system.server.errors()}"


def request_of(system, card: dict) -> dict:
    """The approval request as its agent reads it (GET with the agent's token), with its idempotency key."""
    request = ActionRequest.objects.get(card_id=card["id"])
    response = system.agent.get(f"/api/approval-requests/{request.id}")
    assert response.status == 200, response
    return {**response.body, "idempotency_key": request.idempotency_key}


def kill_if(pid: int, marker: str) -> None:
    """SIGKILLs `pid` if it is still the process `marker` names (an MCP gateway's upstream left behind)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return  # gone
    if marker.encode() in cmdline:
        os.kill(pid, signal.SIGKILL)
