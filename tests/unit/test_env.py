from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from console.env import database_from_url, env_bool, env_int, env_secret


def test_it_parses_a_tcp_url():
    db = database_from_url("postgres://app:s%40cret@db.internal:6432/console?sslmode=require")
    assert db["NAME"] == "console"
    assert (db["USER"], db["PASSWORD"], db["HOST"], db["PORT"]) == ("app", "s@cret", "db.internal", "6432")
    assert db["OPTIONS"] == {"sslmode": "require"}


def test_it_parses_a_unix_socket_url():
    db = database_from_url("postgresql://postgres:@/postgres?host=/tmp/pg")
    assert (db["HOST"], db["PORT"], db["NAME"], db["OPTIONS"]) == ("/tmp/pg", "", "postgres", {})


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://root@localhost/app", "must start with postgres://"),
        ("not a url", "must start with postgres://"),
        ("postgres://localhost:99999/app", "not a valid URL"),
        ("postgres://localhost:5432", "names no database"),
    ],
)
def test_it_rejects_a_bad_database_url(url, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        database_from_url(url)


def test_it_hides_the_password_in_the_error():
    with pytest.raises(ImproperlyConfigured) as info:
        database_from_url("postgres://app:hunter2@localhost:5432")
    assert "hunter2" not in str(info.value)


def test_settings_fail_clearly_on_a_bad_database_url():
    env = {**os.environ, "DATABASE_URL": "mysql://root@localhost/app"}
    proc = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=settings.BASE_DIR, env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "ImproperlyConfigured: DATABASE_URL must start with postgres:// or postgresql://" in proc.stderr


def test_env_helpers_reject_bad_values(monkeypatch):
    monkeypatch.setenv("X_BOOL", "maybe")
    monkeypatch.setenv("X_INT", "ten")
    with pytest.raises(ImproperlyConfigured, match="X_BOOL must be a boolean"):
        env_bool("X_BOOL")
    with pytest.raises(ImproperlyConfigured, match="X_INT must be an integer"):
        env_int("X_INT", 1)
    monkeypatch.setenv("X_BOOL", "off")
    monkeypatch.setenv("X_INT", "10")
    assert env_bool("X_BOOL", True) is False
    assert env_int("X_INT", 1) == 10


def test_a_secret_is_required_outside_development(monkeypatch):
    monkeypatch.delenv("X_SECRET", raising=False)
    assert env_secret("X_SECRET", development_default="dev", development=True) == "dev"
    with pytest.raises(ImproperlyConfigured, match="X_SECRET must be set"):
        env_secret("X_SECRET", development_default="dev", development=False)


def test_a_slack_bot_token_without_its_signing_secret_stops_the_start():
    # Posted buttons whose clicks could not be verified would only ever be refused: say so at start.
    env = {
        **os.environ,
        "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none",  # parsed, never reached: settings fail first
        "SLACK_BOT_TOKEN": "xoxb-test",
        "SLACK_SIGNING_SECRET": "",
    }
    proc = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=settings.BASE_DIR, env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "ImproperlyConfigured: SLACK_BOT_TOKEN is set without SLACK_SIGNING_SECRET" in proc.stderr
