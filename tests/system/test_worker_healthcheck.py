"""A worker container's health command against a real worker: `manage.py worker` with WORKER_HEARTBEAT_FILE writes
its heartbeat file once registered and at every turn of its heartbeat loop, `python -m jobs.healthcheck` says it
is alive, and after SIGTERM the worker removes the file on its way out, so the command says it has stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from django.conf import settings

from tests.worker import wait_with_logs, worker_logs

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
    # The loop turns: the beat moves on, and the database's answer with it.
    turned = wait_with_logs(lambda: (read(path) or first)["beat"] >= first["beat"] + INTERVAL, "a later beat", [worker])
    assert turned
    later = read(path)
    assert later["worker_id"] == first["worker_id"] and later["database_ok"] > first["database_ok"], later

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
