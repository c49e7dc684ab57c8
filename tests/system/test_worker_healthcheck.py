"""A worker container's health command against a real worker: `manage.py worker` with WORKER_HEARTBEAT_FILE writes
its heartbeat file once registered and at every turn of its heartbeat loop, `python -m jobs.healthcheck` says it
is alive, and after SIGTERM the worker removes the file on its way out, so the command says it has stopped. A
worker waiting out a database outage (on a PostgreSQL server of the test's own, stopped under it) keeps beating:
its orchestrator must not restart it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

from tests.worker import FAST_WORKER_ENV, PrivatePostgres, Worker, wait_with_logs, worker_logs

INTERVAL = 1.0


def healthcheck(path: Path, max_age: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WORKER_HEARTBEAT_FILE": str(path)}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the command does not need Django
    return subprocess.run(
        [sys.executable, "-m", "jobs.healthcheck", "--max-age", str(max_age)],
        cwd=settings.BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def test_a_worker_writes_its_heartbeat_file_and_removes_it_when_it_stops(start_worker, tmp_path):
    path = tmp_path / "run" / "worker-heartbeat"
    path.parent.mkdir()
    worker = start_worker(WORKER_HEARTBEAT_FILE=path, WORKER_HEARTBEAT_INTERVAL=INTERVAL)

    first = wait_with_logs(lambda: read(path), "the heartbeat file", [worker])
    assert first["pid"] == worker.pid, first
    assert isinstance(first["worker_id"], int), first
    # Registering was the database's first answer.
    assert first["database_ok"] is not None, first

    # The loop turns: the beat moves on, and the database's answer with it. Both are waited for: a beat may be
    # written before that turn's answer is in (CI, 2026-12-06: the beat one interval on, the answer the first's).
    def moved_on() -> dict | None:
        now = read(path) or first
        return now if now["beat"] >= first["beat"] + INTERVAL and now["database_ok"] > first["database_ok"] else None

    later = wait_with_logs(moved_on, "a later beat with a later answer from the database", [worker])
    assert later["worker_id"] == first["worker_id"], later

    alive = healthcheck(path, max_age=3 * INTERVAL)
    assert alive.returncode == 0, f"{alive}\n{worker_logs([worker])}"
    assert alive.stdout.startswith(f"worker {first['worker_id']} (pid {worker.pid}): heartbeat"), alive

    worker.kill(signal.SIGTERM)
    assert worker.wait(15) == 0, worker_logs([worker])
    assert not path.exists(), worker_logs([worker])
    assert list(path.parent.iterdir()) == []  # nor a temporary file
    stopped = healthcheck(path, max_age=3 * INTERVAL)
    assert stopped.returncode == 1, stopped
    assert "no heartbeat file" in stopped.stderr, stopped


@pytest.fixture
def private_server():
    server = PrivatePostgres("test_worker_healthcheck_pg_")
    try:
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v0"],
            cwd=settings.BASE_DIR,
            env=_private_env(server.url),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        yield server
    finally:
        server.close()


def _private_env(url: str) -> dict:
    env = {**os.environ, **FAST_WORKER_ENV, "DATABASE_URL": url}
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    env.pop("TEST_DATABASE_NAME", None)
    return env


def test_a_worker_waiting_out_an_outage_keeps_beating(private_server, tmp_path):
    path = tmp_path / "worker-heartbeat"
    env = {**_private_env(private_server.url), "WORKER_HEARTBEAT_FILE": str(path)}
    worker = Worker({**env, "WORKER_HEARTBEAT_INTERVAL": str(INTERVAL)}, tmp_path / "worker.log")
    try:
        first = wait_with_logs(lambda: read(path), "the heartbeat file", [worker])
        private_server.stop()
        down_at = time.time()
        # Several turns of the loop with the database gone: the beat moves on, the database's answer does not.
        wait_with_logs(
            lambda: (read(path) or first)["beat"] >= down_at + 4 * INTERVAL, "beats during the outage", [worker]
        )
        during = read(path)
        assert during["database_ok"] < down_at, during
        alive = healthcheck(path, max_age=3 * INTERVAL)
        assert alive.returncode == 0, f"{alive}\n{worker_logs([worker])}"

        private_server.start()
        wait_with_logs(
            lambda: ((read(path) or first)["database_ok"] or 0) > down_at, "the database's answer again", [worker]
        )
        worker.kill(signal.SIGTERM)
        assert worker.wait(15) == 0, worker_logs([worker])
        assert not path.exists(), worker_logs([worker])
    finally:
        worker.stop()
