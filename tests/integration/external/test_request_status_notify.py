"""The NOTIFY that wakes an approval request's long-polls (issue 24; migration external 0002, external/waiters.py):
sent with the request's id when its card's status changes, heard only once that transaction commits; nothing when
the status stays as it was."""

from __future__ import annotations

import json

import psycopg
import pytest
from django.db import connection, transaction
from django.utils.timezone import now

from approvals.models import Approval
from core.models import ApiToken
from external.waiters import CHANNEL


@pytest.fixture
def listening(transactional_db):
    entry = connection.settings_dict
    conn = psycopg.connect(
        dbname=entry["NAME"],
        user=entry["USER"],
        password=entry["PASSWORD"] or None,
        host=entry["HOST"] or None,
        port=entry["PORT"] or None,
        autocommit=True,
    )
    conn.execute(f"LISTEN {CHANNEL}")
    yield conn
    conn.close()


def heard(conn, seconds: float = 0.5) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=seconds)]


def ask(client, user, key: str) -> dict:
    _, raw = ApiToken.issue(user)
    body = {"channel": "payments", "action": "refund", "arguments": {"order_id": key}, "idempotency_key": key}
    response = client.post(
        "/api/approval-requests", json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw}"
    )
    assert response.status_code == 202, response.content
    return response.json()


def test_a_card_status_change_announces_its_request_when_it_commits(client, demo, listening):
    request = ask(client, demo["agent"], "notify-1")
    assert heard(listening) == []  # opening the card is not a change of status

    with transaction.atomic():
        Approval.objects.filter(pk=request["card_id"]).update(status=Approval.Status.ESCALATED)
        assert heard(listening, 0.2) == []  # not before the commit
    assert heard(listening) == [request["id"]]

    Approval.objects.filter(pk=request["card_id"]).update(status=Approval.Status.ESCALATED, version=2)
    assert heard(listening) == []  # the same status: nothing changed for a waiting agent

    with transaction.atomic():
        Approval.objects.filter(pk=request["card_id"]).update(status=Approval.Status.CANCELLED, decided_at=now())
        transaction.set_rollback(True)
    assert heard(listening) == []  # rolled back: nothing to announce
