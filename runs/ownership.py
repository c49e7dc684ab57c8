"""One owner per run, enforced by PostgreSQL: a session-level advisory lock on the run id.

A job drives a run only while it holds this lock, taken on the database connection its thread keeps for the
whole job. PostgreSQL releases a session lock only when the holder unlocks it or its session ends (the worker
exits, is SIGKILLed, or its connection is cut), never because time passed, so a slow step cannot lose its lock
to a stale heartbeat. The owner token written on the run when it is claimed (Run.owner) is the second guard:
every write that belongs to a step names it in its WHERE clause. docs/DESIGN-NOTES.md says why this is sound.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError, connection

# The first key of the two-key advisory lock form: a namespace of our own, so run locks never collide with
# other advisory locks (the tenant slots use the one-key form).
_NAMESPACE = 0x52554E  # "RUN"


def new_token(worker: str | None, job_id: int | None) -> str:
    """Who drives the run: the worker and job (for people reading it) and a nonce (so that two claims by the
    same job, e.g. a retried job, are two owners)."""
    return f"{worker or 'local'}/job:{job_id or '-'}/{secrets.token_hex(4)}"


def _key_sql() -> str:
    return f"{_NAMESPACE}, hashtext(%s)"


@contextmanager
def hold(run_id) -> Iterator[bool]:
    """Try to take the run's lock on this thread's connection; yields whether it was taken. Held until the
    block ends; if the unlock cannot be sent, the connection is closed, which ends the session and the lock."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT pg_try_advisory_lock({_key_sql()})", [str(run_id)])
        taken = cursor.fetchone()[0]
    try:
        yield taken
    finally:
        if taken:
            _unlock(run_id)


def _unlock(run_id) -> None:
    try:
        if connection.in_atomic_block and connection.needs_rollback:
            # A session lock survives the rollback, but no statement runs in an aborted transaction.
            raise DatabaseError("the transaction is aborted")
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT pg_advisory_unlock({_key_sql()})", [str(run_id)])
    except DatabaseError:
        if not connection.in_atomic_block:
            connection.close()  # the session ends, and its locks with it
