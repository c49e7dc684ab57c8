"""A run's transition graph is one table (runs.transitions.TRANSITIONS): the compare-and-swap methods of Run take
their states from it, and the SQL statements that move a run have their status conditions and targets written
from it (runs/sql). These tests hold the methods' source and the statements to the table; that each
compare-and-swap, run against the database, leaves only the states of its transition:
tests/integration/runs/test_run_transitions.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runs import models as run_models
from runs import sql
from runs.transitions import FINISHED, TRANSITIONS, RunStatus

MODELS_SOURCE = Path(run_models.__file__).read_text()

# The statements that change a run's status, and the transitions each takes. A new one must be named here.
STATEMENTS = {
    "start": {"start"},
    "start_then_steps": {"start"},  # start, with the step rows (Run.take)
    "checkpoint": {"checkpoint"},
    "checkpoint_new": {"checkpoint"},  # checkpoint, its step's row a plain INSERT
    # a cancel and undo while the last step ran leaves the run running, its owner's to undo (runs.compensations)
    "checkpoint_finish": {"succeed", "stop", "checkpoint"},
    "checkpoint_finish_new": {"succeed", "stop", "checkpoint"},
    "finish": {"succeed", "stop"},  # Run.finish passes the target as %(status)s
}
# Statements built from another's template (runs.sql._render), which the tests of that template cover.
DERIVED = {"start_then_steps", "checkpoint_new", "checkpoint_finish", "checkpoint_finish_new"}
FINISH_TARGETS = {"succeed": RunStatus.SUCCEEDED, "stop": RunStatus.CANCELLED}  # Run.finish(status)

# The updated row's own status condition (not a subquery's): right after its id's.
_ROW_CONDITION = re.compile(r"WHERE (?:r\.)?id = %\(\w+\)s AND (?:r\.)?status (= '\w+'|IN \([^)]*\))")


def _states(condition: str) -> set[str]:
    return set(re.findall(r"'(\w+)'", condition))


def _moves_a_run(statement: str) -> bool:
    """An UPDATE of runs_run that sets its status."""
    update = re.search(r"UPDATE runs_run\b(.*?)\bWHERE\b", statement, re.DOTALL)
    return update is not None and re.search(r"\bstatus = ", update.group(1)) is not None


def _targets(statement: str) -> set[str]:
    set_clause = re.search(r"UPDATE runs_run\b(.*?)\bWHERE\b", statement, re.DOTALL).group(1)
    if case := re.search(r"status = (CASE WHEN .*? END)", set_clause):
        return set(re.findall(r"(?:THEN|ELSE) '(\w+)'", case.group(1)))
    if literal := re.search(r"status = '(\w+)'", set_clause):
        return {literal.group(1)}
    return set()


def test_it_names_run_statuses_only():
    for name, (sources, target) in TRANSITIONS.items():
        assert sources and set(sources) <= set(RunStatus.values), name
        assert target in RunStatus.values, name


def test_it_lets_a_finished_run_leave_only_to_be_requeued_from_the_dead_letter_queue():
    leaving_finished = {name for name, (sources, _) in TRANSITIONS.items() if set(sources) & set(FINISHED)}
    assert leaving_finished == {"requeue_failed"}
    assert TRANSITIONS["requeue_failed"].sources == (RunStatus.FAILED,)


def test_every_status_changing_statement_is_named_with_its_transitions():
    moving = {name for name, statement in sql.queries.items() if _moves_a_run(statement)}
    assert moving == set(STATEMENTS) - {"checkpoint", "checkpoint_new"}  # they move the cursor, not the status
    assert _ROW_CONDITION.search(sql.queries["checkpoint"]), "the checkpoint's UPDATE checks the run's status"


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_each_statement_leaves_and_reaches_the_states_of_its_transitions(name):
    statement = sql.queries[name]
    transitions = [TRANSITIONS[t] for t in sorted(STATEMENTS[name])]
    condition = _ROW_CONDITION.search(statement)
    assert condition is not None, statement
    for transition in transitions:
        assert _states(condition.group(1)) == set(transition.sources), name
    targets = _targets(statement)
    if name == "finish":
        assert "status = %(status)s" in statement
        targets = {FINISH_TARGETS[t] for t in STATEMENTS[name]}
    elif not targets:  # the status stays: the transition's target is its source
        targets = {status for t in transitions for status in t.sources}
    assert targets == {t.target for t in transitions}, name


def test_no_statement_writes_a_status_of_its_own():
    """The statements that move a run take their states from the table: no literal status where their UPDATE sets
    the status or checks the updated row's."""
    for name in STATEMENTS.keys() - DERIVED:  # checkpoint_finish: the checkpoint's template, with checkpoint_ends_run
        template = sql.templates[name]
        set_clause = re.search(r"UPDATE runs_run\b(.*?)\bWHERE\b", template, re.DOTALL).group(1)
        assert not re.search(r"status = (?:'|CASE)", set_clause), name
        assert not re.search(r"(?:r\.)?id = %\(\w+\)s AND (?:r\.)?status (?:= '|IN \()", template), name
    assert "'" not in sql.templates["checkpoint_ends_run"].split(",\n")[0].replace("''", "")


def test_the_compare_and_swap_methods_take_their_transitions_by_name():
    """Every transition is taken somewhere (a method's _swap, or a statement), and no method passes its own
    states: a `leaving` list, or a status among its changes."""
    taken = set(re.findall(r'"(\w+)"', MODELS_SOURCE)) & set(TRANSITIONS)
    taken |= {t for transitions in STATEMENTS.values() for t in transitions}
    assert taken == set(TRANSITIONS)
    swaps = re.findall(r"(?<!def )_swap\(\s*([^,)]+)", MODELS_SOURCE)
    assert swaps and all(re.fullmatch(r'"\w+"|"\w+" if \w+ else "\w+"', s) for s in swaps), swaps
    assert not re.search(r"_swap\([^)]*\bstatus=", MODELS_SOURCE)
