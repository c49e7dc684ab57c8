"""The embedded PostgreSQL starts with its owner and stops when the last process using it is gone, however
that process ends: a normal exit, SIGTERM, or SIGKILL (then the guard process stops it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from django.conf import settings

from console import embedded_db

HOLDER = """
import sys, time
from pathlib import Path
from console import embedded_db
print(embedded_db.start(Path(sys.argv[1])), flush=True)
if sys.argv[2] == "hold":
    time.sleep(600)
"""


def _start_holder(pgdata: Path, mode: str = "hold") -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(pgdata), mode],
        cwd=settings.BASE_DIR,
        stdout=subprocess.PIPE,
        text=True,
        # As a terminal would start it: a suite run under nohup would otherwise hand it an ignored SIGHUP.
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    url = proc.stdout.readline().strip()
    proc.stdout.close()  # the holder prints nothing more
    assert url.startswith("postgresql://"), f"the holder printed {url!r}"
    return proc, url


def _wait_until_stopped(pgdata: Path, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while embedded_db.postgres_pids(pgdata):
        assert time.monotonic() < deadline, f"postgres still running: {embedded_db.postgres_pids(pgdata)}"
        time.sleep(0.2)


@pytest.fixture
def pgdata(tmp_path):
    path = tmp_path / "pgdata"
    yield path
    for pid in embedded_db.postgres_pids(path):  # never leave a server behind, even when a test fails
        os.kill(pid, signal.SIGKILL)


def test_it_starts_and_stops_with_its_owner(pgdata):
    proc, url = _start_holder(pgdata, mode="exit")
    assert proc.wait(30) == 0
    _wait_until_stopped(pgdata, timeout=2)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_it_stops_when_its_owner_is_killed(pgdata, signum):
    proc, url = _start_holder(pgdata)
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert embedded_db.postgres_pids(pgdata)
    proc.send_signal(signum)
    proc.wait(30)
    _wait_until_stopped(pgdata)
    # The guard notices within a poll that nobody holds the server any more, and exits.
    deadline = time.monotonic() + 10 * embedded_db.GUARD_POLL_SECONDS
    while embedded_db._guard_alive(pgdata):
        assert time.monotonic() < deadline, "the guard outlived the server"
        time.sleep(0.1)


def test_it_keeps_running_while_another_process_holds_it(pgdata):
    first, url = _start_holder(pgdata)
    second, second_url = _start_holder(pgdata)
    assert second_url == url
    first.kill()
    first.wait(30)
    time.sleep(2 * embedded_db.GUARD_POLL_SECONDS + 0.5)
    with psycopg.connect(url) as conn:  # still serving the second holder
        assert conn.execute("SELECT 1").fetchone() == (1,)
    second.terminate()
    second.wait(30)
    _wait_until_stopped(pgdata)


def test_a_second_start_reuses_the_data(pgdata):
    proc, url = _start_holder(pgdata)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (note text)")
        conn.execute("INSERT INTO kept VALUES ('still here')")
    proc.terminate()
    proc.wait(30)
    _wait_until_stopped(pgdata)

    proc, url = _start_holder(pgdata)
    try:
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT note FROM kept").fetchall() == [("still here",)]
    finally:
        proc.terminate()
        proc.wait(30)
    _wait_until_stopped(pgdata)
