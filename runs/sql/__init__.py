"""The runs app's SQL statements, by name (`queries["checkpoint"]`), read once at import from queries.sql, whose
header says how they are written. The status conditions and targets of the statements that move a run are written
from the table of runs.transitions, so that the SQL and the compare-and-swap methods cannot disagree."""

from __future__ import annotations

import re
from importlib import resources
from typing import NamedTuple

from django.db import connection
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
    names = {"held": held, **{name: transition_sql(t) for name, t in TRANSITIONS.items()}}
    statements = {
        name: text.format(**names, finish="", lock="")
        for name, text in templates.items()
        if name not in ("run_lock_held", "checkpoint_ends_run", "checkpoint_ends_run_lock")
    }
    statements["checkpoint_finish"] = templates["checkpoint"].format(
        **names,
        finish=",\n        " + templates["checkpoint_ends_run"].format(**names),
        lock=", " + templates["checkpoint_ends_run_lock"],
    )
    statements["run_lock_held"] = held  # with the run's keys as %(lock_hi)s and %(lock_lo)s (lock_params)
    statements["run_lock_held_positional"] = lock_held.format(hi="%s", lo="%s")  # for a queryset's filter()
    return statements


templates = parse((resources.files(__package__) / "queries.sql").read_text(encoding="utf-8"))
queries = _render(templates)


def prepared_cursor() -> CursorWrapper:
    """A cursor of this thread's Django connection (same session, same transaction) with server-side binding and
    prepared statements, for the engine's hottest statement (the checkpoint of every step but the last): PostgreSQL
    then skips parsing and planning it, which cost more of its CPU than executing it (~0.8 of the checkpoint's ~1.3
    ms on PostgreSQL 15, docs/PROFILE-engine.md). Not for the claim and the last checkpoint, once a run each: their
    several statements go in one query string (one round trip, which a resume waits for), which only a client-side
    binding cursor can send, and preparing them as separate statements saved less CPU than the round trips cost.
    Django's own cursors bind client-side (one query string may hold several statements, none is prepared), so this
    one is made as Django makes its own: the connection's health check and opening, its errors wrapped as Django's
    (DatabaseError, OperationalError), its queries counted and logged when Django's are (assertNumQueries). One
    statement per execute(); parameters as psycopg's, %(name)s or %s."""
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    # Django turns psycopg's automatic preparing off (prepare_threshold None); client-side binding cursors never
    # prepare, so this only concerns the statements sent through here: prepared at their first execution, kept
    # per session (psycopg's prepared_max, 100, most recently used).
    connection.connection.prepare_threshold = 0
    with connection.wrap_database_errors:
        return connection._prepare_cursor(ServerBindingCursor(connection.connection))
