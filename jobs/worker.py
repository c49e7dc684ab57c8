"""The worker: procrastinate 3.10's worker, with four gaps closed.

* Transactional defers. `manage.py worker` uses `WorkerConnector`: the worker loop (fetch, LISTEN, heartbeats,
  job status) runs on an asyncio psycopg pool, but `get_sync_connector()` is procrastinate's DjangoConnector, so
  a sync `.defer()` in task code (which runs in a worker thread) goes through that thread's Django connection and
  commits or rolls back with the surrounding `transaction.atomic()`. (`manage.py procrastinate worker` swaps the
  app's connector for a plain PsycopgConnector, whose sync calls go to the pool: outside the transaction.)
* Heartbeats while draining. 3.10's `Worker._shutdown` cancels every side task, the heartbeat included, *before*
  it waits for running jobs: a worker given SIGTERM during a long step stops heartbeating, and another worker's
  stalled-job sweep re-queues its live job. Ours keeps heartbeating (and polling abort requests) until its last
  job has ended.
* Database outages. In 3.10 a failed side task stops the worker (the LISTEN connection dies when PostgreSQL
  restarts) and a failed fetch propagates out of `run()`. Ours treats a database error as something to wait out:
  every part retries with a capped backoff, the pool reconnects with a capped backoff, and the outage is logged
  once when it starts and once when it ends, with its duration. Only SIGTERM/SIGINT stop the worker.
* Lost wake-ups. The worker clears its "new job" event *after* each fetch: a job committed while a fetch that
  finds nothing is running notifies, sets the event, and the clear right after erases it, so the job waits for
  the fallback poll (WORKER_POLL_INTERVAL). A decided run must resume at once, so the event is a
  `NotificationLatch`, whose clear() cannot erase a notification that arrived since the previous clear().
* Job threads. procrastinate runs a sync task on the event loop's default executor, asyncio's, whose min(32,
  cores + 4) threads the loop's own work (a DNS lookup for a reconnect) shares: it caps a worker's sync jobs at 6
  on 2 cores whatever WORKER_CONCURRENCY says, and as it starts a thread whenever none has marked itself idle yet,
  it sometimes runs the next job on a new thread, which opens one more Django connection than docs/deploy.md's
  formula. Ours gives jobs exactly WORKER_CONCURRENCY threads of their own (`JobThreads`).

With WORKER_HEARTBEAT_FILE set, the worker also writes its heartbeat to that file, database or not, for a container's
health command (`python -m jobs.healthcheck`, jobs/healthcheck.py).

Every worker of this app is a `Worker` from here: `on_app_ready` (PROCRASTINATE_ON_APP_READY) makes
`app._worker` build one, and `manage.py worker` builds one directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import functools
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg
import psycopg_pool
import structlog
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from procrastinate import App, exceptions, jobs, manager, signals, sql, utils
from procrastinate import worker as procrastinate_worker
from procrastinate.contrib.django.django_connector import DjangoConnector
from procrastinate.contrib.django.utils import connector_params
from procrastinate.psycopg_connector import PsycopgConnector
from psycopg_pool.base import AttemptWithBackoff

from jobs import internals, session_life, sessions
from jobs.healthcheck import HeartbeatFile

log = structlog.get_logger("jobs.worker")

BACKOFF_INITIAL_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 5.0
# How long a call waits for a pool connection before it fails (psycopg_pool's default is 30 s). A worker's pool
# is never exhausted in normal operation, so a wait this long means the database is unreachable: failing sooner
# lets SIGTERM and the outage log react in seconds.
POOL_TIMEOUT_SECONDS = 5.0
# The pool never gives up reconnecting (psycopg_pool's default gives up after 5 minutes and shrinks).
POOL_RECONNECT_TIMEOUT_SECONDS = 10 * 365 * 24 * 3600.0
# SQLSTATEs that mean "the server went away or cannot take us now", as opposed to an error in a query:
# class 08 (connection exception), admin/crash shutdown, cannot connect now, too many connections.
_UNAVAILABLE_SQLSTATES = {"57P01", "57P02", "57P03", "53300"}


def is_connection_error(exc: BaseException) -> bool:
    """True when `exc` (or what it wraps: procrastinate and Django both re-raise driver errors) says the database
    cannot be reached, rather than that a query was wrong."""
    for error in utils.causes(exc):
        if isinstance(error, psycopg_pool.PoolTimeout | psycopg_pool.PoolClosed | psycopg.InterfaceError):
            return True
        if isinstance(error, psycopg.OperationalError):
            # No SQLSTATE: the client library failed (refused, reset, closed), not the server.
            sqlstate = error.sqlstate
            return sqlstate is None or sqlstate.startswith("08") or sqlstate in _UNAVAILABLE_SQLSTATES
        if isinstance(error, OSError):
            return True
    return False


def _is_database_error(exc: BaseException) -> bool:
    if isinstance(exc, ImproperlyConfigured):
        # A refusal to start (InternalsMismatch, SessionPoolingRequired), even one caused by a driver error.
        return False
    return isinstance(exc, exceptions.ConnectorException | psycopg.Error | OSError) or is_connection_error(exc)


def _describe(exc: BaseException) -> str:
    # The deepest error is the driver's, which says what happened; a cancellation in the chain says nothing.
    root = [error for error in utils.causes(exc) if isinstance(error, Exception)][-1]
    return f"{type(root).__name__}: {str(root).strip()}"[:300]


class Backoff:
    """0.5 s, 1 s, 2 s, 4 s, then 5 s for as long as it takes; reset() after a success."""

    def __init__(self, initial: float = BACKOFF_INITIAL_SECONDS, cap: float = BACKOFF_MAX_SECONDS) -> None:
        self.initial = initial
        self.cap = cap
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * 2)
        return delay

    def reset(self) -> None:
        self._next = self.initial


class _CappedAttempt(AttemptWithBackoff):
    # psycopg_pool doubles its reconnection delay without a cap (1, 2, 4, ... 128 s): after a long outage the
    # pool would come back minutes after the server did.
    INITIAL_DELAY = BACKOFF_INITIAL_SECONDS

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, BACKOFF_MAX_SECONDS)


class ReconnectingPool(psycopg_pool.AsyncConnectionPool):
    """The worker's pool: reconnects with a capped backoff, forever."""

    async def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        await super()._add_connection(attempt or _CappedAttempt(timeout=self.reconnect_timeout), growing=growing)


class WorkerConnector(PsycopgConnector):
    """Async calls (the worker loop, async tasks) on a psycopg pool; sync calls (a sync task's `.defer()`, the
    job manager's sync methods) through Django's connection of the calling thread, so they take part in its
    transaction."""

    def __init__(self, *, django_connector: DjangoConnector, listen_application_name: str = "", **kwargs: Any) -> None:
        # The LISTEN connection's name in pg_stat_activity (its own role in the connection count), when given.
        self.listen_application_name = listen_application_name
        kwargs.setdefault("pool_factory", ReconnectingPool)
        kwargs.setdefault("timeout", POOL_TIMEOUT_SECONDS)
        kwargs.setdefault("reconnect_timeout", POOL_RECONNECT_TIMEOUT_SECONDS)
        super().__init__(**kwargs)
        self.django_connector = django_connector

    @classmethod
    def for_django(
        cls,
        django_connector: DjangoConnector,
        *,
        pool_size: int | None = None,
        application_names: dict[str, str] | None = None,
    ) -> WorkerConnector:
        """The worker's connector on Django's connection settings: a pool of `pool_size` connections, all opened at
        start (psycopg_pool's default, 4, when None); `application_names` ("pool", "listen"), when given, name its
        connections in pg_stat_activity."""
        params = connector_params(django_connector.alias)
        names = application_names or {}
        if "pool" in names:
            params["application_name"] = names["pool"]
        sizes = {} if pool_size is None else {"min_size": pool_size, "max_size": pool_size}
        return cls(
            django_connector=django_connector,
            listen_application_name=names.get("listen", ""),
            kwargs=params,
            # Every pool connection's session lives as long as its connection (no idle timeout ends it).
            configure=session_life.configure_async,
            **sizes,
        )

    def get_sync_connector(self) -> DjangoConnector:
        return self.django_connector

    async def open_async(self, pool: psycopg_pool.AsyncConnectionPool | None = None) -> None:
        if self._async_pool or pool:
            await super().open_async(pool)
            return
        self._async_pool = await self._create_pool(self._pool_args)
        # procrastinate waits (30 s, then fails) for the pool's first connections: with the database down, the
        # worker must start anyway, and wait it out like any other outage.
        await self._async_pool.open(wait=False)


class NotificationLatch(asyncio.Event):
    def __init__(self) -> None:
        super().__init__()
        self._set_since_clear = False

    def set(self) -> None:
        self._set_since_clear = True
        super().set()

    def clear(self) -> None:
        if self._set_since_clear:
            # A notification came since the last clear(), maybe during the fetch this clear() follows, whose
            # snapshot may not include its job: stay set for one more fetch.
            self._set_since_clear = False
            return
        super().clear()


class Outage:
    """One outage, however many parts of the worker notice it: logged when the first part fails and when the
    first part succeeds again."""

    def __init__(self, on_end: Callable[[], None]) -> None:
        self.since: float | None = None
        self._on_end = on_end

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    def failed(self, where: str, exc: BaseException) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.warning("database unreachable", where=where, error=_describe(exc))

    def succeeded(self, where: str) -> None:
        if self.since is not None:
            duration = time.monotonic() - self.since
            self.since = None
            log.info("database reachable again", where=where, outage_seconds=round(duration, 3))
            self._on_end()


# Seconds an aborted async job gets to end once the graceful timeout has passed (a cancelled task ends at its next
# await); what still runs then is a sync job's thread, abandoned (Worker._shutdown).
ABANDON_AFTER_SECONDS = 1.0

# True inside a job's asyncio task (set by Worker._process_job): what it submits to the default executor is a job.
_IN_JOB: contextvars.ContextVar[bool] = contextvars.ContextVar("in_job", default=False)


class JobThreads(ThreadPoolExecutor):
    """The worker loop's default executor: what a job submits (procrastinate runs a sync task through asgiref's
    `sync_to_async` on the loop's default executor) runs on `concurrency` threads of its own, each keeping one
    Django connection; anything else (the loop's getaddrinfo) on the general threads, never behind a long job."""

    def __init__(self, concurrency: int) -> None:
        super().__init__(thread_name_prefix="worker-loop")
        self.jobs = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="job")
        self._running: set[Future] = set()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if _IN_JOB.get():
            future = self.jobs.submit(fn, *args, **kwargs)
            self._running.add(future)
            future.add_done_callback(self._running.discard)
            return future
        return super().submit(fn, *args, **kwargs)

    def running(self) -> int:
        """Jobs still running on a job thread (after the graceful timeout: abandoned to the stalled-job sweep)."""
        return sum(1 for future in list(self._running) if not future.done())

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.jobs.shutdown(wait=wait, cancel_futures=cancel_futures)
        super().shutdown(wait=wait, cancel_futures=cancel_futures)


class Worker(procrastinate_worker.Worker):
    def __init__(
        self, *args: Any, keep_notifications: bool = True, heartbeat_file: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        # The heartbeat file for the container's health command (jobs.healthcheck): WORKER_HEARTBEAT_FILE unless
        # given; empty, none.
        path = settings.WORKER_HEARTBEAT_FILE if heartbeat_file is None else heartbeat_file
        self._heartbeat_file = HeartbeatFile(path, log) if path else None
        if keep_notifications:
            self._new_job_event = NotificationLatch()  # procrastinate 3.10 has no hook for this event
        self._outage = Outage(on_end=self._after_outage)
        self.job_threads: JobThreads | None = None  # the loop's default executor, once running (Worker._run)
        self._stop_requested_at: float | None = None
        # After an outage: requeue jobs the database says we run but we do not (a fetch whose answer was lost,
        # a status we gave up writing), and check our worker row is still there.
        self._reconcile_due = False
        self._database_checked = False

    @property
    def stopping(self) -> bool:
        """SIGTERM/SIGINT (or stop()) was received: running jobs should wrap up."""
        return self._stop_event.is_set()

    def stop(self) -> None:
        if self._stop_requested_at is None:
            self._stop_requested_at = time.monotonic()
        super().stop()

    # --- database errors -------------------------------------------------------------------------------------

    def _db_failed(self, where: str, exc: BaseException) -> None:
        if is_connection_error(exc):
            self._outage.failed(where, exc)
        else:
            # A query failed on a reachable database (a bug, a schema mismatch): not an outage, but still no
            # reason to exit; the caller backs off, so this line repeats at most every few seconds.
            log.error("database error", where=where, error=_describe(exc), exc_info=exc)

    def _db_ok(self, where: str) -> None:
        if self._outage.ongoing:
            self._outage.succeeded(where)

    def _after_outage(self) -> None:
        self._reconcile_due = True
        # Notifications sent while we were not listening are lost: look for jobs now.
        self._new_job_event.set()

    async def _sleep(self, seconds: float, *, until_stop: bool) -> None:
        if until_stop:
            await utils.wait_any(asyncio.sleep(seconds), self._stop_event.wait())
        else:
            await asyncio.sleep(seconds)

    async def _retrying(self, where: str, call: Callable[[], Awaitable[Any]], *, until_stop: bool) -> Any:
        """Run `call` until it does not fail with a database error (or, with until_stop, until told to stop:
        then None)."""
        backoff = Backoff()
        while True:
            try:
                result = await call()
            except Exception as exc:
                if not _is_database_error(exc):
                    raise
                self._db_failed(where, exc)
                if until_stop and self._stop_event.is_set():
                    return None
                await self._sleep(backoff.next(), until_stop=until_stop)
                if until_stop and self._stop_event.is_set():
                    return None
            else:
                self._db_ok(where)
                return result

    # --- start ---------------------------------------------------------------------------------------------

    async def run(self) -> None:
        # One signal handler for the whole run, start-up included: with the database down, registration waits,
        # and SIGTERM must still end it.
        handle_signals = self.install_signal_handlers
        self.install_signal_handlers = False  # procrastinate's _run_loop would install a second one
        try:
            with signals.on_stop(self.stop) if handle_signals else contextlib.nullcontext():
                await self._run()
        finally:
            self.install_signal_handlers = handle_signals

    async def _run(self) -> None:
        # As procrastinate's run(), with start-up retried through outages.
        self._stop_event.clear()
        self._stop_requested_at = None
        self._loop = asyncio.get_running_loop()
        self.job_threads = JobThreads(self.concurrency)
        self._loop.set_default_executor(self.job_threads)
        try:
            # A file left by a worker that was killed is not ours: until we have registered, say nothing.
            self._remove_heartbeat_file()
            registered = await self._retrying("register worker", self._register, until_stop=True)
            if registered is None:
                return  # stopped before the database came back
            self._write_heartbeat_file(database_ok=True)  # registering was a heartbeat the database took
            self.run_task = asyncio.current_task()
            loop_task = asyncio.create_task(self._run_loop(), name="worker loop")
            try:
                await asyncio.shield(loop_task)
            except asyncio.CancelledError:
                self.stop()
                await loop_task
                raise
        finally:
            # Stopped (or failed): the health command must not take the last beats for a live worker.
            self._remove_heartbeat_file()
            self._loop = None

    async def _register(self) -> int:
        if not self._database_checked:
            # Once per worker, before it takes a job: the SQL functions, types and columns we use are as we expect
            # (an InternalsMismatch is no database error: it stops the worker, naming what differs), and our
            # connections keep their sessions (not behind a transaction pool: SessionPoolingRequired stops it), no
            # idle timeout ends them, and a closed one's locks end with it (not behind a session pool that keeps
            # them: LocksOutliveSessions stops it).
            if isinstance(self.app.connector, PsycopgConnector):
                pool = self.app.connector.pool
                await sessions.check_own_sessions(pool)
                await session_life.check_idle_timeouts_off(pool)
                await session_life.check_locks_end_with_sessions(pool)
            await internals.check_database_async(self.app.connector)
            self._database_checked = True
            log.info(session_life.POOLER_RULES)
        pruned = await self.app.job_manager.prune_stalled_workers(self.stalled_worker_timeout)
        if pruned:
            log.info("pruned stalled workers", worker_ids=pruned)
        self.worker_id = await self.app.job_manager.register_worker()
        return self.worker_id

    # --- fetching ------------------------------------------------------------------------------------------

    async def _fetch_and_process_jobs(self) -> None:
        backoff = Backoff()
        while not self._stop_event.is_set():
            try:
                if self._reconcile_due:
                    await self._reconcile()
                await super()._fetch_and_process_jobs()
            except Exception as exc:
                if not _is_database_error(exc):
                    raise
                self._db_failed("fetch jobs", exc)
                await self._sleep(backoff.next(), until_stop=True)
                continue
            if not self._stop_event.is_set():
                self._db_ok("fetch jobs")
            return

    async def _reconcile(self) -> None:
        """After an outage, from the fetch loop (so no fetch is in flight): a job the database marks as ours and
        `doing` that we do not run would otherwise stay `doing` for as long as our heartbeat lives."""
        connector = self.app.connector
        assert self.worker_id is not None
        if not await self._own_row_exists():
            # Another worker pruned us as stalled while our heartbeats failed: the database set worker_id to
            # NULL on our jobs, so the sweep may requeue them. Register again and claim back what we still run.
            old_id = self.worker_id
            self.worker_id = await self.app.job_manager.register_worker()
            running = [context.job.id for context in self._running_jobs.values()]
            if running:
                await connector.execute_query_async(
                    "UPDATE procrastinate_jobs SET worker_id = %(worker_id)s"
                    " WHERE id = ANY(%(job_ids)s) AND status = 'doing' AND worker_id IS NULL",
                    worker_id=self.worker_id,
                    job_ids=running,
                )
            log.warning("worker row was pruned during the outage: registered again", old=old_id, new=self.worker_id)
        rows = await connector.execute_query_all_async(
            "SELECT id FROM procrastinate_jobs WHERE worker_id = %(worker_id)s AND status = 'doing'",
            worker_id=self.worker_id,
        )
        running = {context.job.id for context in self._running_jobs.values()}
        for row in rows:
            if row["id"] not in running:
                await self.app.job_manager.retry_job_by_id_async(
                    job_id=row["id"], retry_at=datetime.datetime.now(datetime.UTC)
                )
                log.warning("requeued a job this worker no longer runs", job_id=row["id"], cause="database outage")
        self._reconcile_due = False

    async def _own_row_exists(self) -> bool:
        rows = await self.app.connector.execute_query_all_async(
            "SELECT id FROM procrastinate_workers WHERE id = %(worker_id)s", worker_id=self.worker_id
        )
        return bool(rows)

    async def _process_job(self, context: Any) -> None:
        _IN_JOB.set(True)  # this job's own task: its sync task runs on a job thread (JobThreads)
        await super()._process_job(context)

    async def _persist_job_status(self, **kwargs: Any) -> None:
        # A job's outcome is not lost to an outage: retried until the database is back (a job left `doing`
        # under a live heartbeat would never be picked up again). Once told to stop, we wait at most the
        # graceful timeout; then the job stays `doing`, our heartbeat stops when we exit, and the stalled-job
        # sweep of another worker requeues it, as after a crash.
        backoff = Backoff()
        while True:
            try:
                await super()._persist_job_status(**kwargs)
            except exceptions.UniqueViolation:
                # The job was to be retried, but another job of the same queueing lock already waits (its run was
                # re-enqueued meanwhile): that one carries on. This one must leave `doing`, or its lock would keep
                # the waiting one from ever starting.
                await self.app.job_manager.finish_job(job=kwargs["job"], status=jobs.Status.FAILED, delete_job=False)
                log.warning("a retry found a newer job of its lock waiting: finished this one", job_id=kwargs["job"].id)
                return
            except Exception as exc:
                if not _is_database_error(exc):
                    raise
                self._db_failed("persist job status", exc)
                if not is_connection_error(exc) or self._drain_expired():
                    # The write failed on a reachable database (e.g. the job is not `doing` any more: an
                    # earlier attempt did commit), or we may wait no longer.
                    log.error("could not record a job's outcome", job_id=kwargs["job"].id, error=_describe(exc))
                    self._reconcile_due = True
                    return
                await asyncio.sleep(backoff.next())
            else:
                self._db_ok("persist job status")
                return

    def _drain_expired(self) -> bool:
        if self._stop_requested_at is None:
            return False
        timeout = self.shutdown_graceful_timeout or 0
        return time.monotonic() - self._stop_requested_at > timeout

    # --- side tasks -----------------------------------------------------------------------------------------

    async def _update_heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.update_heartbeat_interval)
            # The loop turned: the file says so before the database call, which may hang until a pool or TCP
            # timeout during an outage, and a worker waiting out an outage is alive.
            self._write_heartbeat_file(database_ok=False)
            try:
                assert self.worker_id is not None
                await self.app.job_manager.update_heartbeat(self.worker_id)
            except Exception as exc:
                if not _is_database_error(exc):
                    raise
                self._db_failed("heartbeat", exc)
            else:
                self._db_ok("heartbeat")
                self._write_heartbeat_file(database_ok=True)

    def _write_heartbeat_file(self, *, database_ok: bool) -> None:
        # A small write to a local file, on the event loop: microseconds, not worth a thread.
        if self._heartbeat_file is not None:
            self._heartbeat_file.beat(self.worker_id, database_ok=database_ok)

    def _remove_heartbeat_file(self) -> None:
        if self._heartbeat_file is not None:
            self._heartbeat_file.remove()

    async def _periodic_deferrer(self) -> None:
        await self._retrying("periodic deferrer", super()._periodic_deferrer, until_stop=False)

    async def _poll_jobs_to_abort(self) -> None:
        # As procrastinate's, with database errors counted as an outage rather than logged on every poll.
        while True:
            await asyncio.sleep(self.abort_job_polling_interval)
            if not self._running_jobs:
                continue
            try:
                job_ids = await self.app.job_manager.list_jobs_to_abort_async()
            except Exception as exc:
                if not _is_database_error(exc):
                    raise
                self._db_failed("poll jobs to abort", exc)
                continue
            self._db_ok("poll jobs to abort")
            self._handle_abort_jobs_requested(job_ids)

    async def _listen(self) -> None:
        """LISTEN for new jobs and abort requests; when the connection dies, connect again with a backoff."""
        backoff = Backoff()

        def on_listening() -> None:
            backoff.reset()
            self._db_ok("listener")
            # Jobs inserted while we were not listening sent notifications nobody heard.
            self._new_job_event.set()

        while True:
            try:
                await _listen_once(self.app, self.queues, self._handle_notification, on_listening)
            except Exception as exc:
                if not _is_database_error(exc):
                    raise
                self._db_failed("listener", exc)
                await asyncio.sleep(backoff.next())
            # Else the connection died (e.g. PostgreSQL restarted): connect again at once; if the server is
            # gone, that attempt fails and the backoff starts.

    def _start_side_tasks(self) -> list[asyncio.Task[Any]]:
        side_tasks = [
            asyncio.create_task(self._update_heartbeat(), name="update_heartbeats"),
            asyncio.create_task(self._periodic_deferrer(), name="deferrer"),
            asyncio.create_task(self._poll_jobs_to_abort(), name="poll_jobs_to_abort"),
        ]
        if self.listen_notify:
            side_tasks.append(asyncio.create_task(self._listen(), name="listener"))
        return side_tasks

    # --- stop ----------------------------------------------------------------------------------------------

    async def _shutdown(self, side_tasks: list[asyncio.Task[Any]]) -> None:
        """As procrastinate's, except that the heartbeat and the abort poll keep running until the last job has
        ended: a draining worker is alive, and its jobs must not look stalled."""
        draining_names = {"update_heartbeats", "poll_jobs_to_abort"}
        draining = [task for task in side_tasks if task.get_name() in draining_names]
        await utils.cancel_and_capture_errors([task for task in side_tasks if task not in draining])

        now = time.time()
        for context in self._running_jobs.values():
            log.info(
                "waiting for a job to finish",
                job_id=context.job.id,
                task=context.job.task_name,
                started_seconds_ago=round(now - context.start_timestamp, 3),
            )
        if self._running_jobs:
            await asyncio.wait(self._running_jobs, timeout=self.shutdown_graceful_timeout)
        if self._running_jobs:
            log.info("jobs still running after the graceful timeout: aborting them", count=len(self._running_jobs))
            # procrastinate cancels an async job, and waits for a sync one as long as it runs: a step on a job
            # thread cannot be interrupted (a run stops between steps). Such a job is left `doing`: the worker
            # unregisters (the job's worker_id becomes NULL: stalled at once for another worker's sweep) and
            # `manage.py worker` exits at once, as the supervisor's SIGKILL would have ended it, instead of
            # outliving its own timeout (jobs/management/commands/worker.py).
            abort = asyncio.ensure_future(self._abort_running_jobs())
            done, _ = await asyncio.wait([abort], timeout=ABANDON_AFTER_SECONDS)
            if not done:
                log.warning(
                    "jobs left running past the graceful timeout: abandoned to the stalled-job sweep",
                    count=len(self._running_jobs),
                    job_ids=sorted(context.job.id for context in self._running_jobs.values()),
                )

        await utils.cancel_and_capture_errors(draining)

        assert self.worker_id is not None
        try:
            unregister = self.app.job_manager.unregister_worker(self.worker_id)
            # In an outage, do not keep SIGTERM waiting for a pool timeout: the row is only a courtesy.
            await asyncio.wait_for(unregister, timeout=1 if self._outage.ongoing else None)
        except Exception as exc:
            if not _is_database_error(exc):  # (a TimeoutError is an OSError: counted as one)
                raise
            # The row stays; its heartbeat goes stale and other workers prune it.
            log.warning("could not unregister the worker", worker_id=self.worker_id, error=_describe(exc))
        self.worker_id = None
        self.logger.info(
            f"Stopped worker on {utils.queues_display(self.queues)}",
            extra=self._log_extra(action="stop_worker", queues=self.queues, context=None, job_result=None),
        )


async def _listen_once(
    app: App,
    queues: Iterable[str] | None,
    handle: Callable[..., Awaitable[None]],
    on_listening: Callable[[], None],
) -> None:
    """One LISTEN session: returns when its connection dies, raises when it cannot connect. (procrastinate's
    PsycopgConnector.listen_notify reconnects at once in a loop of its own, and fails, which ends the worker,
    when that reconnection does.)"""
    connector = app.connector
    if not isinstance(connector, PsycopgConnector):
        # Not a connector we can open connections on: procrastinate's loop, without the "listening" signal.
        await app.job_manager.listen_for_jobs(on_notification=handle, queues=queues)
        return

    async def on_notification(*, channel: str, payload: str) -> None:
        notification: jobs.Notification = json.loads(payload)
        await handle(channel=channel, notification=notification)

    try:
        async with connector._get_standalone_connection() as connection:
            # This session must live as long as the connection, as every other of the worker's. (procrastinate
            # 3.10 runs the pool's `configure` on it too; a second time costs one short query per connection.)
            await session_life.configure_async(connection)
            if name := getattr(connector, "listen_application_name", ""):
                await connection.execute("SELECT set_config('application_name', %s, false)", [name])
            for channel in manager.get_channel_for_queues(queues=queues):
                await connection.execute(
                    connector._make_dynamic_query(query=sql.queries["listen_queue"], channel_name=channel)
                )
            on_listening()
            await connector._loop_notify(on_notification=on_notification, connection=connection)
    except psycopg.Error as exc:
        raise exceptions.ConnectorException from exc


def on_app_ready(app: App) -> None:
    """PROCRASTINATE_ON_APP_READY: every worker of this app is a `Worker` from here."""
    app._worker = functools.partial(make_worker, app)  # procrastinate 3.10 has no hook for the worker class


def make_worker(app: App, **options: Any) -> Worker:
    # As App._worker: the app's defaults (for the Django app, its connection clean-up middlewares) first.
    return Worker(app=app, **{**app.worker_defaults, **options})
