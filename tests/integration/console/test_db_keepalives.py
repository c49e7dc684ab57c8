"""Over TCP the server probes an idle client, so that a worker machine that vanished loses its sessions, and the
advisory locks on its runs (runs.ownership), within about 25 s rather than the operating system's two hours."""

from __future__ import annotations

import os
import subprocess
import sys

from django.conf import settings

SHOW = (
    "from django.db import connection\n"
    "with connection.cursor() as c:\n"
    "    c.execute('SHOW tcp_keepalives_idle'); print(c.fetchone()[0])\n"
    "    c.execute('SHOW tcp_keepalives_interval'); print(c.fetchone()[0])\n"
    "    c.execute('SHOW tcp_keepalives_count'); print(c.fetchone()[0])\n"
)


def _session_settings(database_url: str) -> list[str]:
    env = {**os.environ, "DATABASE_URL": database_url}
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", SHOW],
        cwd=settings.BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.split()[-3:]


def test_a_tcp_session_is_probed_by_the_server():
    # The machine's PostgreSQL 15 over TCP (DEVELOPERS: it runs here and in CI); the postgres database exists.
    assert _session_settings("postgres://postgres@127.0.0.1:5432/postgres") == ["10", "5", "3"]


def test_a_url_that_sets_its_own_options_keeps_them():
    url = "postgres://postgres@127.0.0.1:5432/postgres?options=-c%20tcp_keepalives_idle%3D42"
    assert _session_settings(url)[0] == "42"
