"""The Python client (`clients/python`, `hitl_client`) against the live console: the production web server and
real workers (the `system` fixture), a reviewer and ops deciding over the API, and a fake payment system over
HTTP that is deliberately not idempotent (every POST is a new refund, whatever its idempotency key), so a second
run of an action shows as a second refund.

`require_approval` runs an action once with what a person approved (an edit included), runs nothing when it is
rejected, expires, or stopped by a kill switch (`Locked`: the request stays approved, and the same call after the
release runs it once), and on a shadow card returns the shadow result without calling the function. An agent
process SIGKILLed between its consume and its report (after it paid: the payment happened and nobody heard) is
restarted with the same call: it does not pay again, it raises `OutcomeUnknown`, and the console shows the
execution pending ("Outcome unknown" on the card).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from hitl_client import AsyncClient, Client, Expired, Locked, Rejected, require_approval

from core.models import Channel
from tests.conftest import set_production_password
from tests.serving import serve_in_thread
from tests.system.refunds import decide, request_of
from tests.worker import wait_with_logs

pytestmark = pytest.mark.slow

AGENT_SCRIPT = Path(__file__).with_name("external_agent.py")
CLIENT_SRC = settings.BASE_DIR / "clients" / "python" / "src"
OUTCOME_UNKNOWN_EXIT = 3
CALL_TIMEOUT = 30  # seconds a decorated call may take once decided


class Payments:
    """The payment system the refunds go to: a tiny HTTP server that counts every refund it is sent."""

    def __init__(self):
        self.refunds: list[dict] = []
        self._lock = threading.Lock()
        payments = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with payments._lock:
                    # Not idempotent on purpose: the same key again is another refund.
                    payments.refunds.append({**body, "key": self.headers.get("Idempotency-Key")})
                    answer = {"refund_id": f"re_{len(payments.refunds)}", "amount_cents": body["amount_cents"]}
                raw = json.dumps(answer).encode()
                self.send_response(201)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        serve_in_thread(self.server)

    def refund(self, order_id: str, amount_cents: int) -> dict:
        """What an agent's tool does: one POST /refunds."""
        response = httpx.post(
            f"{self.url}/refunds",
            json={"order_id": order_id, "amount_cents": amount_cents},
            headers={"Idempotency-Key": f"refund-{order_id}"},
        )
        response.raise_for_status()
        return response.json()

    def made(self) -> list[tuple[str, int]]:
        with self._lock:
            return [(refund["order_id"], refund["amount_cents"]) for refund in self.refunds]

    def per_key(self) -> Counter:
        with self._lock:
            return Counter(refund["key"] for refund in self.refunds)

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def payments():
    payments = Payments()
    yield payments
    payments.stop()


@pytest.fixture
def client(system):
    with Client(system.url, system.agent.token, timeout=10) as client:
        yield client


@pytest.fixture
def in_background():
    """Runs a blocking agent call in a thread (it waits for a person, who decides in the test's own thread)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield pool.submit


# --- what the people at the console do, over the API ---------------------------------------------------------


def pending_card(system, future: Future | None = None) -> dict:
    """The one pending card, once the agent's request has opened it (fails at once if the agent's call ended)."""
    found: list[dict] = []

    def opened() -> bool:
        if future is not None and future.done():
            future.result()  # the call ended before a card opened: its exception is the failure
            pytest.fail(f"the agent's call returned before a card opened: {future.result()!r}")
        response = system.reviewer.get("/api/approvals?status=pending")
        assert response.status == 200, response
        found[:] = response.body
        return bool(found)

    wait_with_logs(opened, "the agent's card", system.workers.all, timeout=30)
    (card,) = found
    return card


def kill_switch(system, engaged: bool) -> None:
    reason = "refunds paused: incident" if engaged else "all clear"
    response = system.ops.post("/api/channels/payments/kill-switch", {"engaged": engaged, "reason": reason})
    assert response.status == 200, response


def card_page(system, card_id: int) -> str:
    """The card's page as the reviewer sees it, logged in through the login form."""
    set_production_password(User.objects.get(username="reviewer"))
    with httpx.Client(base_url=system.url, timeout=10) as browser:
        form = browser.get("/accounts/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
        login = browser.post(
            "/accounts/login/",
            data={"username": "reviewer", "password": "password", "csrfmiddlewaretoken": token},
            headers={"Referer": f"{system.url}/accounts/login/"},
        )
        assert login.status_code == 302, login.text[:2000]
        page = browser.get(f"/approvals/{card_id}/")
        assert page.status_code == 200, page.text[:2000]
        return page.text


# --- approve, edit, reject, expire -----------------------------------------------------------------------------


def test_an_approved_call_runs_once_and_a_rerun_returns_the_recorded_result(system, client, payments, in_background):
    @require_approval(client, channel="payments", rationale="The parcel never arrived.", risk="high")
    def refund(order_id: str, amount_cents: int) -> dict:
        return payments.refund(order_id, amount_cents)

    call = in_background(refund, "ord_1", 4_200)
    card = pending_card(system, call)
    assert card["proposed"] == {"order_id": "ord_1", "amount_cents": 4_200} and card["risk"] == "high"
    decide(system, card, "approve", comment="ok")
    assert call.result(CALL_TIMEOUT) == {"refund_id": "re_1", "amount_cents": 4_200}
    assert payments.made() == [("ord_1", 4_200)]

    state = request_of(system, card)
    assert state["status"] == "approved" and state["execution"]["status"] == "succeeded"
    assert state["execution"]["result"] == {"refund_id": "re_1", "amount_cents": 4_200}
    # The same call again is the same request: its recorded result, without paying again.
    assert refund("ord_1", 4_200) == {"refund_id": "re_1", "amount_cents": 4_200}
    assert payments.made() == [("ord_1", 4_200)]


def test_an_edit_is_what_the_function_receives(system, client, payments, in_background):
    received = []

    @require_approval(client, channel="payments", rationale="Refund the order.")
    def refund(order_id: str, amount_cents: int) -> dict:
        received.append((order_id, amount_cents))
        return payments.refund(order_id, amount_cents)

    call = in_background(refund, "ord_2", 5_000)
    card = pending_card(system, call)
    # The schema came from the type hints: the reviewer's edit is checked against it.
    decide(system, card, "edit", payload={"order_id": "ord_2", "amount_cents": 1_500}, comment="only the shipping")
    assert call.result(CALL_TIMEOUT) == {"refund_id": "re_1", "amount_cents": 1_500}
    assert received == [("ord_2", 1_500)] and payments.made() == [("ord_2", 1_500)]
    state = request_of(system, card)
    assert state["edited"] and state["arguments"] == {"order_id": "ord_2", "amount_cents": 1_500}


def test_a_rejection_raises_rejected_with_the_comment_and_runs_nothing(system, client, payments, in_background):
    @require_approval(client, channel="payments", rationale="Refund the order.")
    def refund(order_id: str, amount_cents: int) -> dict:
        return payments.refund(order_id, amount_cents)

    call = in_background(refund, "ord_3", 9_900)
    decide(system, pending_card(system, call), "reject", comment="Refunded by phone already", reason="duplicate")
    with pytest.raises(Rejected) as raised:
        call.result(CALL_TIMEOUT)
    assert (raised.value.comment, raised.value.reason, raised.value.decided_by) == (
        "Refunded by phone already",
        "duplicate",
        "reviewer",
    )
    with pytest.raises(Rejected):  # a re-run: the same decision, still nothing runs
        refund("ord_3", 9_900)
    assert payments.made() == []


def test_a_request_nobody_decides_raises_expired_and_runs_nothing(system, client, payments, in_background):
    @require_approval(client, channel="payments", rationale="Refund the order.", expires_in=60)
    def refund(order_id: str, amount_cents: int) -> dict:
        return payments.refund(order_id, amount_cents)

    call = in_background(refund, "ord_4", 1_000)
    card = pending_card(system, call)
    # Its deadline comes now: the card's timer job (and its deadline) moved to this moment, as the workers'
    # SLA timer would find it a minute later.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE approvals_approval SET due_at = now() WHERE id = %s", [card["id"]])
        cursor.execute(
            "UPDATE procrastinate_jobs SET scheduled_at = now() WHERE queueing_lock = %s", [f"card-due:{card['id']}"]
        )
    with pytest.raises(Expired):
        call.result(CALL_TIMEOUT)
    assert payments.made() == [] and request_of(system, card)["execution"]["status"] == "not_started"


# --- the kill switch -------------------------------------------------------------------------------------------


def test_a_kill_switch_at_consume_time_raises_locked_and_after_its_release_the_call_runs_once(
    system, client, payments, in_background
):
    @require_approval(client, channel="payments", rationale="Refund the order.")
    def refund(order_id: str, amount_cents: int) -> dict:
        return payments.refund(order_id, amount_cents)

    kill_switch(system, engaged=True)
    call = in_background(refund, "ord_5", 2_500)
    card = pending_card(system, call)
    decide(system, card, "approve")  # a person may still say yes; the switch stops the action itself
    with pytest.raises(Locked) as raised:
        call.result(CALL_TIMEOUT)
    assert raised.value.status == 423 and "incident" in raised.value.detail
    state = request_of(system, card)
    assert state["status"] == "approved" and state["execution"]["status"] == "not_started"
    assert payments.made() == []

    kill_switch(system, engaged=False)
    assert refund("ord_5", 2_500) == {"refund_id": "re_1", "amount_cents": 2_500}
    assert refund("ord_5", 2_500) == {"refund_id": "re_1", "amount_cents": 2_500}
    assert payments.made() == [("ord_5", 2_500)]


# --- shadow mode ---------------------------------------------------------------------------------------------


def test_a_shadow_card_never_calls_the_function_and_returns_the_shadow_result(system, client, payments, in_background):
    Channel.objects.filter(name="payments").update(shadow=True)

    @require_approval(client, channel="payments", rationale="Refund the order.")
    def refund(order_id: str, amount_cents: int) -> dict:
        return payments.refund(order_id, amount_cents)

    call = in_background(refund, "ord_6", 3_000)
    card = pending_card(system, call)
    assert card["shadow"]
    decide(system, card, "approve", agreement="agree", done_by_hand="refunded at the bank's portal")
    request = request_of(system, card)
    expected = {
        "shadow": True,
        "request_id": request["id"],
        "action": "refund",
        "arguments": {"order_id": "ord_6", "amount_cents": 3_000},
    }
    assert call.result(CALL_TIMEOUT) == expected
    assert refund("ord_6", 3_000) == expected
    assert payments.made() == [] and request_of(system, card)["execution"]["status"] == "succeeded"


# --- a real agent process killed between its consume and its report ---------------------------------------------


class Agent:
    """tests/system/external_agent.py as a process of its own."""

    def __init__(self, system, payments, order_id: str, amount_cents: int, settle: float, **extra_env: str):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(CLIENT_SRC), os.environ.get("PYTHONPATH")])),
            "HITL_URL": system.url,
            "HITL_TOKEN": system.agent.token,
            "PAYMENTS_URL": payments.url,
            "SETTLE_SECONDS": str(settle),
            "PYTHONUNBUFFERED": "1",
            **extra_env,
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(AGENT_SCRIPT), order_id, str(amount_cents)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def finish(self, timeout: float = CALL_TIMEOUT) -> tuple[int, list[dict], str]:
        stdout, stderr = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, [json.loads(line) for line in stdout.splitlines() if line.startswith("{")], stderr


def test_an_agent_killed_after_its_consume_does_not_pay_again_when_restarted(system, payments):
    agent = Agent(system, payments, "ord_7", 7_700, settle=120)
    try:
        card = pending_card(system)
        decide(system, card, "approve")
        # It consumed, entered the refund and paid; now it waits for the bank's confirmation. Killed there: the
        # payment happened, and nobody reported it.
        wait_with_logs(lambda: payments.made() or agent.proc.poll() is not None, "the agent to pay", [], timeout=30)
        assert agent.proc.poll() is None, agent.finish()
        agent.proc.send_signal(signal.SIGKILL)
        assert agent.proc.wait(10) == -signal.SIGKILL
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
        agent.proc.communicate()
    assert payments.made() == [("ord_7", 7_700)]
    state = request_of(system, card)
    assert state["status"] == "approved" and state["execution"]["status"] == "pending"
    assert state["execution"]["consumed_at"] and state["execution"]["completed_at"] is None

    # Restarted with the same call: the same request (the default key: the action and its arguments' digest),
    # consumed, no outcome: it is not run again.
    started = time.monotonic()
    code, events, stderr = Agent(system, payments, "ord_7", 7_700, settle=0).finish()
    assert code == OUTCOME_UNKNOWN_EXIT, (code, events, stderr)
    assert [event["event"] for event in events] == ["outcome_unknown"]  # never entered the function
    assert events[0]["request_id"] == state["id"]
    assert payments.made() == [("ord_7", 7_700)] and payments.per_key() == Counter({"refund-ord_7": 1})
    print(f"\nrestarted agent answered OutcomeUnknown in {time.monotonic() - started:.2f} s")

    # The console shows it for a person to check: GET, and the card's page.
    assert request_of(system, card)["execution"]["status"] == "pending"
    assert "Outcome unknown" in card_page(system, card["id"])


# --- asyncio -------------------------------------------------------------------------------------------------


def test_the_async_client_asks_waits_and_runs_an_approved_call_once(system, payments, in_background):
    received = []

    async def agent() -> tuple[dict, dict]:
        async with AsyncClient(system.url, system.agent.token, timeout=10) as client:

            @require_approval(client, channel="payments", rationale="The parcel never arrived.")
            async def refund(order_id: str, amount_cents: int) -> dict:
                received.append((order_id, amount_cents))
                return await asyncio.to_thread(payments.refund, order_id, amount_cents)

            first = await refund("ord_8", 880)
            return first, await refund("ord_8", 880)

    call = in_background(asyncio.run, agent())
    decide(system, pending_card(system, call), "approve")
    first, again = call.result(CALL_TIMEOUT)
    assert first == again == {"refund_id": "re_1", "amount_cents": 880}
    assert received == [("ord_8", 880)] and payments.made() == [("ord_8", 880)]


def test_a_request_killed_before_its_decision_is_picked_up_by_the_restarted_agent(system, payments):
    # Killed while it waits for a person (before any go): the restarted agent finds the same request, decided
    # meanwhile, and pays once.
    agent = Agent(system, payments, "ord_9", 990, settle=0)
    card = pending_card(system)
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.communicate(timeout=10)
    decide(system, card, "approve")
    code, events, stderr = Agent(system, payments, "ord_9", 990, settle=0).finish()
    assert code == 0, (code, events, stderr)
    assert [event["event"] for event in events] == ["entered", "paid", "result"]
    assert payments.made() == [("ord_9", 990)] and request_of(system, card)["execution"]["status"] == "succeeded"
