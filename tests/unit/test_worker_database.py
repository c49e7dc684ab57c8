"""Where a worker's database connections go, how many there are and what they are called (console/settings.py,
jobs/sessions.py; docs/deploy.md, "Connections and PgBouncer"). The probe that refuses a transaction pool, and the
count measured at the server: tests/system/test_pgbouncer.py."""

from __future__ import annotations

import os

import pytest
from django.core.exceptions import ImproperlyConfigured

from jobs.sessions import application_name, connections_per_worker
from tests.settings_of import settings_of

DIRECT = "postgres://postgres@db.internal:5432/console"
POOLED = "postgres://postgres@pgbouncer.internal:6432/console"
OURS = ("WORKER_DATABASE_URL", "WORKER_POOL_SIZE", "DATABASE_TRANSACTION_POOL", "DATABASE_POOL", "DATABASE_CONN")


def _settings(monkeypatch, env: dict, *argv: str) -> dict:
    return settings_of(monkeypatch, {"DATABASE_URL": DIRECT, **env}, *argv, without=OURS)


def _where(monkeypatch, env: dict, *argv: str) -> tuple:
    database = _settings(monkeypatch, env, *argv)["DATABASES"]["default"]
    return database["HOST"], database["PORT"], database["NAME"]


@pytest.mark.parametrize("argv", [("worker",), ("procrastinate", "worker")])
def test_a_worker_uses_worker_database_url(monkeypatch, argv):
    assert _where(monkeypatch, {"WORKER_DATABASE_URL": POOLED}, *argv) == ("pgbouncer.internal", "6432", "console")


def test_a_worker_falls_back_to_database_url(monkeypatch):
    assert _where(monkeypatch, {}, "worker") == ("db.internal", "5432", "console")


@pytest.mark.parametrize("argv", [("shell",), ("migrate",)])
def test_everything_else_uses_database_url(monkeypatch, argv):
    assert _where(monkeypatch, {"WORKER_DATABASE_URL": POOLED}, *argv) == ("db.internal", "5432", "console")


def test_a_bad_worker_database_url_is_named(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="WORKER_DATABASE_URL must start with postgres:// or postgresql://"):
        _settings(monkeypatch, {"WORKER_DATABASE_URL": "mysql://x@y/z"}, "worker")


def test_a_transaction_pool_turns_server_side_cursors_off(monkeypatch):
    assert _settings(monkeypatch, {}, "shell")["DATABASES"]["default"]["DISABLE_SERVER_SIDE_CURSORS"] is False
    pooled = _settings(monkeypatch, {"DATABASE_TRANSACTION_POOL": "1"}, "shell")
    assert pooled["DATABASES"]["default"]["DISABLE_SERVER_SIDE_CURSORS"] is True


def test_the_pool_size_is_two_at_least(monkeypatch):
    assert _settings(monkeypatch, {}, "worker")["WORKER_POOL_SIZE"] == 4
    assert _settings(monkeypatch, {"WORKER_POOL_SIZE": "2"}, "worker")["WORKER_POOL_SIZE"] == 2
    with pytest.raises(ImproperlyConfigured, match="WORKER_POOL_SIZE must be 2 or more, got 1"):
        _settings(monkeypatch, {"WORKER_POOL_SIZE": "1"}, "worker")


def test_a_workers_connections_are_named_by_pid_and_role(monkeypatch):
    worker = _settings(monkeypatch, {}, "worker")
    names, pid = worker["WORKER_APPLICATION_NAMES"], os.getpid()
    assert names == {"pool": f"worker:{pid}:pool", "listen": f"worker:{pid}:listen", "job": f"worker:{pid}:job"}
    # Django's connection, which each job thread opens
    assert worker["DATABASES"]["default"]["OPTIONS"]["application_name"] == names["job"]
    # A URL that names its connections gives the base name.
    billing = _settings(monkeypatch, {"DATABASE_URL": DIRECT + "?application_name=billing"}, "worker")
    assert billing["DATABASES"]["default"]["OPTIONS"]["application_name"] == f"billing:{pid}:job"
    assert billing["WORKER_APPLICATION_NAMES"]["job"] == f"billing:{pid}:job"
    # Nothing but a worker is renamed.
    shell = _settings(monkeypatch, {}, "shell")
    assert "application_name" not in shell["DATABASES"]["default"]["OPTIONS"]
    assert shell["WORKER_APPLICATION_NAMES"] == {}


def test_the_formula():
    assert connections_per_worker(concurrency=4, pool_size=4) == 9
    assert connections_per_worker(concurrency=1, pool_size=2) == 4
    assert application_name("x" * 80, 123, "listen").endswith(":123:listen")
    assert len(application_name("x" * 80, 123, "listen")) == 63
