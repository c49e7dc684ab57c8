"""The web server's database connection pool (DATABASE_POOL, console/settings.py): on by default for `python -m
console.webserver`, off for everything else and never for a worker, exclusive with kept connections. That the
production server really keeps its connections in it: tests/system/test_db_pool_server.py."""

from __future__ import annotations

import os

import pytest
from django.core.exceptions import ImproperlyConfigured

from console import db_pool, webserver
from tests.settings_of import settings_of

# Variables of the machine's environment that would change what these tests read.
OURS = ("DATABASE_POOL", "DATABASE_CONN_MAX_AGE")


def _pool(monkeypatch, env: dict, *argv: str, without: tuple[str, ...] = OURS) -> list:
    """The pool's options and CONN_MAX_AGE of a `manage.py <argv>` process started with `env`."""
    database = settings_of(monkeypatch, env, *argv, without=without)["DATABASES"]["default"]
    return [database.get("OPTIONS", {}).get("pool"), database["CONN_MAX_AGE"]]


@pytest.fixture
def unset(monkeypatch) -> None:
    """Neither variable set, and whatever use_pool_by_default() sets undone after the test."""
    for name in OURS:
        monkeypatch.setenv(name, "")  # recorded, so that the variable is restored (or removed) after the test
        monkeypatch.delenv(name)


def test_off_unless_asked(monkeypatch):
    assert _pool(monkeypatch, {}, "shell") == [None, 0]


def test_on_with_sane_defaults(monkeypatch):
    pool, max_age = _pool(monkeypatch, {"DATABASE_POOL": "1"}, "shell")
    assert max_age == 0
    # One connection per thread of the server's WSGI side (WEB_THREADS, default 8); checked without a round trip.
    assert pool == {"min_size": 2, "max_size": 8, "timeout": 2.0, "check": db_pool.check_connection}
    assert _pool(monkeypatch, {"DATABASE_POOL": "1", "DATABASE_POOL_MAX_SIZE": "3"}, "shell")[0]["max_size"] == 3


@pytest.mark.parametrize("argv", [("worker",), ("procrastinate", "worker")])
def test_a_worker_never_takes_it(monkeypatch, argv):
    # A job's thread holds a session-level advisory lock on its connection (runs.ownership): a pool would keep
    # a lock that a failed unlock left behind alive in a connection handed to the next request.
    assert _pool(monkeypatch, {"DATABASE_POOL": "1"}, *argv) == [None, 300]


@pytest.mark.parametrize("argv", [("worker",), ("procrastinate", "worker")])
def test_a_worker_keeps_its_connections_by_default(monkeypatch, argv):
    # A resumed run should not wait for a new PostgreSQL backend (bench/resume_latency.py).
    assert _pool(monkeypatch, {}, *argv) == [None, 300]
    assert _pool(monkeypatch, {"DATABASE_CONN_MAX_AGE": "0"}, *argv) == [None, 0]


def test_refused_together_with_kept_connections(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="DATABASE_POOL=1 needs DATABASE_CONN_MAX_AGE=0"):
        _pool(monkeypatch, {"DATABASE_POOL": "1", "DATABASE_CONN_MAX_AGE": "300"}, "shell")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "1"),
        ({"DATABASE_CONN_MAX_AGE": "0"}, "1"),
        ({"DATABASE_POOL": "0"}, "0"),  # an explicit choice stands
        ({"DATABASE_CONN_MAX_AGE": "300"}, None),  # kept connections asked for: no pool
    ],
)
def test_the_web_server_turns_it_on_by_default(monkeypatch, unset, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    webserver.use_pool_by_default()
    assert os.environ.get("DATABASE_POOL") == expected


def test_the_web_servers_default_is_what_its_settings_then_take(monkeypatch, unset):
    """`python -m console.webserver` sets DATABASE_POOL before Django reads its settings, which then have the pool."""
    webserver.use_pool_by_default()
    pool, max_age = _pool(monkeypatch, {}, without=())
    assert pool is not None and max_age == 0
