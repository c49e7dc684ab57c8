"""Approval requests from an external agent, against the production web server and real workers (issue 19).

The agent and the reviewer talk to the console only over HTTP with their API tokens: a long-poll answers as soon
as a person decides (and holds no server thread meanwhile: other calls are answered while many wait); the
decision is POSTed to the agent's callback URL, signed as Standard Webhooks says; a request nobody decides
expires through its card's own SLA timer, fail closed.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from django.db import connection
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from core.models import ApiToken
from external.models import ActionRequest
from tests.serving import serve_in_thread
from tests.worker import wait_with_logs

pytestmark = pytest.mark.slow

ARGUMENTS = {"order_id": "ord_7", "amount_cents": 4_200}


def digest(arguments) -> str:
    return hashlib.sha256(json.dumps(arguments, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def ask(system, key: str, **fields) -> dict:
    response = system.agent.post(
        "/api/approval-requests",
        {"channel": "payments", "action": "refund", "arguments": ARGUMENTS, "idempotency_key": key, **fields},
    )
    assert response.status == 202, response
    return response.body


def approve(system, card_id: int) -> None:
    (card,) = [c for c in system.reviewer.get("/api/approvals").body if c["id"] == card_id]
    response = system.reviewer.post(
        f"/api/approvals/{card_id}/decision", {"decision": "approve", "version": card["version"], "comment": "ok"}
    )
    assert response.status == 200, response


def test_a_long_poll_answers_as_soon_as_a_person_decides_and_holds_no_server_thread(system):
    requests = [ask(system, f"poll-{i}") for i in range(12)]
    answers: dict[str, tuple] = {}

    def poll(request):
        started = time.monotonic()
        response = system.agent.call("GET", f"/api/approval-requests/{request['id']}?wait=30", timeout=60)
        answers[request["id"]] = (response, time.monotonic() - started)

    threads = [threading.Thread(target=poll, args=(r,)) for r in requests]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    # Twelve long-polls are waiting: the server still answers everyone else at once.
    started = time.monotonic()
    assert system.reviewer.get("/api/approvals").status == 200
    listed_in = time.monotonic() - started
    decided_at = time.monotonic()
    approve(system, requests[0]["card_id"])
    threads[0].join(10)
    response, waited = answers[requests[0]["id"]]
    assert response.status == 200 and response.body["status"] == "approved", response
    assert response.body["arguments_digest"] == digest(ARGUMENTS)
    print(f"\nlong-poll: inbox answered in {listed_in * 1000:.0f} ms with 12 polls waiting; decision to answer "
          f"{(time.monotonic() - decided_at) * 1000:.0f} ms")  # fmt: skip
    assert listed_in < 2.0
    assert time.monotonic() - decided_at < 2.0
    for request in requests[1:]:
        approve(system, request["card_id"])
    for thread in threads[1:]:
        thread.join(10)
    assert all(answers[r["id"]][0].body["status"] == "approved" for r in requests)


class _Receiver(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Receiver.received.append((dict(self.headers), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def system_env() -> dict:
    # The test's callback receiver listens on 127.0.0.1: the operator names the host to let callbacks reach it.
    return {"CALLBACK_ALLOWED_HOSTS": "127.0.0.1"}


def test_the_decision_is_posted_to_the_callback_signed_over_its_id_timestamp_and_body(system):
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    serve_in_thread(server)
    _Receiver.received = []
    try:
        request = ask(system, "callback", callback_url=f"http://127.0.0.1:{server.server_port}/decisions")
        approve(system, request["card_id"])
        wait_with_logs(lambda: _Receiver.received, "the callback", system.workers.all, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    headers, body = _Receiver.received[0]
    headers = {k.lower(): v for k, v in headers.items()}
    # Signed with the secret of the agent's own token (a whsec_ secret, as Standard Webhooks writes it), and
    # with no other: another token's secret (the reviewer's) does not verify it.
    verified = Webhook(ApiToken.objects.get(user__username="agent").callback_secret).verify(body, headers)
    assert verified["id"] == request["id"] and verified["status"] == "approved"
    assert verified["arguments_digest"] == digest(ARGUMENTS)
    with pytest.raises(WebhookVerificationError):
        Webhook(ApiToken.objects.get(user__username="reviewer").callback_secret).verify(body, headers)


def test_a_callback_aimed_at_the_console_or_its_machine_is_refused(system):
    port = urllib.parse.urlsplit(system.url).port
    inward = [
        f"http://localhost:{port}/api/runs",
        f"http://127.0.0.1:{port}/api/runs",  # allowed host (CALLBACK_ALLOWED_HOSTS) but the console's port
        "http://127.0.0.2/hook",
        "http://[::1]/hook",
        "http://2130706433/hook",
        "http://localhost./hook",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.1.2.3/hook",
        "http://127.0.0.1:notaport/hook",
    ]
    for number, url in enumerate(inward):
        response = system.agent.post(
            "/api/approval-requests",
            {"channel": "payments", "action": "refund", "arguments": ARGUMENTS, "idempotency_key": f"in-{number}",
             "callback_url": url},
        )  # fmt: skip
        assert response.status == 422, (url, response)
        assert response.body["detail"][0]["loc"] == "callback_url", (url, response)
    assert not ActionRequest.objects.exists()


def test_a_request_nobody_decides_expires_through_its_own_timer_and_cannot_run(system):
    request = ask(system, "expiring", expires_in=60)
    # Its deadline comes now: the card's timer job (and its deadline) moved to this moment.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE approvals_approval SET due_at = now() WHERE id = %s", [request["card_id"]])
        cursor.execute(
            "UPDATE procrastinate_jobs SET scheduled_at = now() WHERE queueing_lock = %s",
            [f"card-due:{request['card_id']}"],
        )

    def expired():
        return system.agent.get(f"/api/approval-requests/{request['id']}").body["status"] == "expired"

    wait_with_logs(expired, "the request to expire", system.workers.all, timeout=30)
    consumed = system.agent.post(
        f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(ARGUMENTS)}
    )
    assert consumed.status == 409 and consumed.body["error"] == "not_approved"
    assert ActionRequest.objects.get(pk=request["id"]).receipt_id is None
