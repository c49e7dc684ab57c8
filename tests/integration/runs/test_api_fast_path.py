"""The API's short path (issue 21): an API call with a bearer token skips the browser's middleware (session, CSRF,
login, messages, htmx, framing and CSP headers: console.middleware.browser_only), and is still authenticated by
its token; a request without one keeps all of it, CSRF included. The run's INSERT, compiled once per process
(runs.submission.run_insert), is the compiler's own. The pool's check without a round trip: console.db_pool."""

from __future__ import annotations

import datetime
import time
import uuid

import psycopg
import pytest
from django.conf import settings
from django.db import connection
from django.db.models.sql import InsertQuery
from django.test import Client
from django.utils import timezone
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from console import db_pool
from core.models import ApiToken
from runs import submission
from runs.models import Run
from tests.engine_helpers import REFUND


@pytest.fixture
def token(demo):
    return ApiToken.issue(demo["agent"])[1]


def start_run(client: Client, headers: dict, key: str = "fast-1"):
    return client.post(
        "/api/runs",
        {"workflow": "refund", "input": REFUND, "idempotency_key": key},
        content_type="application/json",
        headers=headers,
    )


def test_a_token_request_skips_the_browser_middleware_and_is_still_authenticated(demo, token):
    response = start_run(Client(enforce_csrf_checks=True), {"Authorization": f"Bearer {token}"})
    assert response.status_code == 202, response.content
    run = Run.objects.get(id=response.json()["id"])
    assert run.created_by == demo["agent"]
    # The skipped middleware's marks are absent: no session cookie, no framing or CSP header.
    assert "Set-Cookie" not in response.headers and not response.cookies
    assert "X-Frame-Options" not in response.headers and "Content-Security-Policy" not in response.headers
    # The middleware that stays: the request id, the security headers.
    assert response.headers["X-Request-ID"] and response.headers["X-Content-Type-Options"] == "nosniff"


def test_the_scheme_is_case_insensitive_as_ninja_reads_it(demo, token):
    assert start_run(Client(), {"Authorization": f"bearer {token}"}).status_code == 202


def test_a_wrong_token_is_still_refused(demo):
    response = start_run(Client(), {"Authorization": "Bearer hitl_not-a-token"})
    assert response.status_code == 401 and response.json()["error"] == "unauthorized"
    assert not Run.objects.exists()


def test_a_session_does_not_authenticate_an_api_call(demo):
    client = Client(enforce_csrf_checks=True)
    client.force_login(demo["agent"])
    assert start_run(client, {}).status_code == 401
    # Nor with a bearer header that names no token: the session is not looked at.
    assert start_run(client, {"Authorization": "Bearer nope"}).status_code == 401
    assert not Run.objects.exists()


def test_a_session_request_still_gets_its_csrf_check(demo, alice):
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    form = {"engaged": "on", "reason": "stop everything"}
    assert client.post("/channels/kill-switch/", form).status_code == 403
    # A bearer header does not exempt a page: only /api/ calls skip the check.
    response = client.post("/channels/kill-switch/", form, headers={"Authorization": "Bearer x"})
    assert response.status_code == 403
    # The pages keep the rest too: the session is read, framing is refused.
    page = client.get("/runs/")
    assert page.status_code == 200 and page.headers["X-Frame-Options"] == "DENY"


def test_the_run_insert_compiled_once_is_the_compilers_own(db, demo, monkeypatch):
    moment = datetime.datetime(2026, 12, 2, 9, 0, tzinfo=datetime.UTC)
    monkeypatch.setattr(timezone, "now", lambda: moment)

    def new_run():
        return Run(
            id=uuid.UUID(int=7),
            workflow="refund",
            workflow_version=1,
            input=REFUND,
            tenant="default",
            idempotency_key="k",
            trace_id="0" * 32,  # its default is random
            created_by=demo["agent"],
            max_attempts=settings.RUN_MAX_ATTEMPTS,
        )

    fields = [f for f in Run._meta.local_concrete_fields if not f.generated]
    query = InsertQuery(Run)
    query.insert_values(fields, [new_run()])
    ((compiled_sql, compiled_params),) = query.get_compiler(connection=connection).as_sql()
    submission._INSERT_SQL.clear()
    first = submission.run_insert(new_run())  # compiles, and keeps the SQL
    assert (connection.alias, Run) in submission._INSERT_SQL
    run = new_run()
    again = submission.run_insert(run)  # from the kept SQL
    assert first[0] == again[0] == compiled_sql
    assert plain(first[1]) == plain(again[1]) == plain(compiled_params)
    assert run.created_at == run.updated_at == moment  # pre_save ran, as the compiler runs it


def plain(params) -> list:
    return [p.obj if isinstance(p, Jsonb) else p for p in params]  # psycopg's Jsonb compares by identity


def test_runs_submitted_through_the_kept_sql_are_whole(demo, token):
    client = Client()
    ids = [start_run(client, {"Authorization": f"Bearer {token}"}, key=f"whole-{i}").json()["id"] for i in range(3)]
    for run in Run.objects.filter(id__in=ids):
        assert run.input == REFUND and run.created_by == demo["agent"] and run.created_at and run.updated_at


# --- the pool's check (console.db_pool) ------------------------------------------------------------------------


def _connect() -> psycopg.Connection:
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**params, autocommit=True)


def _last_query(admin, conn) -> str:
    return admin.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", [conn.info.backend_pid]).fetchone()[0]


def test_a_live_idle_connection_passes_without_a_round_trip(db):
    conn, admin = _connect(), _connect()
    try:
        conn.execute("SELECT 'the last statement'")
        db_pool.check_connection(conn)  # no exception, and nothing sent: the socket had nothing to read
        assert _last_query(admin, conn) == "SELECT 'the last statement'"
        ConnectionPool.check_connection(conn)  # psycopg_pool's own check sends an empty query
        assert _last_query(admin, conn) == ""
    finally:
        conn.close()
        admin.close()


def test_a_connection_the_server_ended_is_refused(db):
    conn, admin = _connect(), _connect()
    try:
        pid = conn.info.backend_pid
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        for _ in range(50):  # the server's goodbye reaches the socket
            if db_pool._readable(conn.fileno()):
                break
            time.sleep(0.02)
        with pytest.raises(psycopg.OperationalError):
            db_pool.check_connection(conn)
    finally:
        conn.close()
        admin.close()


def test_a_closed_connection_is_refused(db):
    conn = _connect()
    conn.close()
    with pytest.raises(psycopg.OperationalError):
        db_pool.check_connection(conn)
