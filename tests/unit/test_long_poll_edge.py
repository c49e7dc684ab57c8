"""Which requests the web server's edge holds as long-polls (console/long_poll.py, issue 24), and which responses
end one: anything else goes to Django as it came, and Django's answer is the agent's."""

from __future__ import annotations

import json
import uuid

from console.long_poll import _pending, long_poll

ID = str(uuid.uuid4())


def scope(path: str, query: bytes = b"", method: str = "GET") -> dict:
    return {"type": "http", "method": method, "path": path, "query_string": query}


def test_a_get_of_a_request_with_a_wait_of_a_second_or_more_is_a_long_poll():
    assert long_poll(scope(f"/api/approval-requests/{ID}", b"wait=30")) == (ID, 30)
    assert long_poll(scope(f"/api/approval-requests/{ID}", b"x=1&wait=5&wait=7")) == (ID, 7)  # the last, as Django
    # More than the API allows is a long-poll here: Django refuses it (422) on the first pass, which ends it.
    assert long_poll(scope(f"/api/approval-requests/{ID}", b"wait=999")) == (ID, 999)


def test_anything_else_goes_to_django_as_it_came():
    assert long_poll(scope(f"/api/approval-requests/{ID}")) is None
    assert long_poll(scope(f"/api/approval-requests/{ID}", b"wait=0")) is None
    assert long_poll(scope(f"/api/approval-requests/{ID}", b"wait=-3")) is None
    assert long_poll(scope(f"/api/approval-requests/{ID}", b"wait=soon")) is None
    assert long_poll(scope(f"/api/approval-requests/{ID}", b"wait=5", method="POST")) is None
    assert long_poll(scope(f"/api/approval-requests/{ID}/consume", b"wait=5")) is None
    assert long_poll(scope("/api/approval-requests/not-a-uuid-at-all-not-a-uuid-at-all", b"wait=5")) is None
    assert long_poll({"type": "websocket", "path": f"/api/approval-requests/{ID}"}) is None


def response(status: int, body) -> list[dict]:
    return [
        {"type": "http.response.start", "status": status, "headers": []},
        {"type": "http.response.body", "body": json.dumps(body).encode(), "more_body": False},
    ]


def test_only_a_200_whose_request_is_pending_keeps_the_agent_waiting():
    assert _pending(response(200, {"status": "pending", "expires_at": "2026-12-04T10:00:00Z"}))["status"] == "pending"
    assert _pending(response(200, {"status": "approved"})) is None
    assert _pending(response(401, {"error": "unauthorized"})) is None
    assert _pending(response(503, {"error": "database_unavailable", "status": "pending"})) is None
    assert _pending([{"type": "http.response.start", "status": 200, "headers": []}, {"body": b"not json"}]) is None
