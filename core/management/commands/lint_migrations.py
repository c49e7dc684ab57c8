"""`manage.py lint_migrations`: checks new migrations against the expand/contract rule of a rolling deploy.

During a roll the previous release's processes run against the new schema (migrations run first), so a migration
must not drop or rename what that code reads, nor demand of its writes what it does not give (docs/deploy.md,
"Migrations under a rolling deploy"). Each migration of ours newer than BASELINE is read, operation by operation,
with the project state before it; one that breaks the rule fails the command (`make lint`), naming the migration
and the operation. A migration whose class sets `contract = True` is a contract step, written once the release that
stopped reading what it drops runs everywhere: it is let through, and the output says so.

No database: the migration graph is read from the files (MigrationLoader without a connection), so it runs beside
the unit tests. django-migration-linter was the first choice; its 6.0.0 loads the graph through a connection and
reads each migration's SQL through `sqlmigrate`, which connect, and it declares Django up to 6.0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from django.apps import apps
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import migrations
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.migration import Migration
from django.db.migrations.operations.base import Operation
from django.db.migrations.state import ProjectState
from django.db.models import NOT_PROVIDED, Field

# The last migration of each app when the rule was made (issue 26): these and every migration they depend on
# predate it and are not checked. A new app is checked from its first migration.
BASELINE = {
    "approvals": "0013_approval_expires_at",
    "console": "0012_models_move_to_core",
    "core": "0003_apitoken_callback_secret",
    "demo": "0001_initial",
    "external": "0003_request_status_notify",
    "jobs": "0002_deadletter_resolution_choices",
    "runs": "0013_external_runs",
    "slackapp": "0001_slack_identities_routes_messages",
}

# Raw SQL that drops or renames a table, column, view or type, or makes a column NOT NULL. Dropping an index,
# trigger, function or constraint is let through: the previous release's code reads none of them. The input is
# our own migrations, so a regular expression over the SQL (comments removed) is enough.
_BREAKING_SQL = re.compile(
    r"\bDROP\s+(?:TABLE|COLUMN|VIEW|MATERIALIZED\s+VIEW|TYPE|SCHEMA)\b|\bRENAME\b|\bSET\s+NOT\s+NULL\b",
    re.IGNORECASE,
)
_SQL_COMMENT = re.compile(r"--[^\n]*|/\*.*?\*/", re.DOTALL)


@dataclass
class Verdict:
    """What the check says of one migration: the operations it refuses, and whether it is a contract step."""

    migration: Migration
    refused: list[str] = field(default_factory=list)
    contract: bool = False

    @property
    def name(self) -> str:
        return f"{self.migration.app_label}.{self.migration.name}"

    def line(self) -> str:
        if self.contract and self.refused:
            return f"{self.name}: contract migration (contract = True), accepted: " + "; ".join(self.refused)
        if self.contract:
            return f"{self.name}: contract migration (contract = True), nothing it does needed it"
        if self.refused:
            return f"{self.name}: refused: " + "; ".join(self.refused)
        return f"{self.name}: ok"


def check(migration: Migration, state: ProjectState) -> Verdict:
    """The verdict on `migration`, `state` being the project state before it (its models as the previous release
    knows them)."""
    # A model the migration creates is read by no earlier code: what the migration does to it is not judged.
    created = {op.name_lower for op in migration.operations if isinstance(op, migrations.CreateModel)}
    refused = []
    for operation in _database_operations(migration.operations):
        if getattr(operation, "model_name_lower", None) in created:
            continue
        problem = _breaks_previous_release(operation, migration.app_label, state)
        if problem:
            refused.append(f"{operation.describe()}: {problem}")
    return Verdict(migration, refused, contract=bool(getattr(migration, "contract", False)))


def _database_operations(operations: list[Operation]) -> list[Operation]:
    # SeparateDatabaseAndState: only its database operations touch the schema (a state operation moves a model
    # between apps in Django's eyes, and the table stays).
    flat = []
    for operation in operations:
        if isinstance(operation, migrations.SeparateDatabaseAndState):
            flat.extend(_database_operations(operation.database_operations))
        else:
            flat.append(operation)
    return flat


def _breaks_previous_release(operation: Operation, app_label: str, state: ProjectState) -> str | None:
    """Why the previous release's code breaks against the schema after `operation`, or None."""
    match operation:
        case migrations.RemoveField():
            return "drops a column the previous release reads"
        case migrations.DeleteModel():
            return "drops a table the previous release reads"
        case migrations.RenameField():
            return "renames a column the previous release reads by its old name"
        case migrations.RenameModel():
            return "renames a table the previous release reads by its old name"
        case migrations.AlterModelTable():
            return _renames_the_table(operation, app_label, state)
        case migrations.AddField():
            return _adds_a_column_old_inserts_fail(operation.field)
        case migrations.AlterField():
            return _alters_a_column_old_code_breaks_on(operation, app_label, state)
        case migrations.RunSQL():
            return _breaking_sql(operation.sql)
    return None


def _adds_a_column_old_inserts_fail(new: Field) -> str | None:
    # The previous release's INSERTs leave out a column it does not know: NOT NULL needs a database default.
    # Django's `default=` is not one (it fills existing rows, then drops the column's default).
    if new.many_to_many or new.generated or new.null or new.db_default is not NOT_PROVIDED:
        return None
    return "adds a NOT NULL column without db_default: the previous release's INSERTs leave it out"


def _alters_a_column_old_code_breaks_on(operation: migrations.AlterField, app_label: str, state: ProjectState):
    model = state.models.get((app_label, operation.model_name_lower))
    old = model.fields.get(operation.name) if model else None
    if old is None:
        return None
    new = operation.field
    if (old.db_column or operation.name) != (new.db_column or operation.name):
        return "renames a column the previous release reads by its old name"
    # The previous release may write NULL there (its field allows it), db_default or not: Django writes a None
    # value as NULL. NOT NULL is a contract step, once the release that always writes it runs everywhere.
    if old.null and not new.null and not new.many_to_many:
        return "makes a column NOT NULL that the previous release may write NULL to"
    return None


def _renames_the_table(operation: migrations.AlterModelTable, app_label: str, state: ProjectState) -> str | None:
    model = state.models.get((app_label, operation.name_lower))
    default = f"{app_label}_{operation.name_lower}"
    old = (model.options.get("db_table") if model else None) or default
    if (operation.table or default) != old:
        return "renames a table the previous release reads by its old name"
    return None


def _breaking_sql(sql) -> str | None:
    statements = [sql] if isinstance(sql, str) else [s[0] if isinstance(s, list | tuple) else s for s in sql]
    for statement in statements:
        found = _BREAKING_SQL.search(_SQL_COMMENT.sub(" ", str(statement)))
        if found:
            return f"raw SQL {' '.join(found.group(0).upper().split())!r}: drops, renames or adds NOT NULL"
    return None


def new_migrations(loader: MigrationLoader, baseline: dict[str, str]) -> list[Migration]:
    """Our apps' migrations that are neither in `baseline` nor depended on by it, in the order they apply."""
    graph = loader.graph
    missing = [(app, name) for app, name in baseline.items() if (app, name) not in graph.nodes]
    if missing:
        raise CommandError(f"the baseline names migrations that are not in the graph: {missing}")
    old = {node for leaf in baseline.items() for node in graph.forwards_plan(leaf)}
    ours = {config.label for config in apps.get_app_configs() if _is_ours(config.path)}
    # Every migration in an order they may apply in: each leaf's plan, what an earlier leaf's brought left out.
    plan = dict.fromkeys(node for leaf in graph.leaf_nodes() for node in graph.forwards_plan(leaf))
    return [graph.nodes[node] for node in plan if node[0] in ours and node not in old]


def _is_ours(path: str) -> bool:
    # This checkout's apps; Django's, Procrastinate's and the other packages' migrations live in the venv.
    root = Path(settings.BASE_DIR).resolve()
    app = Path(path).resolve()
    return app.is_relative_to(root) and not app.is_relative_to(root / ".venv")


class Command(BaseCommand):
    help = (
        "Check the migrations newer than the baseline against the expand/contract rule (docs/deploy.md): none may"
        " drop or rename what the previous release reads, unless it sets contract = True. No database needed."
    )
    # Reads files only: no system checks (they are `manage.py check`'s), no database.
    requires_system_checks: list[str] = []

    def handle(self, *args, **options):
        loader = MigrationLoader(None, ignore_no_migrations=True)
        verdicts = [
            check(migration, loader.project_state((migration.app_label, migration.name), at_end=False))
            for migration in new_migrations(loader, BASELINE)
        ]
        for verdict in verdicts:
            self.stdout.write(verdict.line())
        refused = [verdict for verdict in verdicts if verdict.refused and not verdict.contract]
        summary = (
            f"{len(verdicts)} migrations newer than the baseline checked against the expand/contract rule"
            f" (docs/deploy.md), {sum(verdict.contract for verdict in verdicts)} of them contract steps"
        )
        if refused:
            raise CommandError(
                f"{summary}; {len(refused)} refused: a release never drops or renames what the previous release's"
                " code reads. Split it (expand now, contract in a later release, marked contract = True)."
            )
        self.stdout.write(summary)
