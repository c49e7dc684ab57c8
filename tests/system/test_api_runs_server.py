"""The runs API on the production server (python -m console.webserver): one run for an idempotency key sent eight
times at once, and 413 for a chunked body over the limit."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request
import uuid

from django.contrib.auth.models import User
from django.core.management import call_command

from runs.models import Run
from tests.engine_helpers import REFUND, queued_jobs
from tests.integration.runs.test_api_runs import bearer


def test_it_creates_one_run_when_the_same_key_arrives_concurrently(console_server):
    call_command("demo_setup", verbosity=0)
    headers = {**bearer(User.objects.get(username="agent")), "Content-Type": "application/json"}
    body = json.dumps({"workflow": "refund", "input": REFUND, "idempotency_key": "burst-1"}).encode()
    start = threading.Barrier(8)
    answers: list[tuple[int, dict]] = []

    def post() -> None:
        request = urllib.request.Request(console_server.url + "/api/runs", data=body, headers=headers)
        start.wait()
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answers.append((response.status, json.load(response)))
        except urllib.error.HTTPError as exc:
            answers.append((exc.code, json.load(exc)))

    threads = [threading.Thread(target=post) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert len(answers) == 8
    assert sorted(status for status, _ in answers) == [200] * 7 + [202]
    assert len({answer["id"] for _, answer in answers}) == 1
    run = Run.objects.get()
    assert str(run.id) == answers[0][1]["id"]
    assert queued_jobs(run) == 1


def post_chunked(server, headers: dict, body: bytes) -> tuple[int, dict]:
    """POST without a Content-Length (Transfer-Encoding: chunked), as a streaming client would."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        chunks = (body[i : i + 4096] for i in range(0, len(body), 4096))
        conn.request("POST", "/api/runs", body=chunks, headers=headers, encode_chunked=True)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_it_answers_413_for_a_chunked_body_over_the_limit(console_server):
    call_command("demo_setup", verbosity=0)
    headers = {**bearer(User.objects.get(username="agent")), "Content-Type": "application/json"}
    limit = 64 * 1024  # the server's API_MAX_BODY_BYTES (its default)
    big = json.dumps({"workflow": "refund", "input": {**REFUND, "reason": "x" * limit}}).encode()

    status, answer = post_chunked(console_server, headers, big)

    assert status == 413
    assert answer["error"] == "too_large"
    assert not Run.objects.exists()
    # A small chunked body is still welcome.
    status, answer = post_chunked(console_server, headers, json.dumps({"workflow": "refund", "input": REFUND}).encode())
    assert status == 202
    assert Run.objects.get().id == uuid.UUID(answer["id"])
