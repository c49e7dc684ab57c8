"""Group commit of run submissions (issue 30): the runs that concurrent requests of one web process submit, with
their first jobs, written together in one statement, one commit and one wake-up for the workers.

Why: a transaction that notifies commits alone (PostgreSQL takes a database-wide lock for its NOTIFY queue from
before the commit's WAL flush to its end), so a run per transaction is bounded by how many flushes a second the
server makes one after another (bench/notify_probe.py; docs/PROFILE-api.md). Many runs per transaction pay that
once. Procrastinate's insert trigger notifies per job; our body of it (jobs/migrations/0003) sends one payload
that PostgreSQL folds to one notification per transaction.

How, with no thread of its own: the first request to come finds no batch being written and writes its own run at
once (no added wait when there is no concurrency). Requests that come while a batch is being written queue; when
it commits, the first of them writes every run queued by then (up to GROUP_COMMIT_MAX_RUNS), on its own
connection, in autocommit, as one statement (runs/sql/queries.sql: insert_runs_with_first_jobs). Each request
returns only after the statement that holds its run has committed, so no answer comes before durability, and a
process killed mid-batch has answered none of that batch: its statement committed whole or not at all.

What each request gets is what `submission.submit` would have given it alone:
* its run inserted: created;
* its run skipped (ON CONFLICT DO NOTHING: its idempotency key is held by a committed run, or by a run earlier in
  the same batch): `Duplicate`, and `submit` settles it as a duplicate key (the same run, or 409);
* the statement lost with its connection: `Lost`, and the request settles its own run's fate on a connection of
  its own, as `submit` does for a single run (the run's primary key is the fence: runs.submission._insert_again);
* the statement failed otherwise (a value one request brought that the database refuses): `Alone`, and every
  request of the batch writes its run by itself, so each gets its own error and the others are unaffected.

Webhook deliveries and approval-request asks write more than a run (the delivery's dedup row, the request, its
card), so they are grouped another way (`atomic`): each request's work runs in a savepoint of its own inside one
transaction on the leading request's connection and thread, in the requester's context (log fields, trace), and
its result or exception goes back to its request once that transaction committed. A transaction that did not
commit leaves each request to do its work again by itself, which its own key makes safe (the delivery id, the
idempotency key). Grouped or not, each kind keeps its own queue: a batch is all runs or all works.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import DatabaseError, IntegrityError, InterfaceError, connection, transaction

from jobs.worker import is_connection_error
from runs.sql import queries


class Duplicate(IntegrityError):
    """The run was skipped: its idempotency key is taken (runs.submission settles it)."""


class Lost(DatabaseError):
    """The batch's statement was in flight when its connection was lost: whether it committed is unknown."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class Alone(Exception):
    """The batch failed for a reason that is not the request's own (a run the database refused: Lost aside; a
    work's transaction that could not commit): write this one by itself."""


@dataclass(eq=False)
class _Entry:
    done: threading.Event = field(default_factory=threading.Event, init=False)
    error: BaseException | None = field(default=None, init=False)
    batch: int = field(default=0, init=False)  # the number of entries of the transaction that held it, once written


@dataclass(eq=False)
class _Run(_Entry):
    run: Any
    sql: str
    params: list
    job: list  # runs.submission.first_job_row
    job_id: int | None = field(default=None, init=False)


@dataclass(eq=False)
class _Work(_Entry):
    work: Callable[[], Any]
    context: contextvars.Context
    result: Any = field(default=None, init=False)


class GroupCommit:
    """Entries of concurrent requests written by `write(batch)` in one transaction, one batch at a time."""

    def __init__(self, write: Callable[[list], None], max_entries: int):
        self.write = write
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._queue: list[_Entry] = []
        self._writing = False

    def submit(self, entry: _Entry) -> None:
        """Returns once `entry` was written (its `batch` set) or failed (raises its error)."""
        with self._lock:
            self._queue.append(entry)
            lead = not self._writing
            if lead:
                self._writing = True
        while True:
            if lead:
                self._lead()
            entry.done.wait()  # set at once for a leader's own entry
            if entry.batch or entry.error is not None:
                break
            # Woken to lead: the batch before ours was full, and ours comes next.
            lead = True
        if entry.error is not None:
            raise entry.error

    def _lead(self) -> None:
        """Write the queued entries (up to max_entries), then hand the lead to the next queued entry, if any."""
        with self._lock:
            batch, self._queue = self._queue[: self.max_entries], self._queue[self.max_entries :]
        try:
            self.write(batch)
        except BaseException as exc:  # every request must be answered, whatever happened
            for entry in batch:
                if entry.error is None and not entry.batch:
                    entry.error = exc
            raise
        finally:
            with self._lock:
                waiting = self._queue[0] if self._queue else None
                if waiting is None:
                    self._writing = False
            for entry in batch:
                entry.done.set()
            if waiting is not None:
                waiting.done.set()  # its thread leads the next batch (its `batch` is still 0)


def _write_runs(batch: list[_Run]) -> None:
    """The runs' one statement, on this thread's connection, in autocommit: its own implicit transaction."""
    head, values = batch[0].sql.split(" VALUES ", 1)
    insert = f"{head} VALUES {', '.join([values] * len(batch))}"
    params = [p for entry in batch for p in entry.params]
    columns = [[entry.run.pk for entry in batch]] + [[entry.job[k] for entry in batch] for k in range(6)]
    pk = connection.ops.quote_name(type(batch[0].run)._meta.pk.column)
    try:
        with connection.cursor() as cursor:
            cursor.execute(queries["insert_runs_with_first_jobs"].format(insert=insert, pk=pk), [*params, *columns])
            jobs = dict(cursor.fetchall())
    except (DatabaseError, InterfaceError) as exc:  # (Django's InterfaceError is not a DatabaseError)
        failure: BaseException = Lost(exc) if is_connection_error(exc) else Alone(str(exc))
        for entry in batch:
            entry.error = failure
        return
    for entry in batch:
        entry.batch = len(batch)
        job_id = jobs.get(entry.run.pk)
        if job_id is None:
            entry.error = Duplicate(f"run {entry.run.pk}: its idempotency key is taken")
        else:
            entry.job_id = job_id


def _write_work(batch: list[_Work]) -> None:
    """Each entry's work in a savepoint of its own, all in one transaction on this thread's connection, each in
    its requester's context (its log fields, its trace). A work that raises is rolled back alone and raises in
    its request; a transaction that did not commit leaves each request to do its work again, by itself."""
    committed: list[bool] = []
    failure: BaseException | None = None
    try:
        with transaction.atomic():
            transaction.on_commit(lambda: committed.append(True))
            for entry in batch:
                try:
                    with transaction.atomic():
                        entry.result = entry.context.run(entry.work)
                except Exception as exc:  # noqa: BLE001 (its request's to raise)
                    entry.error = exc
    except (DatabaseError, InterfaceError) as exc:
        failure = exc
    if failure is not None or not committed:
        # (A connection lost inside the transaction ends it without an error here: Django leaves the rollback to
        # the server. Hence the commit hook.)
        if failure is None or is_connection_error(failure):
            connection.close()  # this thread's, lost: its own request does its work again on a new one
        for entry in batch:
            entry.error = Alone(str(failure or "the transaction did not commit"))
        return
    for entry in batch:
        entry.batch = len(batch)


RUNS = GroupCommit(_write_runs, settings.GROUP_COMMIT_MAX_RUNS)
WORK = GroupCommit(_write_work, settings.GROUP_COMMIT_MAX_RUNS)


def insert(run, sql: str, params: list, job: list) -> tuple[int, int]:
    """Write the unsaved `run` (its INSERT as `sql` with `params`, its first job's row `job`) with whatever other
    requests' runs queued; (the job's id, the number of runs in the statement) once it has committed. Raises
    Duplicate, Lost or Alone (above)."""
    entry = _Run(run, sql, params, job)
    RUNS.submit(entry)
    assert entry.job_id is not None
    return entry.job_id, entry.batch


def atomic[T](work: Callable[[], T]) -> T:
    """`work()` in a transaction, as `with transaction.atomic(): return work()` would run it, but in one
    transaction with the works other requests of this process hand in at the same time (each in a savepoint of
    its own, in its requester's context, on the leading request's connection and thread). Its result or its
    exception once that transaction committed. When the transaction cannot commit (a lost connection, a deadlock
    between two batches), whether `work` was written is unknown, and it runs again by itself: so `work` must be
    idempotent by a key of its own (a webhook's delivery id, an approval request's idempotency key), and must not
    hold on to the connection. Inside a caller's transaction, or with GROUP_COMMIT off, it is simply run there."""
    if not settings.GROUP_COMMIT or connection.in_atomic_block:
        with transaction.atomic():
            return work()
    entry = _Work(work, contextvars.copy_context())
    try:
        WORK.submit(entry)
    except Alone:
        with transaction.atomic():
            return work()
    return entry.result
