"""A worker's database session lives exactly as long as its connection: no shorter, and no longer.

A job owns its run for as long as its session holds the run's advisory lock (runs.ownership), and PostgreSQL
releases that lock when the session ends. So:

* No shorter. While a step waits on a slow external call, its job's session sits idle holding the lock.
  PostgreSQL's `idle_session_timeout` (14+) or, inside a transaction, `idle_in_transaction_session_timeout` would
  end it, and with it the lock: another worker would take the run while the call is still in flight, and the
  effect could happen twice. A database, role or server default may set either, so a worker sets both to 0 on
  every session it opens (`configure_async` for its psycopg pool and LISTEN connection, `configure_django` for
  the job threads' Django connections). It does so with a query after connecting, not with libpq's `options`
  startup parameter: PgBouncer refuses startup parameters it does not know, or drops them silently when told to
  ignore them (`ignore_startup_parameters = options`). A pooler's own idle timeout (PgBouncer's
  `client_idle_timeout`) is out of the worker's reach: the worker says at start-up what a pooler must not do
  (`POOLER_RULES`), and docs/RUNBOOK.md says how to set it.
* No longer. Behind a session pool, a client's closed connection leaves its server connection in the pool; only
  the pool's reset (PgBouncer's `server_reset_query`, `DISCARD ALL` by default) releases the advisory locks it
  holds. With a reset that does not, a dead worker's run locks stay on a pooled server connection: no job can
  take those runs again, and the recovery sweep sees them owned. `check_locks_end_with_sessions` probes this at
  start-up, and the worker refuses to start behind such a pool (LocksOutliveSessions).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import psycopg
import psycopg_pool
from django.core.exceptions import ImproperlyConfigured
from psycopg.rows import tuple_row

# The idle timeouts that end a session; a server that does not know one (idle_session_timeout is PostgreSQL 14+)
# cannot apply it either, so the statements below skip what pg_settings does not list instead of failing.
IDLE_TIMEOUTS = ("idle_session_timeout", "idle_in_transaction_session_timeout")
_SET_SQL = "SELECT set_config(name, '0', false) FROM pg_settings WHERE name = ANY(%s)"
_READ_SQL = "SELECT name, setting FROM pg_settings WHERE name = ANY(%s) AND setting <> '0'"

# How long the probe waits for a closed connection's lock to go. Directly, the backend exits within
# milliseconds of the client's goodbye; through PgBouncer, the reset runs as soon as the client has gone.
PROBE_WAIT_SECONDS = 5.0
PROBE_POLL_SECONDS = 0.02
# How long the probe waits for the closed connection's backend to leave pg_stat_activity (only a direct one does).
PROBE_EXIT_WAIT_SECONDS = 1.0

# What the worker says once at start-up, for whoever configures the pooler in front of it.
POOLER_RULES = (
    "this worker's database sessions hold its runs' locks for as long as they live, and its idle timeouts are off"
    " (idle_session_timeout = 0, idle_in_transaction_session_timeout = 0 on every session it opens); a pooler in"
    " front of it must not close an idle client (PgBouncer client_idle_timeout and idle_transaction_timeout: 0, or"
    " longer than the longest step), must not share a server between clients (pool_mode = session), and must not"
    " hand a server on without releasing its advisory locks (server_reset_query = DISCARD ALL)"
)


class IdleTimeoutsOn(ImproperlyConfigured):
    """A worker's session still has an idle timeout after the worker turned them off."""


class LocksOutliveSessions(ImproperlyConfigured):
    """A session of the worker's connections outlives the connection: its advisory locks with it."""


def locks_refusal(pids: list[int], waited: float) -> str:
    return (
        "A session of this worker's database connections outlives its connection: an advisory lock taken on a"
        f" connection that was then closed was still held {waited:.1f} s later (by backend"
        f" {', '.join(map(str, pids))})."
        " The worker is"
        " behind a session pool whose reset does not release advisory locks (PgBouncer pool_mode = session with"
        " a server_reset_query that is empty or leaves them): a worker that died would leave its runs' locks on a"
        " pooled server connection, and nobody could take those runs again, so it will not start. Set PgBouncer's"
        " server_reset_query = DISCARD ALL (its default) or a query that includes SELECT pg_advisory_unlock_all(),"
        " or point WORKER_DATABASE_URL at PostgreSQL directly."
    )


# --- no shorter ---------------------------------------------------------------------------------------------------


async def configure_async(connection: psycopg.AsyncConnection) -> None:
    """Turns the idle timeouts off on a new connection of the worker's pool or its LISTEN connection (a pool's
    `configure` callback: it must leave the connection outside a transaction)."""
    await connection.execute(_SET_SQL, [list(IDLE_TIMEOUTS)])
    if not connection.autocommit:
        await connection.commit()


def configure_django(sender: Any, connection: Any, **kwargs: Any) -> None:
    """Turns the idle timeouts off on a new Django connection (the connection_created signal; the worker command
    connects it). Django sends it in autocommit mode, so the setting is not undone by a later rollback."""
    with connection.cursor() as cursor:
        cursor.execute(_SET_SQL, [list(IDLE_TIMEOUTS)])


async def check_idle_timeouts_off(pool: psycopg_pool.AsyncConnectionPool) -> None:
    """Raises IdleTimeoutsOn unless a connection of `pool` reads both idle timeouts as 0 (its `configure` ran)."""
    async with pool.connection() as connection:
        async with connection.cursor(row_factory=tuple_row) as cursor:
            await cursor.execute(_READ_SQL, [list(IDLE_TIMEOUTS)])
            still_on = await cursor.fetchall()
        if not connection.autocommit:
            await connection.commit()
    if still_on:
        settings = ", ".join(f"{name} = {value}" for name, value in still_on)
        raise IdleTimeoutsOn(
            f"This worker's database sessions still have idle timeouts after it turned them off ({settings}): a"
            " step that waits longer than that on an external call would lose its run's lock. Something between"
            " the worker and PostgreSQL does not pass its settings on."
        )


# --- no longer ----------------------------------------------------------------------------------------------------


async def check_locks_end_with_sessions(
    pool: psycopg_pool.AsyncConnectionPool, wait: float = PROBE_WAIT_SECONDS
) -> None:
    """Raises LocksOutliveSessions unless an advisory lock taken on a connection of `pool` is released once that
    connection is closed. Takes two connections of the pool: one takes a session lock on a random key and is
    closed (the pool opens a new one in its place, so the worker holds no more connections than its pool
    size), the other watches pg_locks for that key until nobody holds it or `wait` seconds have passed. What it
    cannot see: a pooler that releases the locks only some of the time."""
    async with pool.connection() as watcher:
        async with pool.connection() as closed:
            key = await _lock_probe_key(closed)
            pid = await _backend_pid(closed)
            await closed.close()
        started = time.monotonic()
        while (holders := await _holders(watcher, key)) and time.monotonic() - started < wait:
            await asyncio.sleep(PROBE_POLL_SECONDS)
        if holders:
            await _end_sessions(watcher, holders)
            raise LocksOutliveSessions(locks_refusal(holders, wait))
        # Connected directly, the closed connection's backend releases its locks a moment before it leaves
        # pg_stat_activity, where the pool's new connection in its place may already stand: wait (briefly: behind a
        # session pool the server connection lives on) until it is gone, so the worker is ready holding its pool.
        started = time.monotonic()
        while await _alive(watcher, pid) and time.monotonic() - started < PROBE_EXIT_WAIT_SECONDS:
            await asyncio.sleep(PROBE_POLL_SECONDS)


async def _backend_pid(connection: psycopg.AsyncConnection) -> int:
    async with connection.cursor(row_factory=tuple_row) as cursor:
        await cursor.execute("SELECT pg_backend_pid()")
        row = await cursor.fetchone()
    if not connection.autocommit:
        await connection.commit()
    assert row is not None
    return row[0]


async def _alive(connection: psycopg.AsyncConnection, pid: int) -> bool:
    async with connection.cursor(row_factory=tuple_row) as cursor:
        await cursor.execute("SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %s)", [pid])
        row = await cursor.fetchone()
    if not connection.autocommit:
        await connection.commit()
    return bool(row and row[0])


async def _lock_probe_key(connection: psycopg.AsyncConnection) -> int:
    """Takes a session advisory lock on a random key nobody holds (the one-key form: objsubid 1 in pg_locks)."""
    while True:
        key = secrets.randbits(63)
        async with connection.cursor(row_factory=tuple_row) as cursor:
            await cursor.execute("SELECT pg_try_advisory_lock(%s::bigint)", [key])
            row = await cursor.fetchone()
        if not connection.autocommit:
            await connection.commit()  # the lock is the session's: it outlives the transaction
        assert row is not None
        if row[0]:
            return key


async def _holders(connection: psycopg.AsyncConnection, key: int) -> list[int]:
    async with connection.cursor(row_factory=tuple_row) as cursor:
        await cursor.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted"
            " AND classid = (%(key)s::bigint >> 32)::oid AND objid = (%(key)s::bigint & 4294967295)::oid"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            {"key": key},
        )
        rows = await cursor.fetchall()
    if not connection.autocommit:
        await connection.commit()
    return [pid for (pid,) in rows]


async def _end_sessions(connection: psycopg.AsyncConnection, pids: list[int]) -> None:
    """Ends the sessions that kept the probe's lock, so that the refusal leaves nothing behind (the pooler drops
    the server connection). A role may end its own sessions; if this one may not, the lock stays on a random key
    that nothing else uses."""
    try:
        await connection.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", [pids])
        if not connection.autocommit:
            await connection.commit()
    except psycopg.Error:
        if not connection.autocommit and not connection.broken:
            await connection.rollback()
