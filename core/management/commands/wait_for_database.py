"""`manage.py wait_for_database [--migrated] [--timeout SECONDS]`: returns once the database answers (and, with
--migrated, once every migration of this release's code is applied), or fails after the timeout.

What a container runs before its process (compose.yaml), so that a stack needs no start order from its
orchestrator: the migrations wait for PostgreSQL; the web and the workers for the migrations of their own release,
so a new release's code never runs on the previous schema (docs/deploy.md, "Migrations under a rolling deploy")."""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.db.migrations.executor import MigrationExecutor


def _unapplied() -> list[str]:
    """The migrations this code has that the database has not applied."""
    connection = connections[DEFAULT_DB_ALIAS]
    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return [f"{migration.app_label}.{migration.name}" for migration, _backwards in plan]


class Command(BaseCommand):
    help = "Wait until the database answers (with --migrated: and has this release's migrations), at most --timeout s."

    def add_arguments(self, parser):
        parser.add_argument("--timeout", type=float, default=60, help="seconds to wait at most (default 60)")
        parser.add_argument(
            "--migrated", action="store_true", help="also wait until every migration of this code is applied"
        )

    def handle(self, *args, timeout: float, migrated: bool, **options):
        deadline = time.monotonic() + timeout
        said = None  # what the last message was about: the database, or the migrations
        while True:
            try:
                connections[DEFAULT_DB_ALIAS].ensure_connection()
                missing = _unapplied() if migrated else []
            except DatabaseError as exc:
                connections[DEFAULT_DB_ALIAS].close()
                about, waiting = "database", f"the database to answer ({type(exc).__name__}: {str(exc).strip()})"
            else:
                if not missing:
                    return
                about, waiting = (
                    "migrations",
                    f"{len(missing)} migrations to be applied ({', '.join(missing[:3])}, ...)",
                )
            if time.monotonic() >= deadline:
                raise CommandError(f"gave up after {timeout:g} s waiting for {waiting}")
            if about != said:
                self.stderr.write(f"waiting for {waiting}")
                said = about
            time.sleep(1)
