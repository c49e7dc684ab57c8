"""The production server really keeps its database connections in the pool (DATABASE_POOL, console/settings.py;
the settings themselves: tests/unit/test_db_pool.py)."""

from __future__ import annotations

import json
import urllib.request

from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection

from core.models import ApiToken
from tests.conftest import ConsoleServer


def test_the_production_server_keeps_its_connections_in_the_pool(_console_env, transactional_db):
    call_command("demo_setup", verbosity=0)
    _, token = ApiToken.issue(User.objects.get(username="agent"))
    env = {k: v for k, v in _console_env.items() if not k.startswith(("DATABASE_POOL", "DATABASE_CONN_MAX_AGE"))}
    url = env["DATABASE_URL"]
    server = ConsoleServer({**env, "DATABASE_URL": url + ("&" if "?" in url else "?") + "application_name=pooltest"})
    try:
        _post_runs(server.url, token)
    finally:
        server.stop()


def _post_runs(url: str, token: str) -> None:
    body = json.dumps(
        {"workflow": "refund", "input": {"customer_id": "c1", "amount_cents": 900, "currency": "EUR", "reason": "x"}}
    ).encode()
    for _ in range(20):
        request = urllib.request.Request(
            url + "/api/runs",
            data=body,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 202
    # Without a pool each request's connection is closed at its end; with one, they stay open, idle, and fewer
    # than the requests (a pool of at most 8 per process).
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pooltest'")
        (kept,) = cursor.fetchone()
    assert 1 <= kept <= 8
