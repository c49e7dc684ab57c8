"""Real starts of `manage.py`, in processes of their own: a wrong setting stops the start and says why on stderr,
and the mail settings a process starts with are the ones it sends through. What each variable makes of the
settings is read in-process, in milliseconds (tests/settings_of.py): tests/unit/test_env.py,
test_mail_settings.py, test_db_pool.py, test_worker_database.py, test_schedules.py."""

from __future__ import annotations

import os
import subprocess
import sys

from django.conf import settings

FILE_BACKEND = "django.core.mail.backends.filebased.EmailBackend"


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none", **env}  # never reached
    environ.pop("EMAIL_FILE_PATH", None) if "EMAIL_FILE_PATH" not in env else None
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=settings.BASE_DIR, env=environ, capture_output=True, text=True
    )


def test_settings_fail_clearly_on_a_bad_database_url():
    proc = manage("check", DATABASE_URL="mysql://root@localhost/app")
    assert proc.returncode != 0
    assert "ImproperlyConfigured: DATABASE_URL must start with postgres:// or postgresql://" in proc.stderr


def test_the_file_backend_writes_each_email_into_email_file_path(tmp_path):
    outbox = tmp_path / "outbox"
    send = "from django.core.mail import send_mail; send_mail('Card 7 escalated', 'body', None, ['lena@example.com'])"

    proc = manage("shell", "-c", send, EMAIL_BACKEND=FILE_BACKEND, EMAIL_FILE_PATH=str(outbox))

    assert proc.returncode == 0, proc.stderr[-2000:]
    (written,) = outbox.iterdir()
    assert "Subject: Card 7 escalated" in written.read_text()
