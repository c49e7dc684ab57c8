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

The check asks PostgreSQL's lock manager, not pg_locks (which copies the whole cluster's lock table at every call):
a holder takes the lock twice (`take`), and the check gives one back and takes it again, which only the session
holding it can do, and which never lets it go (runs/sql/queries.sql, run_lock_held). So whoever takes a run's lock
takes it through this module (`hold`, or Run.take's statement), and lets it go through it (both counts).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError, connection
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL
from psycopg.types.numeric import Int4

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


def lock_params(run_id) -> dict[str, Int4]:
    """HELD_SQL's parameters for the run, and those of the statements that take it (`{take}`) and let it go: its
    two keys, as the integers pg_advisory_lock takes (typed: one prepared statement whatever their values)."""
    hi, lo = key(run_id)
    return {"lock_hi": Int4(hi), "lock_lo": Int4(lo)}


def held(run_id) -> RawSQL:
    """HELD_SQL as a condition for a queryset's filter()."""
    hi, lo = key(run_id)
    return RawSQL(queries["run_lock_held_positional"], [hi, lo, hi, lo], output_field=BooleanField())


def new_token(worker: str | None, job_id: int | None) -> str:
    """Who drives the run: the worker and job (for people reading it) and a nonce (so that two claims by the
    same job, e.g. a retried job, are two owners)."""
    return f"{worker or 'local'}/job:{job_id or '-'}/{secrets.token_hex(4)}"


@contextmanager
def hold(run_id) -> Iterator[bool]:
    """Try to take the run's lock on this thread's connection; yields whether it was taken. Held until the
    block ends; if the unlock cannot be sent, the connection is closed, which ends the session and the lock."""
    taken = take(run_id)
    try:
        yield taken
    finally:
        if taken:
            unlock(run_id)


def take(run_id) -> bool:
    """Take the run's lock on this thread's connection (both counts: HELD_SQL says why) if no other session holds
    it; whether it was taken. Let it go with `unlock`."""
    with connection.cursor() as cursor:
        cursor.execute(queries["try_lock_run"], lock_params(run_id))
        return cursor.fetchone()[0]


class Taking:
    """The run's lock as a job takes it with its first statement (Run.take): `taken` once that statement says so,
    None while it is not known (the statement failed: it may have been taken before it did)."""

    def __init__(self, run_id) -> None:
        self.run_id = run_id
        self.taken: bool | None = False


@contextmanager
def taking(run_id) -> Iterator[Taking]:
    """The lock of the run that Run.take takes, let go when the block ends (when taken, or maybe taken)."""
    lock = Taking(run_id)
    try:
        yield lock
    finally:
        if lock.taken is not False:
            unlock(run_id)


def unlock(run_id) -> None:
    """Let the run's lock go (both counts). If that cannot be sent, the connection is closed: the session ends, and
    its locks with it."""
    try:
        if connection.in_atomic_block and connection.needs_rollback:
            # A session lock survives the rollback, but no statement runs in an aborted transaction.
            raise DatabaseError("the transaction is aborted")
        with connection.cursor() as cursor:
            # False (and a warning in the server's log) when this session no longer holds it: the session the
            # lock was taken on ended during the job, and Django opened a new one.
            cursor.execute(queries["unlock_run"], lock_params(run_id))
    except DatabaseError:
        if not connection.in_atomic_block:
            connection.close()  # the session ends, and its locks with it
