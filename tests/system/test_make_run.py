"""`make run` on a fresh data folder: serves the login page, has a live worker, and Ctrl-C stops the web
server, the worker and the embedded PostgreSQL, leaving nothing running. A second run reuses the data."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import psutil
import psycopg
from django.conf import settings

from console import embedded_db


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _wait_for(url: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (got := _get(url)) != status:
        assert time.monotonic() < deadline, f"{url} answered {got}, expected {status}"
        time.sleep(0.25)


def _pending_cards(conn) -> dict[str, int]:
    rows = conn.execute(
        "SELECT workflow, count(*) FROM approvals_approval WHERE status = 'pending' GROUP BY workflow"
    ).fetchall()
    return dict(rows)


class MakeRun:
    def __init__(self, pgdata, port):
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        env |= {"EMBEDDED_PGDATA": str(pgdata), "PORT": str(port), "READY_HEARTBEAT_MAX_AGE": "30"}
        env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        # Its own session, like a terminal's foreground job, so Ctrl-C can be sent to the whole group.
        self.proc = subprocess.Popen(
            ["make", "--no-print-directory", "run"],
            cwd=settings.BASE_DIR,
            env=env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.base = f"http://127.0.0.1:{port}"

    def processes(self) -> list[psutil.Process]:
        return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]

    def ctrl_c(self) -> str:
        os.killpg(self.proc.pid, signal.SIGINT)
        output, _ = self.proc.communicate(timeout=60)
        return output


def test_make_run_serves_and_ctrl_c_stops_everything(tmp_path):
    pgdata = tmp_path / "pgdata"
    run = MakeRun(pgdata, _free_port())
    try:
        _wait_for(run.base + "/accounts/login/", 200, timeout=120)
        _wait_for(run.base + "/readyz", 200, timeout=30)  # the embedded worker sends heartbeats
        assert _get(run.base + "/") == 200  # redirected to the login page
        processes = run.processes()
        assert any("console.webserver" in " ".join(p.cmdline()) for p in processes)
        # `manage.py worker` (or `manage.py procrastinate worker` before that command existed)
        (worker,) = [p for p in processes if p.cmdline()[1:2] == ["manage.py"] and p.cmdline()[-1] == "worker"]
        assert "DATABASE_CONN_MAX_AGE" not in worker.environ()  # a worker keeps its connections by default
        with psycopg.connect(f"postgresql://postgres@/postgres?host={pgdata}", autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (note text)")
            # The seeded demo: the worker parks both demo workflows' runs with cards for the inbox.
            deadline = time.monotonic() + 60
            while (waiting := _pending_cards(conn)).get("support_agent", 0) < 4 or not waiting.get("refund"):
                assert time.monotonic() < deadline, f"pending cards by workflow: {waiting}"
                time.sleep(0.5)
    finally:
        output = run.ctrl_c()
    assert "Stopped." in output, output
    # The web server, the worker, the database guard and PostgreSQL itself all end.
    gone, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, f"left running after Ctrl-C: {[p.cmdline() for p in alive]}"
    deadline = time.monotonic() + 10
    while embedded_db.postgres_pids(pgdata):
        assert time.monotonic() < deadline, "the embedded postgres outlived make run"
        time.sleep(0.2)

    # A second `make run` reuses the data.
    run = MakeRun(pgdata, _free_port())
    try:
        _wait_for(run.base + "/accounts/login/", 200, timeout=120)
        with psycopg.connect(f"postgresql://postgres@/postgres?host={pgdata}") as conn:
            assert conn.execute("SELECT count(*) FROM kept").fetchone() == (0,)
    finally:
        assert "Stopped." in run.ctrl_c()
