"""`GET /api/approval-requests/{id}?wait=N` where no server edge holds the long-poll (Django's test client here; a
plain WSGI server or runserver alike): the view waits itself, so a client's wait loop never turns into a busy one.
A pass from the production server's edge (console/long_poll.py, which marks it) is answered at once."""

from __future__ import annotations

import json
import time

from core.models import ApiToken
from external.waiters import EDGE_HEADER


def ask(client, user) -> tuple[dict, dict]:
    _, raw = ApiToken.issue(user)
    auth = {"Authorization": f"Bearer {raw}"}
    body = {"channel": "payments", "action": "refund", "arguments": {"order_id": "o1"}, "idempotency_key": "k1"}
    response = client.post("/api/approval-requests", json.dumps(body), content_type="application/json", headers=auth)
    assert response.status_code == 202, response.content
    return response.json(), auth


def timed_get(client, path: str, headers: dict) -> tuple[dict, float]:
    started = time.monotonic()
    response = client.get(path, headers=headers)
    assert response.status_code == 200, response.content
    return response.json(), time.monotonic() - started


def test_without_the_edge_the_view_waits_itself_and_a_pass_of_the_edge_is_answered_at_once(client, demo):
    request, auth = ask(client, demo["agent"])
    path = f"/api/approval-requests/{request['id']}?wait=2"

    answer, took = timed_get(client, path, auth)
    assert answer["status"] == "pending" and 1.9 <= took < 5

    answer, took = timed_get(client, path, {**auth, EDGE_HEADER: "1"})
    assert answer["status"] == "pending" and took < 1
