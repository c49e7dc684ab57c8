"""EMAIL_BACKEND=django.core.mail.backends.filebased.EmailBackend writes each email into EMAIL_FILE_PATH; chosen
without a directory it can write to, the console refuses to start (settings) and `manage.py check` says why (the
check framework), instead of starting and then failing every send."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.conf import settings
from django.core import checks

FILE_BACKEND = "django.core.mail.backends.filebased.EmailBackend"


def mail_errors() -> list[checks.CheckMessage]:
    return [m for m in checks.run_checks(tags=[checks.Tags.mail]) if m.level >= checks.ERROR]


def file_mailer(settings, path) -> None:
    settings.MAILERS = {"default": {"BACKEND": FILE_BACKEND, "OPTIONS": {} if path is None else {"file_path": path}}}


@pytest.mark.parametrize("where", ["unset", "a file", "under a file"])
def test_the_check_refuses_the_file_backend_without_a_writable_directory(settings, tmp_path, where):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    file_mailer(settings, {"unset": None, "a file": str(a_file), "under a file": str(a_file / "mail")}[where])

    (error,) = mail_errors()

    assert error.id == "console.E001"
    assert "EMAIL_FILE_PATH" in error.msg


def test_the_check_takes_a_writable_directory_even_one_still_to_create(settings, tmp_path):
    file_mailer(settings, str(tmp_path / "mail" / "outbox"))
    assert mail_errors() == []
    file_mailer(settings, str(tmp_path))
    assert mail_errors() == []


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none", **env}  # never reached
    environ.pop("EMAIL_FILE_PATH", None) if "EMAIL_FILE_PATH" not in env else None
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=settings.BASE_DIR, env=environ, capture_output=True, text=True
    )


def test_the_file_backend_without_email_file_path_stops_the_start():
    proc = manage("check", EMAIL_BACKEND=FILE_BACKEND)
    assert proc.returncode != 0
    assert "ImproperlyConfigured: EMAIL_BACKEND is the file backend" in proc.stderr
    assert "EMAIL_FILE_PATH" in proc.stderr


def test_the_file_backend_writes_each_email_into_email_file_path(tmp_path):
    outbox = tmp_path / "outbox"
    send = "from django.core.mail import send_mail; send_mail('Card 7 escalated', 'body', None, ['lena@example.com'])"

    proc = manage("shell", "-c", send, EMAIL_BACKEND=FILE_BACKEND, EMAIL_FILE_PATH=str(outbox))

    assert proc.returncode == 0, proc.stderr[-2000:]
    (written,) = outbox.iterdir()
    assert "Subject: Card 7 escalated" in written.read_text()
