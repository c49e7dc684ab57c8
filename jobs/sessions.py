"""What a worker needs of its database connections: sessions of its own, and how many of them it holds.

The rule (docs/deploy.md, "Connections and PgBouncer"): the web tier may reach PostgreSQL through a transaction-mode
pool (PgBouncer `pool_mode = transaction`); a worker only directly or through a session-mode pool. A worker relies
on its sessions: a job holds its run's session-level advisory lock on its thread's connection, and every write of a
step checks, in its own statement, that the session it runs in holds that lock (runs.ownership); the worker's LISTEN
connection must keep hearing its channels. Behind a transaction pool a client's next transaction may run on another
server backend, and another client's on this one: a lock taken by one job would be held by a backend that other
clients' transactions then run on, and one of them would take the "same" lock again (advisory locks are re-entrant
within a session). Two jobs would drive one run. So a worker that finds itself behind such a pool refuses to start
(`check_own_sessions`, before it registers or takes a job).

The probe, on two connections A and B of the worker's own pool (so it opens no connection the formula below does
not count), for a few rounds: A runs a statement (its backend, if A does not own one, is now the pool's most
recently freed server), then B opens a transaction and asks for its backend's pid (`pg_backend_pid()`), then A
asks for its own again. In a session pool, or directly, A owns its backend for as long as it is connected: B's pid
is never A's, and A's never changes. In a transaction pool B's transaction is given the server A just freed
(PgBouncer's default reuses the most recently used server; with `server_round_robin` the rounds walk the idle
servers) or A hops to another backend. A statement pool refuses B's transaction block outright. Any of these stops
the worker, naming what it saw. (The pid the server announces at start-up, psycopg's `info.backend_pid`, would tell
a pooler from PostgreSQL, but not a session pool from a transaction pool; `SHOW pool_mode` is PgBouncer's admin
console, not a query that reaches through a pool.) Directly it costs a dozen short queries at start-up.

Connections (docs/deploy.md, "Connections and PgBouncer"; measured by tests/system/test_pgbouncer.py through
`pg_stat_activity`, each connection named by `application_name` as `<name>:<pid>:<role>`): a worker process holds
`connections_per_worker()`: its pool (WORKER_POOL_SIZE, opened at start: the fetch loop, heartbeats, job statuses,
the abort poll, the periodic deferrer, the async stalled-job sweep), one LISTEN connection, and one Django
connection per job thread (a sync job runs on one of the worker's WORKER_CONCURRENCY job threads,
`jobs.worker.JobThreads`, each keeping its connection between jobs for DATABASE_CONN_MAX_AGE seconds; the sync
sweeps run on them too).
"""

from __future__ import annotations

import psycopg
import psycopg_pool
from django.core.exceptions import ImproperlyConfigured
from psycopg.rows import tuple_row

# Rounds of the probe behind a pooler: PgBouncer's default (LIFO reuse) shows a transaction pool in the first;
# more rounds cover round-robin reuse with a few idle servers.
PROBE_ROUNDS = 4
# The roles of a worker's connections, as the last part of their application_name.
ROLES = ("pool", "listen", "job")


class SessionPoolingRequired(ImproperlyConfigured):
    """The worker's connections do not keep their PostgreSQL session (a transaction- or statement-mode pool)."""


def connections_per_worker(concurrency: int, pool_size: int) -> int:
    """The PostgreSQL connections one worker process holds once it has run `concurrency` jobs at once: its pool,
    its LISTEN connection and one per job thread (docs/deploy.md, "Connections and PgBouncer")."""
    return pool_size + 1 + concurrency


def application_name(base: str, pid: int, role: str) -> str:
    """How a worker's connection names itself in pg_stat_activity (63 bytes at most, PostgreSQL's limit)."""
    assert role in ROLES, role
    return f"{base}:{pid}:{role}"[-63:]


def refusal(seen: str) -> str:
    return (
        "This worker's database connections do not keep their PostgreSQL session: the worker is behind a"
        f" transaction- or statement-mode pool (PgBouncer pool_mode = transaction/statement): {seen}. A worker"
        " needs a session of its own (session advisory locks keep one owner per run; LISTEN wakes it), so it will"
        " not start. Point WORKER_DATABASE_URL at PostgreSQL directly or at a session-mode pool (pool_mode ="
        " session); the web tier may keep DATABASE_URL on the transaction pool."
    )


async def _select_pid(connection: psycopg.AsyncConnection) -> int:
    async with connection.cursor(row_factory=tuple_row) as cursor:
        await cursor.execute("SELECT pg_backend_pid()")
        row = await cursor.fetchone()
    assert row is not None
    return row[0]


async def _pid(connection: psycopg.AsyncConnection) -> int:
    """The backend's pid, in a transaction of its own."""
    pid = await _select_pid(connection)
    if not connection.autocommit:
        await connection.commit()  # end the transaction, or a transaction pool would keep A on its server
    return pid


async def check_own_sessions(pool: psycopg_pool.AsyncConnectionPool, rounds: int = PROBE_ROUNDS) -> None:
    """Raises SessionPoolingRequired unless each connection of `pool` keeps one PostgreSQL session (see the module
    docstring for how). Needs two connections of the pool."""
    try:
        await _probe(pool, rounds)
    except psycopg.Error as exc:
        if "pooling mode" not in str(exc):
            raise
        # PgBouncer's statement mode: "transaction blocks not allowed in statement pooling mode".
        raise SessionPoolingRequired(refusal(f"a transaction block was refused ({exc})")) from exc


async def _probe(pool: psycopg_pool.AsyncConnectionPool, rounds: int) -> None:
    async with pool.connection() as first, pool.connection() as second:
        own = await _pid(first)
        for _ in range(rounds):
            own_now = await _pid(first)
            async with second.transaction():
                theirs = await _select_pid(second)
                again = await _pid(first)
            if theirs in (own, own_now):
                raise SessionPoolingRequired(
                    refusal(f"one connection's transaction ran on another's backend (pid {theirs})")
                )
            if own_now != own or again != own:
                raise SessionPoolingRequired(
                    refusal(f"one connection ran on backends {sorted({own, own_now, again})} in turn")
                )
