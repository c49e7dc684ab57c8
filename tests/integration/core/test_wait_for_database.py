"""`manage.py wait_for_database`: what compose.yaml's containers run before their process. It returns once the
database answers (with --migrated: once this code's migrations are all applied), and fails after --timeout saying
what it waited for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db.migrations.recorder import MigrationRecorder

ROOT = Path(__file__).resolve().parents[3]


def test_it_returns_at_once_on_a_migrated_database(db):
    call_command("wait_for_database", "--timeout", "1")
    call_command("wait_for_database", "--migrated", "--timeout", "1")


def test_with_migrated_it_waits_for_a_migration_not_yet_applied(db):
    """A new release's web server or worker, started before its migrations ran: it waits, and says for what."""
    latest = MigrationRecorder.Migration.objects.filter(app="runs").order_by("-name").first()
    MigrationRecorder.Migration.objects.filter(pk=latest.pk).delete()  # as if this release's last one were new
    with pytest.raises(
        CommandError, match=rf"gave up after 1 s waiting for 1 migrations to be applied \(runs\.{latest.name}"
    ):
        call_command("wait_for_database", "--migrated", "--timeout", "1")
    call_command("wait_for_database", "--timeout", "1")  # the database itself answers


def test_an_unreachable_database_fails_after_the_timeout_saying_so():
    env = {**os.environ, "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none", "LOG_LEVEL": "WARNING"}
    done = subprocess.run(
        [sys.executable, "manage.py", "wait_for_database", "--timeout", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "waiting for the database to answer (OperationalError" in done.stderr
    assert "gave up after 1 s waiting for the database to answer" in done.stderr
