"""The long-poll's waiters (`GET /api/approval-requests/{id}?wait=N`, held by console/long_poll.py): who is waiting
for which request, and the one LISTEN session per web process that wakes them when a request's card changes
status.

Why: a waiting agent must hold neither a thread nor a database connection. Before issue 24 each waiting long-poll
held a thread and looked at its request five times a second: with a few hundred agents waiting, the reviewers'
calls queued behind those looks for the pool's connections.

How: a trigger on `approvals_approval` (migration external 0002) runs `pg_notify(CHANNEL, <request id>)` in the
transaction that changes an external request's card status, whatever changes it (a decision from any view, the
SLA timer or sweep, a cancellation, a bulk update, SQL by hand), so the notification is sent exactly when that
transaction commits. A waiter registers before its first look at the request: a change committed after the look
is announced to it, and one committed before is what the look sees. The listener is an asyncio task on the
server's event loop with a psycopg AsyncConnection of its own, started by the first long-poll; it connects again
with a backoff when its session ends (a restart of PostgreSQL, `pg_terminate_backend`, a network fault that the
TCP keepalives reveal), and every time it starts listening it wakes every waiter, since what was committed while
nobody listened was announced to nobody. While it does not listen (before it first connects, between two
sessions, or for good when no URL keeps a session), it wakes every waiter every FALLBACK_SECONDS instead: coarse
polling, not a lost decision. While it listens, a waiter nobody wakes costs nothing until its wait ends: PostgreSQL
delivers every notification committed after a LISTEN to that session for as long as it lives, and a session that
dies (even silently: the keepalives) makes the next one wake everybody. (A timer per waiter "in case", a look
every 25 s each, would cost 1,000 waiting agents 40 looks a second.)

LISTEN needs a session of its own: behind a transaction-mode pool (DATABASE_TRANSACTION_POOL=1, PgBouncer) a
LISTEN is forgotten when its transaction ends. The listener uses DATABASE_URL unless it goes through such a pool,
else WORKER_DATABASE_URL (PostgreSQL itself or a session pool, as workers need: docs/deploy.md, "Connections and
PgBouncer"); with neither, long-polls run on the fallback alone (and it says so once, in the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import psycopg
import structlog
from django.conf import settings

log = structlog.get_logger("external.waiters")

CHANNEL = "external_request_status"  # also in migration external 0002 (its trigger)
# The header the server's edge (console/long_poll.py) puts on each pass of a long-poll through Django: the view
# then answers at once, as the edge does the waiting. (A client that sends it itself only gets an answer at once.)
EDGE_HEADER = "X-Long-Poll-Pass"
FALLBACK_SECONDS = 5.0  # while the listener does not listen, every waiter looks again this often
BACKOFF_SECONDS = (0.5, 1.0, 2.0, 4.0, 5.0)  # between two attempts to connect; the last one repeats
# The client's side of a dead connection: libpq's TCP keepalives end a session whose server vanished without
# closing it (a machine gone from the network) within ~25 s, as the server's own probes do (console/settings.py),
# and an attempt to connect to an unreachable host gives up after 10 s. Settings of the URL win over these.
LIBPQ_DEFAULTS = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "connect_timeout": 10,
}
# Options of Django's DATABASES entry that are Django's or the pool's, not libpq's.
NOT_LIBPQ = {"pool", "isolation_level", "assume_role", "server_side_binding", "cursor_factory", "context"}


@dataclass(eq=False)
class Waiter:
    """One long-poll's wait: `woken` is set when its request may have changed."""

    request_id: str
    generation: int  # the session that listened at the waiter's last look, -1: none (Listener.mark)
    woken: asyncio.Event = field(default_factory=asyncio.Event)


class Listener:
    """The waiters of one event loop and the LISTEN session that wakes them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiting: dict[str, set[Waiter]] = {}
        self.listening = False
        self.generation = 0  # +1 each time a session starts listening
        self._task: asyncio.Task | None = None
        self._fallback_task: asyncio.Task | None = None
        self._failures = 0  # attempts to connect that failed since the last session listened

    @contextlib.contextmanager
    def waiter(self, request_id: str) -> Iterator[Waiter]:
        """Register a waiter for `request_id` (before the first look: see the module's docstring)."""
        self._start()
        waiter = Waiter(str(request_id), -1)
        self.waiting.setdefault(waiter.request_id, set()).add(waiter)
        try:
            yield waiter
        finally:
            mine = self.waiting.get(waiter.request_id)
            if mine is not None:
                mine.discard(waiter)
                if not mine:
                    del self.waiting[waiter.request_id]

    async def wait(self, waiter: Waiter, timeout: float) -> bool:
        """Until `waiter` is woken (True) or `timeout` seconds pass (False). Clears it for the next wait."""
        if not self.listening:
            timeout = min(timeout, FALLBACK_SECONDS)  # (the listener's ticks wake it too, meanwhile)
        try:
            await asyncio.wait_for(waiter.woken.wait(), max(0.0, timeout))
        except TimeoutError:
            return False
        finally:
            woken = waiter.woken.is_set()
            waiter.woken.clear()
        return woken

    def mark(self, waiter: Waiter) -> None:
        """Note, just before a look, which session listens (if any): see heard_everything_since."""
        waiter.generation = self.generation if self.listening else -1

    def heard_everything_since(self, waiter: Waiter) -> bool:
        """Whether every change committed since the waiter's last look would have woken it: one session listened
        all along. Then a waiter never woken has nothing new to look at."""
        return self.listening and waiter.generation == self.generation

    def wake(self, request_id: str) -> None:
        for waiter in self.waiting.get(request_id, ()):
            waiter.woken.set()

    def wake_all(self) -> None:
        for waiters in self.waiting.values():
            for waiter in waiters:
                waiter.woken.set()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._run(), name="long-poll listener")

    async def _run(self) -> None:
        params = connection_params()
        if self._fallback_task is None or self._fallback_task.done():
            self._fallback_task = self.loop.create_task(self._fallback(), name="long-poll fallback")
        if params is None:
            log.warning(
                "long-poll listener: no database URL keeps a session (DATABASE_URL is a transaction pool and"
                " WORKER_DATABASE_URL is unset): waiting agents look again every few seconds instead",
                every_seconds=FALLBACK_SECONDS,
            )
            return
        while True:
            try:
                await self._listen(params)
            except Exception as exc:  # a database error, or anything else: the listener must not die of it
                delay = BACKOFF_SECONDS[min(self._failures, len(BACKOFF_SECONDS) - 1)]
                self._failures += 1
                log.warning(
                    "long-poll listener: no session",
                    error=f"{type(exc).__name__}: {str(exc).strip()[:300]}",
                    retry_in_s=delay,
                )
                await asyncio.sleep(delay)

    async def _listen(self, params: dict) -> None:
        conn = await psycopg.AsyncConnection.connect(**params, autocommit=True)
        try:
            await conn.execute(f"LISTEN {CHANNEL}")
            self.listening, self._failures = True, 0
            self.generation += 1
            log.info("long-poll listener: listening", channel=CHANNEL, waiting=len(self.waiting))
            self.wake_all()  # what was committed while nobody listened was announced to nobody
            # notifies() raises OperationalError when the session ends: the first attempt to connect again comes
            # after the backoff's first step, and the later ones wait longer while the server stays away.
            async for notification in conn.notifies():
                self.wake(notification.payload)
        finally:
            self.listening = False
            with contextlib.suppress(Exception):
                await conn.close()

    async def _fallback(self) -> None:
        """While nobody listens, wake every waiter every FALLBACK_SECONDS: those that began waiting while a session
        listened would otherwise wait for the next session, or for the end of their wait. (Not at each attempt to
        connect: during an outage their looks would only find the database away.)"""
        while True:
            await asyncio.sleep(FALLBACK_SECONDS)
            if not self.listening:
                self.wake_all()


def connection_params() -> dict | None:
    """psycopg's connect() arguments for the listener's session, or None when no URL keeps a session (see the
    module's docstring)."""
    if not settings.DATABASES["default"].get("DISABLE_SERVER_SIDE_CURSORS"):
        entry = settings.DATABASES["default"]  # DATABASE_URL, as Django reaches it (the test database too)
        params = {k: v for k, v in entry.get("OPTIONS", {}).items() if k not in NOT_LIBPQ}
        params |= {"dbname": entry["NAME"], "user": entry["USER"], "password": entry["PASSWORD"]}
        params |= {"host": entry["HOST"], "port": entry["PORT"]}
    elif settings.WORKER_DATABASE_URL:
        params = {"conninfo": settings.WORKER_DATABASE_URL}  # a libpq URL; the keywords below add to it
    else:
        return None
    params = {**LIBPQ_DEFAULTS, **params}  # (libpq ignores the keepalives on a unix socket)
    # Its role in pg_stat_activity, as the workers name theirs (docs/deploy.md, "Connections and PgBouncer").
    params["application_name"] = f"web:{os.getpid()}:listen"
    return {k: v for k, v in params.items() if v not in (None, "")}


_listener: Listener | None = None


def listener() -> Listener:
    """The running event loop's listener (one per web process: uvicorn runs one loop in each)."""
    global _listener
    loop = asyncio.get_running_loop()
    if _listener is None or _listener.loop is not loop:
        _listener = Listener(loop)
    return _listener
