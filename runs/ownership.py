"""One owner per run, enforced by PostgreSQL: a session-level advisory lock on the run id.

A job drives a run only while it holds this lock, taken on the database connection its thread keeps for the
whole job. PostgreSQL releases a session lock only when the holder unlocks it or its session ends (the worker
exits, is SIGKILLed, or its connection is cut), never because time passed, so a slow step cannot lose its lock
to a stale heartbeat.

The owner token written on the run when it is claimed (Run.owner) says which job that is, but a token is not a
lock: a job whose session was cut (a PostgreSQL restart, a partition, `pg_terminate_backend`) still has its
token, and Django opens a new session for its next statement. So every write that belongs to a step also checks,
in its own statement, that the session it runs in holds the run's lock (`HELD_SQL`): a job that lost its session
lost the run with it, and its next write raises OwnershipLost. docs/DESIGN-NOTES.md says why this is sound.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError, connection
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL

from runs.sql import queries

# The lock is the two-key form (objsubid 2 in pg_locks) on the first 64 bits of the run's UUID, as two signed
# 32-bit keys: two runs share a lock only if their ids agree on 64 random bits. The tenants' transaction locks
# use the one-key form (objsubid 1), which never meets it; the kill switches' two-key locks have a fixed first key.
_MASK = 0xFFFFFFFF


def key(run_id) -> tuple[int, int]:
    """The run's lock: the first two 32-bit words of its id, as the signed integers pg_advisory_lock takes."""
    value = uuid.UUID(str(run_id)).int >> 64
    return _signed(value >> 32), _signed(value & _MASK)


def _signed(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


# A condition (SQL) true only in the session that holds the lock of the run %(lock_hi)s/%(lock_lo)s
# (runs/sql/queries.sql: run_lock_held); `lock_params` gives the parameters.
HELD_SQL = queries["run_lock_held"]


def lock_params(run_id) -> dict[str, int]:
    """HELD_SQL's parameters for the run: its keys as pg_locks shows them (unsigned)."""
    hi, lo = key(run_id)
    return {"lock_hi": hi & _MASK, "lock_lo": lo & _MASK}


def held(run_id) -> RawSQL:
    """HELD_SQL as a condition for a queryset's filter()."""
    params = lock_params(run_id)
    return RawSQL(
        queries["run_lock_held_positional"], [params["lock_hi"], params["lock_lo"]], output_field=BooleanField()
    )


def new_token(worker: str | None, job_id: int | None) -> str:
    """Who drives the run: the worker and job (for people reading it) and a nonce (so that two claims by the
    same job, e.g. a retried job, are two owners)."""
    return f"{worker or 'local'}/job:{job_id or '-'}/{secrets.token_hex(4)}"


@contextmanager
def hold(run_id) -> Iterator[bool]:
    """Try to take the run's lock on this thread's connection; yields whether it was taken. Held until the
    block ends; if the unlock cannot be sent, the connection is closed, which ends the session and the lock."""
    with connection.cursor() as cursor:
        cursor.execute(queries["try_lock_run"], key(run_id))
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
            # False (and a warning in the server's log) when this session no longer holds it: the session the
            # lock was taken on ended during the job, and Django opened a new one.
            cursor.execute(queries["unlock_run"], key(run_id))
    except DatabaseError:
        if not connection.in_atomic_block:
            connection.close()  # the session ends, and its locks with it
