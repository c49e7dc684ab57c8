"""A new run and its first job in one statement: the enqueue path's single round trip (issue 11).

`Run.submit` used to open a transaction, INSERT the run, take a savepoint, defer `advance_run` through
Procrastinate's Django connector, release the savepoint and commit: six round trips, each with its share of
Django's and PostgreSQL's per-statement work, on a path whose baseline is one INSERT. Here the run's INSERT (the
SQL Django's compiler writes for `run.save(force_insert=True)`: the same columns, defaults and `pre_save` values)
and the job's defer (Procrastinate's own stored procedure, `procrastinate_defer_jobs_v1`, which `.defer()` calls
too) go as one statement, a data-modifying CTE: atomic by itself in autocommit (one implicit transaction, one
commit), or part of the caller's transaction when there is one.

No savepoint for the job: its queueing lock is `run:<id>` for a run that did not exist until this statement, so
no other job can hold it (a savepoint only existed to survive AlreadyEnqueued, which cannot happen here). A
duplicate idempotency key fails the whole statement (IntegrityError): neither the run nor its job is written.

The job is the one `Run.enqueue` defers (same task, queue, lock, queueing lock, priority and arguments);
tests/test_api_runs.py compares them. Runs has no save signals for this to skip (a receiver added later would
need `Run.submit` to go back to `save()`).
"""

from __future__ import annotations

import json

import structlog
from django.db import connection
from django.db.models.sql import InsertQuery

from runs.sql import queries

log = structlog.get_logger("runs.outbox")


def insert_with_first_job(run) -> int:
    """INSERT the unsaved `run` and defer its `advance_run` job in one statement; the job's id."""
    from runs.tasks import advance_run

    model = type(run)
    meta = model._meta
    assert run._state.adding and run.pk is not None, "a new run, its primary key set (uuid4 default)"
    fields = [f for f in meta.local_concrete_fields if not f.generated]
    query = InsertQuery(model)
    query.insert_values(fields, [run])
    # as_sql() calls each field's pre_save(run, add=True): created_at and updated_at are set on `run` too.
    ((insert_sql, insert_params),) = query.get_compiler(connection=connection).as_sql()
    pk = connection.ops.quote_name(meta.pk.column)
    lock = f"run:{run.pk}"
    args = json.dumps({"run_id": str(run.pk)})
    with connection.cursor() as cursor:
        cursor.execute(
            queries["insert_run_with_first_job"].format(insert=insert_sql, pk=pk),
            [*insert_params, advance_run.queue, advance_run.name, run.priority, lock, lock, args],
        )
        (job_id,) = cursor.fetchone()
    run._state.adding = False
    run._state.db = connection.alias
    log.info("run submitted", run_id=str(run.pk), job_id=job_id, workflow=run.workflow, tenant=run.tenant)
    return job_id
