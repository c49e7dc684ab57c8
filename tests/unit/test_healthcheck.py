"""`python -m jobs.healthcheck`, the worker container's health command, as the orchestrator runs it: a process of
its own, reading WORKER_HEARTBEAT_FILE from its environment (no Django settings, no database), against heartbeat
files written here. The worker's side (that a real worker writes and removes the file) is in
tests/system/test_worker_healthcheck.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.healthcheck import HeartbeatFile, check

ROOT = Path(__file__).resolve().parents[2]


def healthcheck(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("WORKER_HEARTBEAT_FILE", "READY_HEARTBEAT_MAX_AGE")}
    # No DJANGO_SETTINGS_MODULE: the command must not need one.
    base.pop("DJANGO_SETTINGS_MODULE", None)
    return subprocess.run(
        [sys.executable, "-m", "jobs.healthcheck", *args],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def write(path: Path, *, beat_age: float, database_age: float | None = 0.0, now: float | None = None) -> float:
    now = time.time() if now is None else now
    database_ok = None if database_age is None else now - database_age
    path.write_text(json.dumps({"pid": 7, "worker_id": 42, "beat": now - beat_age, "database_ok": database_ok}))
    return now


# The ages a message gives are checked against a fixed `now` (check()); the command, a process of its own, starts
# when the machine lets it (a second later on a loaded one), so through it only its verdict and its words are.


def test_fresh_heartbeat_is_healthy(tmp_path):
    path = tmp_path / "beat"
    now = write(path, beat_age=3, database_age=5)
    assert check(str(path), 60, now=now) == (True, "worker 42 (pid 7): heartbeat 3 s ago; database answered 5 s ago")
    result = healthcheck(env={"WORKER_HEARTBEAT_FILE": str(path)})
    assert result.returncode == 0, result
    assert re.fullmatch(r"worker 42 \(pid 7\): heartbeat \d+ s ago; database answered \d+ s ago\n", result.stdout)


def test_fresh_heartbeat_during_an_outage_is_healthy(tmp_path):
    # The database has not answered for 10 minutes, but the worker's loop turns: it is waiting the outage out.
    path = tmp_path / "beat"
    now = write(path, beat_age=1, database_age=600)
    assert check(str(path), 60, now=now) == (True, "worker 42 (pid 7): heartbeat 1 s ago; database answered 600 s ago")
    result = healthcheck(env={"WORKER_HEARTBEAT_FILE": str(path)})
    assert result.returncode == 0, result
    assert re.search(r"database answered 6\d\d s ago", result.stdout), result


def test_stale_heartbeat_is_unhealthy(tmp_path):
    path = tmp_path / "beat"
    now = write(path, beat_age=95)
    assert check(str(path), 60, now=now) == (False, "last heartbeat 95 s ago, more than 60 (worker 42)")
    result = healthcheck(env={"WORKER_HEARTBEAT_FILE": str(path)})
    assert result.returncode == 1, result
    assert re.search(r"last heartbeat \d+ s ago, more than 60 \(worker 42\)", result.stderr), result


def test_max_age_from_the_environment_and_the_option(tmp_path):
    path = tmp_path / "beat"
    write(path, beat_age=20)
    env = {"WORKER_HEARTBEAT_FILE": str(path)}
    assert healthcheck(env=env).returncode == 0
    stale = healthcheck(env={**env, "READY_HEARTBEAT_MAX_AGE": "10"})
    assert stale.returncode == 1 and "more than 10" in stale.stderr, stale
    # The option wins over the variable.
    assert healthcheck("--max-age", "30", env={**env, "READY_HEARTBEAT_MAX_AGE": "10"}).returncode == 0


def test_missing_file_is_unhealthy(tmp_path):
    path = tmp_path / "beat"
    result = healthcheck(env={"WORKER_HEARTBEAT_FILE": str(path)})
    assert result.returncode == 1, result
    assert f"no heartbeat file at {path}" in result.stderr


def test_unset_variable_is_unhealthy():
    for env in ({}, {"WORKER_HEARTBEAT_FILE": ""}):
        result = healthcheck(env=env)
        assert result.returncode == 1, result
        assert "WORKER_HEARTBEAT_FILE is not set" in result.stderr


@pytest.mark.parametrize("content", ["", "not json", "[1, 2]", '{"pid": 7}', '{"beat": "soon"}'])
def test_garbage_is_unhealthy(tmp_path, content):
    path = tmp_path / "beat"
    path.write_text(content)
    result = healthcheck(env={"WORKER_HEARTBEAT_FILE": str(path)})
    assert result.returncode == 1, result
    assert "is not a heartbeat" in result.stderr


class _Log:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, message: str, **fields: object) -> None:
        self.warnings.append(message)


def test_heartbeat_file_writes_atomically_and_keeps_the_last_database_answer(tmp_path):
    path = tmp_path / "beat"
    beats = HeartbeatFile(str(path), _Log())
    beats.beat(5, database_ok=True)
    first = json.loads(path.read_text())
    assert first["worker_id"] == 5 and first["pid"] == os.getpid() and first["database_ok"] == first["beat"]
    beats.beat(5, database_ok=False)  # the database did not answer: the beat moves, the answer's time stays
    second = json.loads(path.read_text())
    assert second["beat"] >= first["beat"] and second["database_ok"] == first["database_ok"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["beat"]  # no temporary file left behind
    beats.remove()
    assert not path.exists()
    beats.remove()  # already gone: nothing to say


def test_heartbeat_file_failures_are_logged_once_and_never_raise(tmp_path):
    log = _Log()
    beats = HeartbeatFile(str(tmp_path / "no such directory" / "beat"), log)
    for _ in range(3):
        beats.beat(5, database_ok=True)
    assert log.warnings == ["could not write the heartbeat file"]
