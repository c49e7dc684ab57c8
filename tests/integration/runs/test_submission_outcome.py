"""`POST /api/runs` without an idempotency key, when the connection is lost while the run's statement is in flight
(its commit's outcome unknown to the server): the server chose the run's id before the statement and sends the
same statement again, with the same id, on a new connection. The primary key is the fence: the first statement
committed (the second finds its row: 202 with that run), it never ran (the second makes the run: 202), or it is
still running on a backend that has not noticed (the second waits for it on the key, then one of the two). Either
way one run and one job, where a 503 used to invite a retry that made a second run (runs.submission).

The fault is real: a TCP proxy between Django's connection and PostgreSQL passes everything until the statement
that inserts the run, then either drops it before the server sees it, or passes it on, waits for the server's
ReadyForQuery (in autocommit the statement has then committed) and cuts the client's connection without passing
the answer on: the commit happened, the client never heard of it."""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import pytest
from django.db import connection
from django.test import Client
from procrastinate.contrib.django.models import ProcrastinateJob

from runs.models import Run
from tests.engine_helpers import REFUND
from tests.integration.approvals.test_api_approvals import bearer

MARKER = b"procrastinate_defer_jobs"  # in the one statement that inserts a run and its first job
READY_FOR_QUERY = b"Z\x00\x00\x00\x05"  # then the transaction status byte: the statement's work is over


class CuttingProxy:
    """Forwards TCP between clients and PostgreSQL; cuts the first connection that sends MARKER, once: `before`
    drops that message (the server never sees it), `after_commit` forwards it and cuts the client once the server
    answered ReadyForQuery. `down_after_cut`: later connections are refused, as while the server is down."""

    def __init__(self, upstream: tuple[str, int], mode: str, down_after_cut: bool = False):
        self.upstream, self.mode, self.down_after_cut = upstream, mode, down_after_cut
        self.cut = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut.is_set() and self.down_after_cut:
                client.close()
                continue
            server = socket.create_connection(self.upstream)
            state = {"cutting": False}
            threading.Thread(target=self._to_server, args=(client, server, state), daemon=True).start()
            threading.Thread(target=self._to_client, args=(server, client, state), daemon=True).start()

    def _to_server(self, client, server, state) -> None:
        try:
            while chunk := client.recv(65536):
                if MARKER in chunk and not self.cut.is_set():
                    self.cut.set()
                    if self.mode == "before":
                        self._hang_up(client, server)
                        return
                    state["cutting"] = True  # before the server can answer
                server.sendall(chunk)
        except OSError:
            pass
        self._hang_up(client, server)

    def _to_client(self, server, client, state) -> None:
        held = b""
        try:
            while chunk := server.recv(65536):
                if state["cutting"]:
                    held += chunk
                    if held[-6:-1] == READY_FOR_QUERY:
                        break  # committed; the client never hears of it
                    continue
                client.sendall(chunk)
        except OSError:
            pass
        self._hang_up(client, server)

    @staticmethod
    def _hang_up(*sockets) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.fixture
def through_proxy():
    """Points this thread's Django connection at a CuttingProxy made by the test (its mode), restoring it after."""
    settings_dict = connection.settings_dict
    saved = {key: settings_dict.get(key) for key in ("HOST", "PORT")}
    saved_options = dict(settings_dict["OPTIONS"])
    proxies = []

    def use(mode: str, **kwargs) -> CuttingProxy:
        host = settings_dict["HOST"] or "127.0.0.1"
        if host.startswith("/"):
            pytest.skip("the database is reached over a unix socket: the proxy speaks TCP")
        proxy = CuttingProxy((host, int(settings_dict["PORT"] or 5432)), mode, **kwargs)
        proxies.append(proxy)
        connection.close()
        settings_dict.update(HOST="127.0.0.1", PORT=str(proxy.port))
        settings_dict["OPTIONS"] = {**saved_options, "sslmode": "disable"}  # the proxy reads the statement
        return proxy

    yield use
    connection.close()
    settings_dict.update(saved)
    settings_dict["OPTIONS"] = saved_options
    for proxy in proxies:
        proxy.close()


def submit(agent) -> object:
    body = {"workflow": "refund", "input": REFUND}  # no idempotency_key
    try:
        return Client(raise_request_exception=False).post(
            "/api/runs", data=json.dumps(body), content_type="application/json", headers=agent
        )
    finally:
        connection.close()  # a server closes the request's connection; Django's test client keeps it


def jobs_of(run_id) -> int:
    return ProcrastinateJob.objects.filter(lock=f"run:{run_id}").count()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["after_commit", "before"], ids=["committed, answer lost", "never reached"])
def test_a_lost_connection_around_the_commit_makes_one_run_and_answers_202(demo, through_proxy, mode):
    agent = bearer(demo["agent"])
    proxy = through_proxy(mode)

    response = submit(agent)

    assert proxy.cut.is_set(), "the proxy never saw the run's statement"
    assert response.status_code == 202, response.content
    (run,) = Run.objects.all()
    assert str(run.id) == response.json()["id"] and response.json()["url"] == f"/api/runs/{run.id}"
    assert jobs_of(run.id) == 1


@pytest.mark.django_db(transaction=True)
def test_a_database_still_unreachable_is_a_503_naming_the_run_to_look_for(demo, through_proxy):
    agent = bearer(demo["agent"])
    proxy = through_proxy("after_commit", down_after_cut=True)

    response = submit(agent)

    assert proxy.cut.is_set()
    proxy.down_after_cut = False  # the database is back, for the test's own reads
    assert response.status_code == 503, response.content
    assert response["Retry-After"] == "5"
    (run,) = Run.objects.all()  # it did commit: the 503 says which run to look for before sending it again
    assert response.json()["error"] == "database_unavailable"
    assert f"/api/runs/{run.id}" in response.json()["detail"]
