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
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DatabaseError, IntegrityError, InterfaceError, connection

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
    """The batch's statement failed for a reason that is not the connection's: write this run by itself."""


@dataclass(eq=False)
class _Entry:
    run: object
    sql: str
    params: list
    job: list
    done: threading.Event = field(default_factory=threading.Event)
    job_id: int | None = None
    error: BaseException | None = None
    batch: int = 0


class GroupCommit:
    """One per web process (`GROUP`)."""

    def __init__(self, max_runs: int):
        self.max_runs = max_runs
        self._lock = threading.Lock()
        self._queue: list[_Entry] = []
        self._writing = False

    def insert(self, run, sql: str, params: list, job: list) -> tuple[int, int]:
        """Write the unsaved `run` (its INSERT as `sql` with `params`, its first job's row `job`) with whatever
        other requests queued; (the job's id, the number of runs in the statement) once it has committed.
        Raises Duplicate, Lost or Alone (above)."""
        entry = _Entry(run, sql, params, job)
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
            # Woken to lead: the batch before ours committed without us (it was full).
            lead = True
        if entry.error is not None:
            raise entry.error
        assert entry.job_id is not None
        return entry.job_id, entry.batch

    def _lead(self) -> None:
        """Write every queued entry (up to max_runs), then hand the lead to the next queued entry, if any."""
        with self._lock:
            batch, self._queue = self._queue[: self.max_runs], self._queue[self.max_runs :]
        try:
            _write(batch)
        except BaseException as exc:  # noqa: BLE001 (every request must be answered, whatever happened)
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


def _write(batch: list[_Entry]) -> None:
    """The batch's one statement, on this thread's connection, in autocommit: its own implicit transaction."""
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


def job_row(job) -> list:
    """The columns of `insert_runs_with_first_jobs`'s job arrays for procrastinate's job `job`, run id aside."""
    return [job.queue, job.task_name, job.priority, job.lock, job.queueing_lock, json.dumps(job.task_kwargs)]


GROUP = GroupCommit(max_runs=settings.GROUP_COMMIT_MAX_RUNS)
