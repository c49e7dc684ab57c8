"""Agents waiting on `GET /api/approval-requests/{id}?wait=N`, against the production web server (issue 24).

A waiting agent holds neither a thread of the server nor its database: the server process keeps the same number
of threads while 50 agents wait, nobody reads their requests while nothing happens, and a reviewer's inbox call
answers meanwhile. A decision wakes its waiter at once (through the web process's one LISTEN session,
external/waiters.py), not at a fallback interval; and when that session is terminated, a decision taken while it
reconnects still wakes its waiter, and later decisions wake theirs at once again. With no URL that keeps a
session (a transaction pool and no WORKER_DATABASE_URL), the fallback still brings the decision within seconds.

`LONG_POLL_WAITERS` (default 50) sets how many agents wait.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import pytest
from django.db import connection

from tests.system.conftest import env_int

pytestmark = pytest.mark.slow

ARGUMENTS = {"order_id": "ord_24", "amount_cents": 2_400}
WAITERS = env_int("LONG_POLL_WAITERS", 50)
# The web process's LISTEN session names itself `web:<pid>:listen` in pg_stat_activity (external/waiters.py).
LISTENER = "web:{pid}:listen"


def digest(arguments) -> str:
    return hashlib.sha256(json.dumps(arguments, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def ask(system, key: str) -> dict:
    response = system.agent.post(
        "/api/approval-requests",
        {"channel": "payments", "action": "refund", "arguments": ARGUMENTS, "idempotency_key": key},
    )
    assert response.status == 202, response
    return response.body


def versions(system) -> dict[int, int]:
    """The open cards' versions, as the reviewer's inbox call gives them."""
    response = system.reviewer.get("/api/approvals")
    assert response.status == 200, response
    return {card["id"]: card["version"] for card in response.body}


def approve(system, card_id: int, version: int) -> None:
    response = system.reviewer.post(
        f"/api/approvals/{card_id}/decision", {"decision": "approve", "version": version, "comment": "ok"}
    )
    assert response.status == 200, f"{response}\n{system.server.errors()}"


class Waiter(threading.Thread):
    """One agent's long-poll, in a thread of the test: its answer and when it came."""

    def __init__(self, system, request: dict, wait: int = 30):
        super().__init__(daemon=True)
        self.system, self.request, self.wait = system, request, wait
        self.response = None
        self.answered_at: float | None = None

    def run(self) -> None:
        path = f"/api/approval-requests/{self.request['id']}?wait={self.wait}"
        self.response = self.system.agent.call("GET", path, timeout=self.wait + 30)
        self.answered_at = time.monotonic()


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def request_reads() -> int:
    """How many times the test database has read the approval-request table (index and sequential scans): every
    look of a long-poll reads it. PostgreSQL's statistics lag by up to a second or so."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_user_tables"
            " WHERE relname = 'external_actionrequest'"
        )
        return cursor.fetchone()[0]


def listener_pid(server_pid: int) -> int | None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND datname = current_database()",
            [LISTENER.format(pid=server_pid)],
        )
        row = cursor.fetchone()
    return row[0] if row else None


def wait_for(condition, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)
    return found


def test_waiting_agents_hold_no_thread_and_no_look_and_a_decision_wakes_its_waiter_at_once(system):
    requests = [ask(system, f"waiting-{i}") for i in range(WAITERS)]
    pid = system.server.proc.pid
    assert system.reviewer.get("/api/approvals").status == 200  # the server's threads and pool are up
    threads_before = threads_of(pid)

    waiters = [Waiter(system, request) for request in requests]
    for waiter in waiters:
        waiter.start()
    time.sleep(3)  # every agent has made its first look and waits
    assert not [w for w in waiters if w.response is not None], "a long-poll answered before any decision"

    threads_waiting = threads_of(pid)
    reads_before = request_reads()
    time.sleep(3)
    reads_while_waiting = request_reads() - reads_before

    started = time.monotonic()
    version = versions(system)
    listed_in = time.monotonic() - started

    decided_at = time.monotonic()
    approve(system, requests[0]["card_id"], version[requests[0]["card_id"]])
    waiters[0].join(10)
    woken_in = (waiters[0].answered_at or float("inf")) - decided_at
    print(
        f"\n{WAITERS} long-polls waiting: server threads {threads_before} -> {threads_waiting}; reads of the requests"
        f" in 3 s of waiting: {reads_while_waiting}; GET /api/approvals in {listed_in * 1000:.0f} ms;"
        f" decision to answer {woken_in * 1000:.0f} ms"
    )
    # Before issue 24 each waiting long-poll held a thread of its own (asgiref's per-request thread) and looked
    # at its request 5 times a second: +50 threads, ~750 reads in 3 s.
    assert threads_waiting - threads_before < 10, "waiting long-polls hold threads of the server"
    assert reads_while_waiting < 20, "waiting long-polls keep reading the database"
    assert listed_in < 5.0  # a hang detector, not a latency figure (bench/longpoll.py measures that)
    assert waiters[0].response.status == 200 and waiters[0].response.body["status"] == "approved"
    assert waiters[0].response.body["arguments_digest"] == digest(ARGUMENTS)
    assert woken_in < 2.0, "the decision woke its waiter only at a fallback interval"

    for request in requests[1:]:
        approve(system, request["card_id"], version[request["card_id"]])
    for waiter in waiters[1:]:
        waiter.join(15)
    answers = [(w.response.status, w.response.body["status"]) if w.response else None for w in waiters]
    assert answers == [(200, "approved")] * WAITERS


def test_a_decision_taken_while_the_listener_reconnects_still_wakes_its_waiter(system):
    pid = system.server.proc.pid
    first, second = ask(system, "reconnect-1"), ask(system, "reconnect-2")
    waiter = Waiter(system, first)
    waiter.start()
    session = wait_for(lambda: listener_pid(pid), "LISTEN session of the web process", timeout=10)

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [session])
    version = versions(system)
    decided_at = time.monotonic()
    approve(system, first["card_id"], version[first["card_id"]])
    waiter.join(20)
    assert waiter.response is not None, "the waiter was not woken after its listener's session was terminated"
    assert waiter.response.status == 200 and waiter.response.body["status"] == "approved", waiter.response
    print(f"\nlistener terminated: decision to answer {(waiter.answered_at - decided_at) * 1000:.0f} ms")

    # The listener is back on a new session: the next decision wakes its waiter at once again.
    wait_for(lambda: listener_pid(pid) not in (None, session), "new LISTEN session", timeout=15)
    waiter = Waiter(system, second)
    waiter.start()
    time.sleep(1)
    decided_at = time.monotonic()
    approve(system, second["card_id"], version[second["card_id"]])
    waiter.join(10)
    assert waiter.response is not None and waiter.response.body["status"] == "approved", waiter.response
    assert waiter.answered_at - decided_at < 2.0, "after a reconnection, decisions wake waiters only at a fallback"


class TestWithoutASessionForTheListener:
    """DATABASE_URL declared a transaction pool (DATABASE_TRANSACTION_POOL=1) and no WORKER_DATABASE_URL: no URL
    keeps a LISTEN session, so the web process opens none and waiting agents look again every 5 s instead."""

    @pytest.fixture
    def system_env(self):
        return {"DATABASE_TRANSACTION_POOL": "1", "WORKER_DATABASE_URL": ""}

    def test_a_decision_still_reaches_its_waiter_through_the_fallback(self, system):
        request = ask(system, "fallback")
        waiter = Waiter(system, request)
        waiter.start()
        time.sleep(1)
        assert listener_pid(system.server.proc.pid) is None
        version = versions(system)
        decided_at = time.monotonic()
        approve(system, request["card_id"], version[request["card_id"]])
        waiter.join(15)
        assert waiter.response is not None and waiter.response.body["status"] == "approved", waiter.response
        waited = waiter.answered_at - decided_at
        print(f"\nno listener: decision to answer {waited * 1000:.0f} ms (the fallback looks every 5 s)")
        assert waited < 8
