"""Fifty signed webhook deliveries, each sent three times at the same moment to the production server.

The seed's test: "deliver the same webhook 3 times: one side effect". Each delivery makes one run (one 202 and
two 200s naming it, whichever copy wins), and each run pays once and emails once.

Sizes: WEBHOOK_DELIVERIES (50).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from datetime import UTC, datetime

from django.conf import settings
from standardwebhooks import Webhook

from runs.models import Run, WebhookDelivery
from tests.system.conftest import effects_per_run, env_int, jobs_doing, report, sandbox_stats

DELIVERIES = env_int("WEBHOOK_DELIVERIES", 50)
SECRET = "demo-secret"  # WEBHOOK_SECRET_DEMO's development default


def _send(url: str, delivery_id: str, body: bytes) -> tuple[int, dict]:
    # Signed as a provider using the standardwebhooks library would (a plain secret's key is its UTF-8 bytes).
    timestamp = int(time.time())
    signature = Webhook(SECRET.encode()).sign(delivery_id, datetime.fromtimestamp(timestamp, UTC), body.decode())
    request = urllib.request.Request(
        url + "/api/webhooks/demo",
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "webhook-id": delivery_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature,
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_a_delivery_sent_three_times_at_once_makes_one_run_that_pays_once(system):
    answers: dict[str, list[tuple[int, dict]]] = {}
    started = time.monotonic()
    for i in range(DELIVERIES):
        delivery_id = f"evt_{i:04d}"
        body = json.dumps(
            {
                "customer_id": f"cus_{5000 + i}",
                "amount_cents": settings.AUTO_APPROVE_CENTS - 100,  # approved by itself: no card to decide
                "currency": "EUR",
                "reason": "Item arrived damaged",
            }
        ).encode()
        start, got = threading.Barrier(3), []

        def deliver(delivery_id=delivery_id, body=body, start=start, got=got):
            start.wait()
            got.append(_send(system.url, delivery_id, body))

        threads = [threading.Thread(target=deliver) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        answers[delivery_id] = got
    sent_in = time.monotonic() - started

    statuses = Counter(status for got in answers.values() for status, _ in got)
    runs_named = {delivery: {body.get("id") for _, body in got} for delivery, got in answers.items()}
    run_ids = [next(iter(ids)) for ids in runs_named.values()]
    finished = system.wait_for_runs(run_ids, timeout=90)
    payments, emails = effects_per_run(run_ids, "payments"), effects_per_run(run_ids, "email")
    stats = sandbox_stats()
    report(
        "webhooks delivered three times at once",
        deliveries=DELIVERIES,
        answers=dict(statuses),
        runs=Run.objects.count(),
        statuses=dict(finished),
        sandbox=stats,
        sent_in_s=round(sent_in, 2),
    )
    assert all(sorted(status for status, _ in got) == [200, 200, 202] for got in answers.values()), answers
    assert all(len(ids) == 1 for ids in runs_named.values()), runs_named  # all three copies name one run
    assert Run.objects.count() == DELIVERIES == WebhookDelivery.objects.count()
    assert finished == {Run.Status.SUCCEEDED: DELIVERIES}
    assert set(payments.values()) == {1} and set(emails.values()) == {1}
    assert stats["duplicates"] == 0
    assert jobs_doing() == []
