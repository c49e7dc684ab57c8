"""How the runs app's SQL is read (runs.sql): queries.sql cut into statements by their `-- name --` lines, and the
templates filled in once at import, the status conditions and targets from runs.transitions. What the statements do
against PostgreSQL is the integration tests' (tests/integration/runs)."""

from __future__ import annotations

import re
import string
from pathlib import Path

import pytest

from runs import sql
from runs.transitions import TRANSITIONS, RunStatus, Transition

RUNS = Path(sql.__file__).resolve().parent.parent


def test_it_cuts_a_file_into_statements_by_name_dropping_the_header_and_the_comments_under_each_name():
    text = (
        "-- The header: what the file is.\n"
        "-- It is not a statement.\n"
        "\n"
        "-- first --\n"
        "-- what the first is for,\n"
        "-- on two lines\n"
        "SELECT 1\n"
        "\n"
        "-- second_2 --\n"
        "UPDATE t SET a = 1\n"
        "WHERE b -- a comment in the statement stays\n"
        "\n"
    )
    assert sql.parse(text) == {
        "first": "SELECT 1",
        "second_2": "UPDATE t SET a = 1\nWHERE b -- a comment in the statement stays",
    }


def test_a_file_of_comments_alone_has_no_statement():
    assert sql.parse("-- Only a header.\n-- Nothing else.\n") == {}


def test_a_name_is_lowercase_letters_digits_and_underscores():
    assert sql.parse("-- Header --\nSELECT 1\n") == {}  # not a name: the header's text
    assert sql.parse("-- a-b --\nSELECT 1\n") == {}


def test_a_transition_from_one_state_is_an_equality_and_from_several_a_list():
    assert sql.transition_sql(Transition((RunStatus.RUNNING,), RunStatus.QUEUED)) == ("= 'running'", "'queued'")
    several = Transition((RunStatus.WAITING_HUMAN, RunStatus.PAUSED), RunStatus.QUEUED)
    assert sql.transition_sql(several) == ("IN ('waiting_human', 'paused')", "'queued'")


def test_each_statement_of_the_file_is_read_once_under_its_name():
    text = (RUNS / "sql" / "queries.sql").read_text(encoding="utf-8")
    names = re.findall(r"^-- ([a-z0-9_]+) --$", text, re.MULTILINE)
    assert len(names) == len(set(names)), "a name given twice: the second statement would replace the first"
    assert list(sql.templates) == names


def test_every_placeholder_is_filled_and_doubled_braces_are_left_for_the_caller():
    left = {
        name: {field for _, field, _, _ in string.Formatter().parse(statement) if field is not None}
        for name, statement in sql.queries.items()
    }
    # The caller's own: Run's columns (the claims), the INSERT and its primary key (runs.submission).
    assert {name: fields for name, fields in left.items() if fields} == {
        "claim": {"columns"},
        "claim_take": {"columns"},
        "insert_run_with_first_job": {"insert", "pk"},
        "insert_runs_with_first_jobs": {"insert", "pk"},  # runs.group_commit
    }


def test_the_lock_condition_is_filled_in_with_the_runs_keys():
    held = sql.queries["run_lock_held"]
    assert "%(lock_hi)s" in held and "%(lock_lo)s" in held and "{" not in held
    assert sql.queries["run_lock_held_positional"] == held.replace("%(lock_hi)s", "%s").replace("%(lock_lo)s", "%s")
    assert held in sql.queries["claim"]  # the claim asks whether this session holds the run's lock
    # Every write of the run's owner checks it in its own statement, the start of a queued run included.
    for name in ("start", "start_then_steps", "owned", "finish", "checkpoint", "checkpoint_new", "checkpoint_finish"):
        assert held in sql.queries[name], name
    # It asks the lock manager, never the cluster-wide copy of the lock table.
    assert not any("pg_locks" in sql.queries[name] for name in ("run_lock_held", "claim", "checkpoint", "start"))


def test_the_lock_is_taken_with_both_counts_and_let_go_with_both():
    take = sql.templates["take_run_lock"].format(hi="%(lock_hi)s", lo="%(lock_lo)s")
    assert sql.queries["try_lock_run"] == f"SELECT {take}"
    assert take in sql.queries["claim_take"]  # a job's first statement takes it as runs.ownership.hold does
    assert sql.queries["unlock_run"].count("pg_advisory_unlock(%(lock_hi)s, %(lock_lo)s)") == 2


def test_the_checkpoint_of_the_last_step_is_the_checkpoint_with_the_runs_end():
    checkpoint, finish = sql.queries["checkpoint"], sql.queries["checkpoint_finish"]
    ends = sql.templates["checkpoint_ends_run"].format(
        **{name: sql.transition_sql(t) for name, t in TRANSITIONS.items()}
    )
    assert ends.strip() and ends.strip() in finish and ends.strip() not in checkpoint
    assert sql.templates["checkpoint_ends_run_lock"].strip() in finish
    # The pieces that only build checkpoint_finish are not statements of their own.
    assert "checkpoint_ends_run" not in sql.queries and "checkpoint_ends_run_lock" not in sql.queries


def test_a_step_no_attempt_left_a_row_of_is_a_plain_insert_and_the_others_an_upsert():
    upsert = sql.templates["checkpoint_upsert"].strip()
    assert upsert.startswith("ON CONFLICT (run_id, seq) DO UPDATE")
    for name in ("checkpoint", "checkpoint_finish"):
        assert upsert in sql.queries[name] and upsert not in sql.queries[f"{name}_new"]
        assert sql.queries[f"{name}_new"] == sql.queries[name].replace("\n    " + upsert, "")
    assert "checkpoint_upsert" not in sql.queries


def test_a_template_naming_an_unknown_transition_fails_at_import():
    templates = {**sql.templates, "extra": "UPDATE runs_run SET status = {no_such_transition.target}"}
    with pytest.raises(KeyError, match="no_such_transition"):
        sql._render(templates)


def test_every_statement_the_code_asks_for_is_in_the_file():
    asked = {
        name
        for path in RUNS.rglob("*.py")
        for name in re.findall(r"""queries\[["'](\w+)["']\]""", path.read_text(encoding="utf-8"))
    }
    assert asked and asked <= set(sql.queries), asked - set(sql.queries)
