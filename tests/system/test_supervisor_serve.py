"""`manage.py serve` keeps the console up: a worker, web server or embedded PostgreSQL that dies is logged and
started again; only a signal to serve itself stops everything (its backoff: tests/unit/test_supervisor.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from django.conf import settings

from console import embedded_db
from tests.system.test_make_run import _free_port, _get, _wait_for


class Serve:
    def __init__(self, tmp_path: Path):
        self.pgdata = tmp_path / "pgdata"
        self.log_path = tmp_path / "serve.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_ALLOW_ASYNC_UNSAFE")}
        env |= {
            "EMBEDDED_PGDATA": str(self.pgdata),
            "WEB_CONCURRENCY": "2",  # a uvicorn master with worker processes, which must not outlive it
            "READY_HEARTBEAT_MAX_AGE": "30",
            "WORKER_HEARTBEAT_INTERVAL": "1",
            "DEMO_TRAFFIC": "0",
        }
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--port", str(self.port)],
            cwd=settings.BASE_DIR,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[dict]:
        events = []
        for line in self.log().splitlines():
            if line.startswith("{") and '"console.serve"' in line:
                events.append(json.loads(line))
        return events

    def child(self, name: str) -> psutil.Process:
        """The current web or worker child of serve (waits while it is being restarted)."""

        def find():
            for proc in psutil.Process(self.proc.pid).children():
                try:
                    cmdline = proc.cmdline()
                except psutil.NoSuchProcess:
                    continue
                if name == "web" and "console.webserver" in cmdline:
                    return proc
                if name == "worker" and cmdline[1:2] == ["manage.py"] and cmdline[-1] == "worker":
                    return proc
            return None

        return self.wait(find, f"a {name} child")

    def wait(self, predicate, what: str, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            assert self.proc.poll() is None, f"serve exited ({self.proc.returncode}):\n{self.log()[-8000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.log()[-8000:]}"
            time.sleep(0.2)
        return value

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()
        for pid in embedded_db.postgres_pids(self.pgdata):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def served(tmp_path):
    server = Serve(tmp_path)
    yield server
    server.stop()


def _postmaster_pid(pgdata: Path) -> int:
    return int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])


def test_serve_restarts_what_dies_and_stops_on_sigterm(served):
    _wait_for(served.base + "/accounts/login/", 200, timeout=180)
    _wait_for(served.base + "/readyz", 200, timeout=60)

    # A worker killed outright is logged and replaced.
    worker = served.child("worker")
    worker.kill()
    served.wait(lambda: any(e["event"].startswith("the worker process restarted") for e in served.events()), "restart")
    new_worker = served.child("worker")
    assert new_worker.pid != worker.pid
    (exited,) = [e for e in served.events() if e["event"].startswith("the worker process exited")]
    assert exited["pid"] == worker.pid and exited["exit"] == "killed by SIGKILL", exited
    assert exited["restart_in_seconds"] == 1

    # The web server too: its uvicorn workers go with it (they would keep the port), and a new one answers.
    web = served.child("web")
    old_web_processes = [web, *web.children(recursive=True)]
    assert len(old_web_processes) >= 3, old_web_processes  # the master and its two workers
    web.kill()
    served.wait(lambda: any(e["event"].startswith("the web process restarted") for e in served.events()), "restart")
    _, alive = psutil.wait_procs(old_web_processes, timeout=10)
    assert not alive, f"the old web server's processes outlived it: {alive}"
    assert served.child("web").pid != web.pid
    _wait_for(served.base + "/accounts/login/", 200, timeout=60)

    # The embedded PostgreSQL: reported, started again, and the console is ready again.
    os.kill(_postmaster_pid(served.pgdata), signal.SIGKILL)
    served.wait(
        lambda: any(e["event"] == "the embedded PostgreSQL is running again" for e in served.events()),
        "the database to be restarted",
    )
    assert any(e["event"].startswith("the embedded PostgreSQL is not running") for e in served.events())
    _wait_for(served.base + "/readyz", 200, timeout=60)

    # SIGTERM to serve alone stops everything, gracefully.
    processes = [psutil.Process(served.proc.pid), *psutil.Process(served.proc.pid).children(recursive=True)]
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0, served.log()[-8000:]
    assert "Stopped." in served.log()
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, f"left running after SIGTERM: {[p.cmdline() for p in alive]}"
    deadline = time.monotonic() + 15
    while embedded_db.postgres_pids(served.pgdata):
        assert time.monotonic() < deadline, "the embedded postgres outlived serve"
        time.sleep(0.2)
    assert _get(served.base + "/healthz") == 0
