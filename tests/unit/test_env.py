from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from console.env import database_from_url, env_bool, env_int, env_secret
from tests.settings_of import settings_of


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


def test_a_slack_bot_token_without_its_signing_secret_stops_the_start(monkeypatch):
    # Posted buttons whose clicks could not be verified would only ever be refused: say so at start.
    with pytest.raises(ImproperlyConfigured, match="SLACK_BOT_TOKEN is set without SLACK_SIGNING_SECRET"):
        settings_of(monkeypatch, {"SLACK_BOT_TOKEN": "xoxb-test", "SLACK_SIGNING_SECRET": ""})


def test_a_bad_database_url_stops_the_settings(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="DATABASE_URL must start with postgres:// or postgresql://"):
        settings_of(monkeypatch, {"DATABASE_URL": "mysql://root@localhost/app"})


@pytest.mark.parametrize(
    ("url", "options"),
    [
        # Over TCP the server probes an idle client, so that a worker machine that vanished loses its sessions,
        # and the advisory locks on its runs, within about 25 s (tests/integration/console/test_db_keepalives.py
        # reads them at the server).
        (
            "postgres://app@db.internal:5432/console",
            "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3",
        ),
        # A URL that sets its own options keeps them.
        ("postgres://app@db.internal:5432/console?options=-c%20tcp_keepalives_idle%3D42", "-c tcp_keepalives_idle=42"),
        # A unix socket needs no probes: the kernel closes it with the process.
        ("postgresql://postgres:@/console?host=/tmp/pg", None),
    ],
    ids=["tcp", "the url's own", "unix socket"],
)
def test_the_keepalive_probes_of_a_database_session(monkeypatch, url, options):
    assert settings_of(monkeypatch, {"DATABASE_URL": url})["DATABASES"]["default"]["OPTIONS"].get("options") == options
