"""`manage.py lint_migrations` (make lint): migrations newer than its baseline are checked against the expand/contract
rule of a rolling deploy (docs/deploy.md). The migrations here are built in the test, against the project state of
today's migrations (core's models), and never written to disk; the graph is read from the files, no database."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import migrations, models
from django.db.migrations.loader import MigrationLoader

from core.management.commands import lint_migrations


@pytest.fixture(scope="module")
def loader():
    return MigrationLoader(None, ignore_no_migrations=True)


@pytest.fixture(scope="module")
def state(loader):
    return loader.project_state()


def migration(*operations, name="0099_next", contract=None):
    built = migrations.Migration(name, "core")
    built.operations = list(operations)
    if contract is not None:
        built.contract = contract
    return built


def test_todays_migrations_pass(loader, capsys):
    call_command("lint_migrations")
    out = capsys.readouterr().out.splitlines()
    newer = lint_migrations.new_migrations(loader, lint_migrations.BASELINE)
    assert out[-1].startswith(f"{len(newer)} migrations newer than the baseline checked")
    assert out[:-1] == [f"{m.app_label}.{m.name}: ok" for m in newer]  # none refused, none a contract step yet


def test_the_baseline_names_a_migration_of_each_app(loader):
    # Migrations since the baseline are checked (the undo's, issue 27); the baseline's own are not.
    newer = lint_migrations.new_migrations(loader, lint_migrations.BASELINE)
    assert all((m.app_label, m.name) not in lint_migrations.BASELINE.items() for m in newer)
    every = lint_migrations.new_migrations(loader, {})
    assert set(lint_migrations.BASELINE) <= {m.app_label for m in every}
    # An app made after the baseline (evals, issue 28) is checked from its first migration.
    later_apps = {m.app_label for m in every} - set(lint_migrations.BASELINE)
    assert [m for m in every if m.app_label in later_apps] == [m for m in newer if m.app_label in later_apps]


BREAKING = {
    "drop a column": migrations.RemoveField("apitoken", "prefix"),
    "drop a table": migrations.DeleteModel("globalkillswitch"),
    "rename a column": migrations.RenameField("apitoken", "prefix", "token_prefix"),
    "rename a model's table": migrations.RenameModel("globalkillswitch", "killswitch"),
    "move a table": migrations.AlterModelTable("apitoken", "core_apitoken"),
    "rename a column by db_column": migrations.AlterField(
        "apitoken", "prefix", models.CharField(max_length=16, db_column="token_prefix")
    ),
    "add a NOT NULL column with a Django default only": migrations.AddField(
        "apitoken", "label", models.CharField(max_length=50, default="")
    ),
    "make a nullable column NOT NULL, db_default or not": migrations.AlterField(
        "apitoken", "last_used_at", models.DateTimeField(db_default=models.functions.Now())
    ),
    "raw SQL dropping a column": migrations.RunSQL("ALTER TABLE console_apitoken DROP COLUMN prefix"),
    "raw SQL renaming, in a list": migrations.RunSQL(["SELECT 1", ("ALTER TABLE t RENAME TO u", None)]),
    "raw SQL adding NOT NULL": migrations.RunSQL("ALTER TABLE t ALTER COLUMN c SET NOT NULL"),
    "a database operation inside SeparateDatabaseAndState": migrations.SeparateDatabaseAndState(
        database_operations=[migrations.RunSQL("DROP TABLE console_channel")]
    ),
}


@pytest.mark.parametrize("operation", BREAKING.values(), ids=BREAKING.keys())
def test_an_operation_that_breaks_the_previous_release_is_refused_naming_the_migration_and_the_operation(
    operation, state
):
    verdict = lint_migrations.check(migration(operation), state)
    assert len(verdict.refused) == 1
    assert verdict.line().startswith("core.0099_next: refused: ")
    described = operation.database_operations[0] if hasattr(operation, "database_operations") else operation
    assert described.describe() in verdict.line()


EXPANDING = {
    "add a nullable column": migrations.AddField("apitoken", "label", models.CharField(max_length=50, null=True)),
    "add a NOT NULL column with db_default": migrations.AddField(
        "apitoken", "label", models.CharField(max_length=50, default="", db_default="")
    ),
    "add a many-to-many": migrations.AddField("channel", "watchers", models.ManyToManyField("auth.User")),
    "relax NOT NULL": migrations.AlterField("apitoken", "prefix", models.CharField(max_length=16, null=True)),
    "name the table it has": migrations.AlterModelTable("apitoken", "console_apitoken"),
    "add an index": migrations.AddIndex("apitoken", models.Index(fields=["prefix"], name="apitoken_prefix_idx")),
    "raw SQL dropping a trigger, 'drop table' in a comment": migrations.RunSQL(
        "-- unlike DROP TABLE, this one the old code never reads\nDROP TRIGGER IF EXISTS t ON console_channel",
        reverse_sql="DROP TABLE x",
    ),
    "move a model in Django's state only": migrations.SeparateDatabaseAndState(
        state_operations=[migrations.DeleteModel("globalkillswitch")]
    ),
    "a data migration": migrations.RunPython(migrations.RunPython.noop),
}


@pytest.mark.parametrize("operation", EXPANDING.values(), ids=EXPANDING.keys())
def test_an_expand_step_passes(operation, state):
    verdict = lint_migrations.check(migration(operation), state)
    assert verdict.refused == []
    assert verdict.line() == "core.0099_next: ok"


def test_a_model_created_in_the_same_migration_is_no_earlier_release_s_to_read(state):
    verdict = lint_migrations.check(
        migration(
            migrations.CreateModel("Label", [("id", models.BigAutoField(primary_key=True))]),
            migrations.AddField("label", "text", models.CharField(max_length=50, default="")),
        ),
        state,
    )
    assert verdict.refused == []


def test_a_contract_migration_is_let_through_and_the_output_says_what_it_drops(state):
    verdict = lint_migrations.check(migration(migrations.RemoveField("apitoken", "prefix"), contract=True), state)
    assert verdict.contract
    assert verdict.line() == (
        "core.0099_next: contract migration (contract = True), accepted: "
        "Remove field prefix from apitoken: drops a column the previous release reads"
    )
    assert not lint_migrations.check(
        migration(migrations.RemoveField("apitoken", "prefix"), contract=False), state
    ).contract


def _with(loader, new):
    # The graph of today's migrations, and `new` after core's last.
    node = (new.app_label, new.name)
    loader.graph.add_node(node, new)
    loader.graph.add_dependency(new, node, ("core", lint_migrations.BASELINE["core"]))
    return loader


def test_the_command_fails_on_a_new_breaking_migration_and_passes_it_once_marked_contract(monkeypatch, capsys):
    bad = migration(migrations.RemoveField("apitoken", "prefix"), name="0004_drop_prefix")
    monkeypatch.setattr(lint_migrations, "MigrationLoader", lambda *a, **k: _with(MigrationLoader(*a, **k), bad))
    with pytest.raises(CommandError, match="migrations newer than the baseline checked.*; 1 refused"):
        call_command("lint_migrations")
    assert (
        "core.0004_drop_prefix: refused: Remove field prefix from apitoken: drops a column the previous release reads\n"
        in capsys.readouterr().out
    )

    bad.contract = True
    call_command("lint_migrations")
    out = capsys.readouterr().out
    assert "core.0004_drop_prefix: contract migration (contract = True), accepted: Remove field prefix" in out
    newer = len(
        lint_migrations.new_migrations(MigrationLoader(None, ignore_no_migrations=True), lint_migrations.BASELINE)
    )
    assert f"{newer + 1} migrations newer than the baseline checked against the expand/contract rule" in out
    assert "1 of them contract steps" in out
