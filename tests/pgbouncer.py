"""Debian's PgBouncer (`make pgbouncer` installs it), started by a test on a free port with an ini of its own in a
temporary folder, in front of the test database's server. The Debian service is never used.

Run as root (CI, containers), PgBouncer refuses to keep root: the ini names an unprivileged user to switch to, the
one who may reach the server's unix socket when the test database is on one (the embedded server)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from tests.conftest import _free_port

PGBOUNCER = os.environ.get("PGBOUNCER", "/usr/sbin/pgbouncer")


def _unprivileged_user(host: str) -> str:
    """Whom PgBouncer runs as when we are root: the owner of the server's socket directory (the embedded server's
    user, the only one who may enter it), else `postgres` or `nobody` (TCP)."""
    if host.startswith("/"):
        return pwd.getpwuid(Path(host).stat().st_uid).pw_name
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError("running as root, and neither a `postgres` nor a `nobody` user to run PgBouncer as")


class PgBouncer:
    """One PgBouncer process: `url(database)` is a postgres:// URL through it; `admin(command)` runs a command of its
    admin console (SHOW POOLS, SHOW CLIENTS...)."""

    def __init__(self, db: dict, pool_mode: str, **settings: object):
        self.pool_mode = pool_mode
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"pgbouncer-{pool_mode}-"))
        self.dir.chmod(0o755)  # readable by the user PgBouncer switches to
        self.user = db["USER"] or "postgres"
        host = db["HOST"] or "127.0.0.1"
        server = f"host={host} port={db['PORT'] or 5432} user={self.user}"
        if db["PASSWORD"]:
            server += f" password={db['PASSWORD']}"
        (self.dir / "userlist.txt").write_text(f'"{self.user}" ""\n')
        values = {
            "listen_addr": "127.0.0.1",
            "listen_port": self.port,
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": self.dir / "userlist.txt",
            "admin_users": self.user,
            "pool_mode": pool_mode,
            # The server settings a session-mode pool must keep for workers (docs/deploy.md, "Connections and
            # PgBouncer"): a client's session ends with DISCARD ALL (its advisory locks with it); `options` is the
            # keepalive settings Django sends, which PgBouncer cannot pass on (its own tcp_keepalive settings stand
            # in).
            "server_reset_query": "DISCARD ALL",
            "ignore_startup_parameters": "extra_float_digits,options",
            "tcp_keepalive": 1,
            "tcp_keepidle": 10,
            "tcp_keepintvl": 5,
            "tcp_keepcnt": 3,
            "max_client_conn": 500,
            "default_pool_size": 20,
            **settings,
        }
        if os.geteuid() == 0:
            values["user"] = _unprivileged_user(host)
        ini = "[databases]\n* = " + server + "\n\n[pgbouncer]\n"
        ini += "".join(f"{key} = {value}\n" for key, value in values.items())
        (self.dir / "pgbouncer.ini").write_text(ini)
        self.log_path = self.dir / "pgbouncer.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [PGBOUNCER, str(self.dir / "pgbouncer.ini")], stdout=self._log, stderr=subprocess.STDOUT
        )
        self._wait_until_up(db["NAME"])

    def url(self, database: str) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def _wait_until_up(self, database: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.url(database), connect_timeout=2, autocommit=True) as connection:
                    connection.execute("SELECT 1")
                    return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = self.log()
                    self.stop()
                    raise RuntimeError(f"PgBouncer did not start:\n{log[-3000:]}") from None
                time.sleep(0.1)

    def admin(self, command: str) -> list[dict]:
        """A command of PgBouncer's admin console (the `pgbouncer` database), its rows as dicts."""
        with psycopg.connect(self.url("pgbouncer"), autocommit=True) as connection:
            cursor = connection.execute(command, prepare=False)
            names = [column.name for column in cursor.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
