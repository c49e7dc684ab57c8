"""The web server's database connection pool (DATABASE_POOL, console/settings.py): on by default for `python -m
console.webserver`, off for everything else and never for a worker, exclusive with kept connections. That the
production server really keeps its connections in it: tests/system/test_db_pool_server.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from django.conf import settings

from console import webserver

SHOW = (
    "import json, django; django.setup(); from django.conf import settings as s; "
    "d = s.DATABASES['default']; f = lambda v: f'{v.__module__}.{v.__qualname__}'; "
    "print(json.dumps([d.get('OPTIONS', {}).get('pool'), d['CONN_MAX_AGE']], default=f))"
)


def _settings(env: dict, *argv: str, show: str = SHOW) -> subprocess.CompletedProcess:
    """The settings of a `manage.py <argv>` process with `env`: `show` prints what a test reads of them."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_POOL", "DATABASE_CONN_MAX_AGE"))}
    code = f"import sys; sys.argv = ['manage.py', *{list(argv)!r}]; {show}"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=settings.BASE_DIR,
        env={**clean, "DJANGO_SETTINGS_MODULE": "console.settings", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _pool(env: dict, *argv: str):
    done = _settings(env, *argv)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_off_unless_asked():
    assert _pool({}, "shell") == [None, 0]


def test_on_with_sane_defaults():
    pool, max_age = _pool({"DATABASE_POOL": "1"}, "shell")
    assert max_age == 0
    # One connection per thread of the server's WSGI side (WEB_THREADS, default 8); checked without a round trip.
    check = "console.db_pool.check_connection"
    assert pool == {"min_size": 2, "max_size": 8, "timeout": 2.0, "check": check}
    assert _pool({"DATABASE_POOL": "1", "DATABASE_POOL_MAX_SIZE": "3"}, "shell")[0]["max_size"] == 3


@pytest.mark.parametrize("argv", [("worker",), ("procrastinate", "worker")])
def test_a_worker_never_takes_it(argv):
    # A job's thread holds a session-level advisory lock on its connection (runs.ownership): a pool would keep
    # a lock that a failed unlock left behind alive in a connection handed to the next request.
    assert _pool({"DATABASE_POOL": "1"}, *argv) == [None, 300]


@pytest.mark.parametrize("argv", [("worker",), ("procrastinate", "worker")])
def test_a_worker_keeps_its_connections_by_default(argv):
    # A resumed run should not wait for a new PostgreSQL backend (bench/resume_latency.py).
    assert _pool({}, *argv) == [None, 300]
    assert _pool({"DATABASE_CONN_MAX_AGE": "0"}, *argv) == [None, 0]


def test_refused_together_with_kept_connections():
    done = _settings({"DATABASE_POOL": "1", "DATABASE_CONN_MAX_AGE": "300"}, "shell")
    assert done.returncode != 0
    assert "DATABASE_POOL=1 needs DATABASE_CONN_MAX_AGE=0" in done.stderr


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "1"),
        ({"DATABASE_CONN_MAX_AGE": "0"}, "1"),
        ({"DATABASE_POOL": "0"}, "0"),  # an explicit choice stands
        ({"DATABASE_CONN_MAX_AGE": "300"}, None),  # kept connections asked for: no pool
    ],
)
def test_the_web_server_turns_it_on_by_default(monkeypatch, env, expected):
    monkeypatch.delenv("DATABASE_POOL", raising=False)
    monkeypatch.delenv("DATABASE_CONN_MAX_AGE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    webserver.use_pool_by_default()
    assert os.environ.get("DATABASE_POOL") == expected
