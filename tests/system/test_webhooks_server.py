"""Signed webhooks on the production server: the same delivery sent three times at once makes one run."""

from __future__ import annotations

import http.client
import json
import threading

from django.conf import settings as django_settings
from django.core.management import call_command

from demo import sandbox
from runs.models import Run, WebhookDelivery
from tests.engine_helpers import SMALL_REFUND, drive, queued_jobs
from tests.unit.test_webhook_signing import signed


def _post_raw(port: int, data: bytes, headers: dict, path: str = "/api/webhooks/demo") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=data, headers={**headers, "Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_the_same_delivery_three_times_at_once_on_the_production_server_makes_one_run(console_server):
    call_command("demo_setup", verbosity=0)
    data = json.dumps(SMALL_REFUND).encode()
    answers: list[tuple[int, dict]] = []
    # Several rounds, each delivery id sent by three threads released together (WEB_CONCURRENCY processes
    # take them, so the copies do race for the unique index).
    for round_ in range(5):
        headers = signed(data, delivery_id=f"dlv-server-{round_}")
        start = threading.Barrier(3)
        round_answers: list[tuple[int, dict]] = []

        def post(headers=headers, start=start, round_answers=round_answers) -> None:
            start.wait()
            round_answers.append(_post_raw(console_server.port, data, headers))

        threads = [threading.Thread(target=post) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(status for status, _ in round_answers) == [200, 200, 202], round_answers
        assert len({answer["id"] for _, answer in round_answers}) == 1
        answers += round_answers

    runs = list(Run.objects.all())
    assert len(runs) == 5
    assert {answer["id"] for _, answer in answers} == {str(run.id) for run in runs}
    assert WebhookDelivery.objects.filter(status="accepted").count() == 5
    for run in runs:
        assert queued_jobs(run) == 1
        assert drive(run).status == Run.Status.SUCCEEDED
    assert sandbox.stats()["channels"]["payments"] == 5
    assert sandbox.stats()["duplicates"] == 0

    # The body limit applies on the production server too (console.body_limit): 413, nothing recorded.
    big = json.dumps({**SMALL_REFUND, "reason": "x" * django_settings.API_MAX_BODY_BYTES}).encode()
    status, answer = _post_raw(console_server.port, big, signed(big, delivery_id="dlv-big"))
    assert (status, answer["error"]) == (413, "too_large")
    assert not WebhookDelivery.objects.filter(delivery_id="dlv-big").exists()
