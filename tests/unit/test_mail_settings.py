"""EMAIL_BACKEND=django.core.mail.backends.filebased.EmailBackend writes each email into EMAIL_FILE_PATH; chosen
without a directory it can write to, the console refuses to start (settings) and `manage.py check` says why (the
check framework), instead of starting and then failing every send."""

from __future__ import annotations

import pytest
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from tests.settings_of import settings_of

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


def test_the_file_backend_without_email_file_path_stops_the_start(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="EMAIL_BACKEND is the file backend.*EMAIL_FILE_PATH"):
        settings_of(monkeypatch, {"EMAIL_BACKEND": FILE_BACKEND}, "check", without=("EMAIL_FILE_PATH",))


def test_the_file_backend_writes_into_email_file_path(monkeypatch, tmp_path):
    """What the settings make of the two variables; a real process sending through them:
    tests/integration/console/test_start_up.py."""
    outbox = str(tmp_path / "outbox")
    chosen = settings_of(monkeypatch, {"EMAIL_BACKEND": FILE_BACKEND, "EMAIL_FILE_PATH": outbox}, "shell")
    assert chosen["MAILERS"] == {"default": {"BACKEND": FILE_BACKEND, "OPTIONS": {"file_path": outbox}}}
