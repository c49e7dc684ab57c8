"""The check the web server's connection pool runs on a connection before handing it out (settings: DATABASE_POOL).

psycopg_pool's own check (what Django sets with CONN_HEALTH_CHECKS) sends an empty query: one round trip to
PostgreSQL before every request's first query, 2.9 % of `POST /api/runs`'s wall clock under load and a third of
its statements (docs/PROFILE-api.md). This one looks first at what the client already knows, without a round trip:
the connection is not closed or broken, not inside a transaction, and its socket has nothing to read. An idle
connection's socket becomes readable only when the server sent something unasked: when it closed the connection
(a restart, a crash, `pg_terminate_backend`: an error message then end of file, or just the end of file) or a
notice. Only then does it run psycopg_pool's check, which raises on a dead connection (the pool then drops it
and hands out another) and reads a notice away on a live one.

What it cannot see, like the empty query could not before a timeout: a server that vanished without closing its
connections (a machine gone from the network); the request's first query then fails, and the pool drops the
connection when it comes back.
"""

from __future__ import annotations

import select

import psycopg
from psycopg.pq import ConnStatus, TransactionStatus
from psycopg_pool import ConnectionPool


def check_connection(conn: psycopg.Connection) -> None:
    if conn.closed or conn.broken or conn.pgconn.status != ConnStatus.OK:
        raise psycopg.OperationalError("the connection is closed")
    if conn.info.transaction_status == TransactionStatus.IDLE and not _readable(conn.fileno()):
        return
    ConnectionPool.check_connection(conn)


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))
