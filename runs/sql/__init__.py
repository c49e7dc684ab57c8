"""The runs app's SQL statements, by name (`queries["checkpoint"]`), read once at import from queries.sql, whose
header says how they are written. The status conditions and targets of the statements that move a run are written
from the table of runs.transitions, so that the SQL and the compare-and-swap methods cannot disagree."""

from __future__ import annotations

import re
from importlib import resources
from typing import NamedTuple

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.postgresql.base import ServerBindingCursor
from django.db.backends.utils import CursorWrapper

from runs.transitions import TRANSITIONS, Transition

# procrastinate.sql's: a `-- name --` line, then the comment lines that belong to it.
_SECTION = re.compile(r"(?:\n|^)-- ([a-z0-9_]+) --\n(?:-- .+\n)*", re.MULTILINE)


def parse(text: str) -> dict[str, str]:
    """Each statement of a queries file by name (the text before the first name is the file's header)."""
    parts = _SECTION.split(text)[1:]
    return {name: statement.strip() for name, statement in zip(parts[::2], parts[1::2], strict=True)}


class TransitionSql(NamedTuple):
    leaving: str  # the condition on the status: "= 'running'", "IN ('waiting_human', 'paused')"
    target: str  # "'queued'"


def transition_sql(transition: Transition) -> TransitionSql:
    states = [f"'{status}'" for status in transition.sources]
    leaving = f"= {states[0]}" if len(states) == 1 else f"IN ({', '.join(states)})"
    return TransitionSql(leaving, f"'{transition.target}'")


def _render(templates: dict[str, str]) -> dict[str, str]:
    lock_held = templates["run_lock_held"]
    held = lock_held.format(hi="%(lock_hi)s", lo="%(lock_lo)s")
    take = templates["take_run_lock"].format(hi="%(lock_hi)s", lo="%(lock_lo)s")
    names = {"held": held, "take": take, **{name: transition_sql(t) for name, t in TRANSITIONS.items()}}
    parts = (
        "run_lock_held",
        "take_run_lock",
        "checkpoint_upsert",
        "checkpoint_ends_run",
        "checkpoint_ends_run_lock",
        "start_then_steps",
    )
    upsert = "\n    " + templates["checkpoint_upsert"]
    statements = {
        name: text.format(**names, finish="", lock="", upsert=upsert)
        for name, text in templates.items()
        if name not in parts
    }
    finish = {
        "finish": ",\n        " + templates["checkpoint_ends_run"].format(**names),
        "lock": ", " + templates["checkpoint_ends_run_lock"],
    }
    statements["start_then_steps"] = templates["start_then_steps"].format(
        start=statements["start"], step_rows=statements["step_rows"]
    )
    statements["checkpoint_new"] = templates["checkpoint"].format(**names, finish="", lock="", upsert="")
    statements["checkpoint_finish"] = templates["checkpoint"].format(**names, **finish, upsert=upsert)
    statements["checkpoint_finish_new"] = templates["checkpoint"].format(**names, **finish, upsert="")
    statements["run_lock_held"] = held  # with the run's keys as %(lock_hi)s and %(lock_lo)s (lock_params)
    # For a queryset's filter(): the keys positionally, as often as they occur (runs.ownership.held).
    statements["run_lock_held_positional"] = lock_held.format(hi="%s", lo="%s")
    return statements


templates = parse((resources.files(__package__) / "queries.sql").read_text(encoding="utf-8"))
queries = _render(templates)


def prepared_cursor(*, health_check: bool = True) -> CursorWrapper:
    """A cursor of this thread's Django connection (same session, same transaction) with server-side binding and
    prepared statements, for the engine's statements: PostgreSQL then skips parsing and planning them, which cost
    more of its CPU than executing them (~0.8 of the checkpoint's ~1.3 ms on PostgreSQL 15, docs/PROFILE-engine.md).
    Statements that go together (the claim's, the last checkpoint's) go in one round trip through `pipelined`.
    Django's own cursors bind client-side (one query string may hold several statements, none is prepared), so this
    one is made as Django makes its own: the connection's health check and opening, its errors wrapped as Django's
    (DatabaseError, OperationalError), its queries counted and logged when Django's are (assertNumQueries). One
    statement per execute(); parameters as psycopg's, %(name)s or %s. `health_check`: False when the caller makes
    its own (Run.take: its first statement, sent again on a new connection when the kept one turns out dead)."""
    return _server_cursors(connections[DEFAULT_DB_ALIAS], 1, health_check)[0]


def _server_cursors(db, count: int, health_check: bool) -> list[CursorWrapper]:
    if health_check:
        db.close_if_health_check_failed()
    db.ensure_connection()
    # Django turns psycopg's automatic preparing off (prepare_threshold None); client-side binding cursors never
    # prepare, so this only concerns the statements sent through here: prepared at their first execution, kept
    # per session (psycopg's prepared_max, 100, most recently used).
    db.connection.prepare_threshold = 0
    with db.wrap_database_errors:
        return [db._prepare_cursor(ServerBindingCursor(db.connection)) for _ in range(count)]


class Result(NamedTuple):
    rowcount: int
    rows: list[tuple]


def pipelined(*statements: tuple[str, dict], health_check: bool = True) -> list[Result]:
    """Run `statements` (SQL, parameters) in this order, prepared (as `prepared_cursor`), in one round trip:
    psycopg's pipeline mode sends them all, then a Sync, and reads every result. Outside a transaction (autocommit)
    they are one transaction, committed at the Sync (the extended protocol's implicit transaction, as a query
    string of several statements is in the simple one); in one, they are part of it (its BEGIN goes with them).
    An error in one: the ones after it are not run, the transaction is rolled back (or, in one, aborted), and the
    error is raised as Django's. Each statement still sees what the ones before it did (READ COMMITTED: a new
    snapshot per statement)."""
    db = connections[DEFAULT_DB_ALIAS]
    cursors = _server_cursors(db, len(statements), health_check)
    try:
        with db.wrap_database_errors, db.connection.pipeline():
            for cursor, (sql, params) in zip(cursors, statements, strict=True):
                cursor.execute(sql, params)
        return [
            Result(cursor.rowcount, cursor.fetchall() if cursor.cursor.description is not None else [])
            for cursor in cursors
        ]
    finally:
        for cursor in cursors:
            cursor.close()
