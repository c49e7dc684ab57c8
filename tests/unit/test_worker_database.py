"""Where a worker's database connections go, how many there are and what they are called (console/settings.py,
jobs/sessions.py; docs/deploy.md, "Connections and PgBouncer"). The probe that refuses a transaction pool, and the
count measured at the server: tests/system/test_pgbouncer.py."""

from __future__ import annotations

import json

import pytest

from jobs.sessions import application_name, connections_per_worker
from tests.unit.test_db_pool import _settings

SHOW = (
    "import json, django; django.setup(); from django.conf import settings as s; d = s.DATABASES['default']; "
    "print(json.dumps([d['HOST'], d['PORT'], d['NAME'], d['OPTIONS'].get('application_name'), "
    "d['DISABLE_SERVER_SIDE_CURSORS'], s.WORKER_POOL_SIZE, s.WORKER_APPLICATION_NAMES]))"
)
DIRECT = "postgres://postgres@db.internal:5432/console"
POOLED = "postgres://postgres@pgbouncer.internal:6432/console"


def _show(env: dict, *argv: str) -> list:
    done = _settings({"DATABASE_URL": DIRECT, **env}, *argv, show=SHOW)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [("worker",), ("procrastinate", "worker")])
def test_a_worker_uses_worker_database_url(argv):
    host, port, name, *_ = _show({"WORKER_DATABASE_URL": POOLED}, *argv)
    assert (host, port, name) == ("pgbouncer.internal", "6432", "console")


def test_a_worker_falls_back_to_database_url():
    assert _show({}, "worker")[:3] == ["db.internal", "5432", "console"]


@pytest.mark.parametrize("argv", [("shell",), ("migrate",)])
def test_everything_else_uses_database_url(argv):
    assert _show({"WORKER_DATABASE_URL": POOLED}, *argv)[:3] == ["db.internal", "5432", "console"]


def test_a_bad_worker_database_url_is_named():
    done = _settings({"DATABASE_URL": DIRECT, "WORKER_DATABASE_URL": "mysql://x@y/z"}, "worker", show=SHOW)
    assert done.returncode != 0
    assert "WORKER_DATABASE_URL must start with postgres:// or postgresql://" in done.stderr


def test_a_transaction_pool_turns_server_side_cursors_off():
    assert _show({}, "shell")[4] is False
    assert _show({"DATABASE_TRANSACTION_POOL": "1"}, "shell")[4] is True


def test_the_pool_size_is_two_at_least():
    assert _show({}, "worker")[5] == 4
    assert _show({"WORKER_POOL_SIZE": "2"}, "worker")[5] == 2
    done = _settings({"DATABASE_URL": DIRECT, "WORKER_POOL_SIZE": "1"}, "worker", show=SHOW)
    assert done.returncode != 0
    assert "WORKER_POOL_SIZE must be 2 or more, got 1" in done.stderr


def test_a_workers_connections_are_named_by_pid_and_role():
    *_, job_name, _, _, names = _show({}, "worker")
    pid = names["job"].split(":")[1]
    assert names == {"pool": f"worker:{pid}:pool", "listen": f"worker:{pid}:listen", "job": f"worker:{pid}:job"}
    assert job_name == names["job"]  # Django's connection, which each job thread opens
    # A URL that names its connections gives the base name.
    *_, job_name, _, _, names = _show({"DATABASE_URL": DIRECT + "?application_name=billing"}, "worker")
    assert job_name == names["job"] == f"billing:{names['job'].split(':')[1]}:job"
    # Nothing but a worker is renamed.
    assert _show({}, "shell")[3] is None
    assert _show({}, "shell")[6] == {}


def test_the_formula():
    assert connections_per_worker(concurrency=4, pool_size=4) == 9
    assert connections_per_worker(concurrency=1, pool_size=2) == 4
    assert application_name("x" * 80, 123, "listen").endswith(":123:listen")
    assert len(application_name("x" * 80, 123, "listen")) == 63
