"""A worker's heartbeat file, and the health command that reads it: `python -m jobs.healthcheck [--max-age S]`.

A worker container's orchestrator asks every 10-30 s whether the worker is alive. The worker's own heartbeat (a
row of procrastinate_workers) needs the database, and a worker waiting out a database outage is alive: restarting
it would change nothing but lose its running jobs' progress. So, when WORKER_HEARTBEAT_FILE is set, the worker
also writes its heartbeat to that file (jobs.worker): once registered, then at every turn of its heartbeat loop
(WORKER_HEARTBEAT_INTERVAL), whether or not the database answered; it removes the file when it stops. The file is
a small JSON object:

    {"pid": 7, "worker_id": 123, "beat": <unix time>, "database_ok": <unix time of the last heartbeat the database
    took, or null>}

The command exits 0 when the file's beat is at most `--max-age` seconds old (default READY_HEARTBEAT_MAX_AGE,
else 60, as /readyz), 1 otherwise, and says why on one line. It reads the environment, not Django's settings, and
imports nothing but the standard library (and this module's package, whose __init__ is empty): it runs in tens of
milliseconds, and without a database connection.

One file, one worker: two workers given the same path would overwrite (and remove) each other's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ENV_FILE = "WORKER_HEARTBEAT_FILE"
ENV_MAX_AGE = "READY_HEARTBEAT_MAX_AGE"
DEFAULT_MAX_AGE = 60  # READY_HEARTBEAT_MAX_AGE's default in console/settings.py


class HeartbeatFile:
    """The worker's side: `beat()` replaces the file atomically (a temporary file in the same directory, then
    os.replace: a reader never sees half a file), `remove()` deletes it. Neither raises: a full disk or a read-only
    path must not stop the worker, so the first failure is logged (through `log`) and the next are not, until a
    write succeeds again."""

    def __init__(self, path: str, log: Any) -> None:
        self.path = path
        self._tmp = f"{path}.{os.getpid()}.tmp"
        self._log = log
        self._failing = False
        self.database_ok: float | None = None

    def beat(self, worker_id: int | None, *, database_ok: bool = False) -> None:
        now = time.time()
        if database_ok:
            self.database_ok = now
        data = {"pid": os.getpid(), "worker_id": worker_id, "beat": now, "database_ok": self.database_ok}
        try:
            # No fsync: the file is for a process on this machine, which reads it from the page cache; a machine
            # that crashes takes the worker with it.
            with open(self._tmp, "w", encoding="utf-8") as file:
                file.write(json.dumps(data))
            os.replace(self._tmp, self.path)
        except OSError as exc:
            self._failed("could not write the heartbeat file", exc)
        else:
            self._failing = False

    def remove(self) -> None:
        for path in (self.path, self._tmp):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._failed("could not remove the heartbeat file", exc)

    def _failed(self, message: str, exc: OSError) -> None:
        if not self._failing:
            self._failing = True
            self._log.warning(message, path=self.path, error=f"{type(exc).__name__}: {exc}")


def check(path: str, max_age: float, now: float | None = None) -> tuple[bool, str]:
    """(healthy, what to say) for the heartbeat file at `path`."""
    now = time.time() if now is None else now
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        return False, f"no heartbeat file at {path}: the worker has not started, or has stopped"
    except OSError as exc:
        return False, f"cannot read the heartbeat file {path}: {exc}"
    try:
        data = json.loads(text)
        beat = float(data["beat"])
        database_ok = data.get("database_ok")
        database_ok = None if database_ok is None else float(database_ok)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return False, f"the heartbeat file {path} is not a heartbeat ({type(exc).__name__}: {exc}): {text[:200]!r}"
    age = now - beat
    if age > max_age:
        return False, f"last heartbeat {age:.0f} s ago, more than {max_age:g} (worker {data.get('worker_id')})"
    database = (
        "the database has not answered a heartbeat yet"
        if database_ok is None
        else f"database answered {now - database_ok:.0f} s ago"
    )
    return True, f"worker {data.get('worker_id')} (pid {data.get('pid')}): heartbeat {age:.0f} s ago; {database}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.healthcheck",
        description=f"Exit 0 when the worker's heartbeat file (${ENV_FILE}) is fresh, 1 otherwise.",
    )
    parser.add_argument(
        "--max-age",
        type=float,
        default=None,
        help=f"seconds a heartbeat stays fresh (default: ${ENV_MAX_AGE}, else {DEFAULT_MAX_AGE})",
    )
    args = parser.parse_args(argv)
    path = os.environ.get(ENV_FILE, "")
    if not path:
        print(f"{ENV_FILE} is not set: the worker writes no heartbeat file", file=sys.stderr)
        return 1
    max_age = args.max_age
    if max_age is None:
        raw = os.environ.get(ENV_MAX_AGE, "")
        try:
            max_age = float(raw) if raw else DEFAULT_MAX_AGE
        except ValueError:
            print(f"{ENV_MAX_AGE} is not a number: {raw!r}", file=sys.stderr)
            return 1
    healthy, message = check(path, max_age)
    print(message, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
