"""Submitting a run: the run and its first job, written in one statement (the enqueue path's single round trip,
issue 11). No agent work happens here; the API, webhooks, `demo_traffic` and tests submit through `submit`.

A transaction, the run's INSERT, a savepoint and the defer of `advance_run` through Procrastinate's Django
connector, the savepoint's release and the commit were six round trips, each with its share of Django's and
PostgreSQL's per-statement work, on a path whose baseline is one INSERT. Here the run's INSERT (the SQL Django's
compiler writes for `run.save(force_insert=True)`: the same columns, defaults and `pre_save` values) and the job's
defer (Procrastinate's own stored procedure, `procrastinate_defer_jobs_v1`, which `.defer()` calls too) go as one
statement, a data-modifying CTE (runs/sql/queries.sql: insert_run_with_first_job): atomic by itself in
autocommit (one implicit transaction, one commit), or part of the caller's transaction when there is one.

No savepoint for the job: its queueing lock is `run:<id>` for a run that did not exist until this statement, so
no other job can hold it (a savepoint only existed to survive AlreadyEnqueued, which cannot happen here). A
duplicate idempotency key fails the whole statement (IntegrityError): neither the run nor its job is written.

The job is the one `Run.enqueue` defers (`Run.advance_job`: same task, queue, lock, queueing lock, priority and
arguments); tests/integration/runs/test_api_runs.py compares them. Runs has no save signals for this to skip (a receiver
added later would need `submit` to go back to `save()`).
"""

from __future__ import annotations

import contextlib
import json

import structlog
from django.conf import settings
from django.db import IntegrityError, InterfaceError, OperationalError, connection, transaction
from django.db.models.expressions import DatabaseDefault
from django.db.models.sql import InsertQuery

from core import pii
from jobs.worker import is_connection_error
from runs import group_commit, personal
from runs import workflow as workflows
from runs.errors import IdempotencyConflict, InvalidInput
from runs.models import Run
from runs.sql import queries

log = structlog.get_logger("runs.submission")


def submit(
    *,
    workflow: str,
    input: dict,
    created_by=None,
    idempotency_key: str | None = None,
    tenant: str = "default",
    priority: int = 0,
    cost_limit=None,
) -> tuple[Run, bool]:
    """Create a run and queue its first job in one transaction; no agent work happens here.

    The same idempotency key gives back the same run (created=False); the same key with a different
    request raises IdempotencyConflict. An input the workflow's schema refuses raises InvalidInput; an unknown
    workflow, UnknownWorkflow (runs.errors)."""
    definition = workflows.get(workflow)  # raises UnknownWorkflow
    # An input with personal fields is sealed into the vault in the run's own transaction: a run refused (a
    # duplicate idempotency key) leaves no sealed value behind (runs.personal).
    sealing = definition.seals_input()
    alone = connection.in_atomic_block or sealing  # else its own transaction: a group commit's (runs.group_commit)
    run = None
    try:
        # The run and its job in one statement: its own transaction in autocommit (with other requests' runs,
        # when they come together); inside a caller's, a savepoint, so that a duplicate key does not abort the
        # caller's transaction.
        with transaction.atomic() if alone else contextlib.nullcontext():
            run = new_run(
                definition,
                input,
                tenant=tenant,
                priority=priority,
                idempotency_key=idempotency_key,
                created_by=created_by,
                cost_limit=cost_limit,
            )
            if alone or not _group_insert(run):
                insert_with_first_job(run)
        return run, True
    except group_commit.Lost as exc:
        run = _insert_again(run, exc.cause)
        if run is not None:
            return run, True
    except (OperationalError, InterfaceError) as exc:
        if run is None or alone or not is_connection_error(exc):
            raise  # inside a caller's transaction, its commit (and what to do when it is lost) is the caller's
        run = _insert_again(run, exc)
        if run is not None:
            return run, True
    except IntegrityError:
        if idempotency_key is None:
            raise
    existing = Run.objects.get(idempotency_key=idempotency_key, created_by=created_by)
    if (existing.workflow, existing.tenant) != (definition.name, tenant) or not _same_input(existing.input, input):
        raise IdempotencyConflict(
            f"idempotency key {idempotency_key!r} was used for a different request (run {existing.id})"
        )
    return existing, False


def _same_input(stored, sent) -> bool:
    """Whether a run's stored input is the request's: its personal fields are references (sealed anew each time),
    so they are compared opened. A value that cannot be opened (erased) is not the same request."""
    if stored == sent:
        return True
    if not pii.refs_in(stored):
        return False
    try:
        return pii.reveal(stored) == sent
    except pii.PiiError:
        return False


def new_run(definition, input: dict, **fields) -> Run:
    """The unsaved run of `definition` on `input`, as every run is made (`submit`, and a fork: runs.forks): the input
    checked against the workflow's schema (InvalidInput, nothing written), the deployed version, the attempts
    allowed now, its personal fields sealed (runs.personal; in the caller's transaction, with the run: an erased
    subject's run is refused, InvalidInput). Saved with its first job by `insert_with_first_job`."""
    definition.validate_input(input)  # raises InvalidInput: nothing is written
    run = Run(
        workflow=definition.name,
        workflow_version=definition.version,
        input=input,
        max_attempts=settings.RUN_MAX_ATTEMPTS,
        **fields,
    )
    try:
        run.input = definition.seal_input(input, run.id)
    except (pii.Erased, pii.SchemaError) as exc:
        where = personal.subject_path(definition.input_json_schema()) or "input"
        raise InvalidInput([{"loc": f"input.{where}", "msg": str(exc)}]) from None
    return run


class OutcomeUnknown(OperationalError):
    """The connection was lost while the run's statement was in flight and the database could not be reached again
    to settle it: the run `run_id` may exist. A database outage (console.middleware answers 503), which says
    which run to look for before sending the request again."""

    def __init__(self, run_id):
        super().__init__(f"the outcome of run {run_id}'s submission is unknown: the database cannot be reached")
        self.run_id = run_id
        # What the 503 tells the client (console.middleware): a client that sent the request again without looking
        # would make a second run when this one was made.
        self.detail_for_client = (
            f"The database cannot be reached, and whether run {run_id} was made is unknown: once it answers again, "
            f"GET /api/runs/{run_id} tells (404: it was not made; send the request again)."
        )


def _insert_again(run: Run, lost: BaseException) -> Run | None:
    """The connection was lost while the run's statement was in flight (in autocommit: its commit's outcome is
    unknown). Send the same statement again, with the same id, on a new connection: the run's primary key is the
    fence. The first statement committed: this one fails on the key, and the run is the one found (returned). It
    never ran: this one makes the run (returned). It still runs on a backend that has not noticed the client is
    gone: this one waits for it on the key, then one of the two. A first statement delivered later still fails on
    the key. None: the statement failed on another unique key (an idempotency key another request holds), which
    the caller settles as it would have. OutcomeUnknown when the database cannot be reached again."""
    log.warning("run submission outcome unknown: sending it again", run_id=str(run.pk), error=str(lost)[:300])
    connection.close()  # the lost one; the next statement opens a new connection
    try:
        insert_with_first_job(run)
        return run
    except IntegrityError:
        found = Run.objects.filter(pk=run.pk).first()
        if found is None:
            return None
        log.info("run submission had committed", run_id=str(run.pk))
        return found
    except (OperationalError, InterfaceError) as exc:
        if not is_connection_error(exc):
            raise
        connection.close()
        raise OutcomeUnknown(run.pk) from exc


def _group_insert(run) -> bool:
    """Write `run` and its first job in a group commit with other requests' (runs.group_commit); False when it must
    be written by itself (group commit off, an INSERT that is not the plain one, or the group's statement failed
    for a reason that is not the connection's). Raises group_commit.Duplicate (an IntegrityError) or Lost."""
    if not settings.GROUP_COMMIT:
        return False
    sql, params, plain = _run_insert(run)
    if not plain:
        return False
    job = first_job_row(run)
    try:
        job_id, batch = group_commit.insert(run, sql, params, job)
    except group_commit.Alone:
        return False
    run._state.adding = False
    run._state.db = connection.alias
    log.info("run submitted", run_id=str(run.pk), job_id=job_id, workflow=run.workflow, tenant=run.tenant, batch=batch)
    return True


def first_job_row(run) -> list:
    """The row of `run`'s first job as both statements take it (queue, task, priority, lock, queueing lock,
    arguments): the job Run.enqueue would defer, its task, queue, locks, priority and arguments."""
    job = run.advance_job().job
    return [job.queue, job.task_name, job.priority, job.lock, job.queueing_lock, json.dumps(job.task_kwargs)]


def insert_with_first_job(run) -> int:
    """INSERT the unsaved `run` and defer its `advance_run` job in one statement; the job's id."""
    model = type(run)
    meta = model._meta
    assert run._state.adding and run.pk is not None, "a new run, its primary key set (uuid4 default)"
    insert_sql, insert_params = run_insert(run)
    pk = connection.ops.quote_name(meta.pk.column)
    row = first_job_row(run)
    with connection.cursor() as cursor:
        cursor.execute(queries["insert_run_with_first_job"].format(insert=insert_sql, pk=pk), [*insert_params, *row])
        (job_id,) = cursor.fetchone()
    run._state.adding = False
    run._state.db = connection.alias
    log.info("run submitted", run_id=str(run.pk), job_id=job_id, workflow=run.workflow, tenant=run.tenant)
    return job_id


_INSERT_SQL: dict[tuple[str, type], str] = {}


def run_insert(run) -> tuple[str, list]:
    """The SQL and parameters of `run`'s INSERT (`_run_insert`)."""
    sql, params, _ = _run_insert(run)
    return sql, params


def _run_insert(run) -> tuple[str, list, bool]:
    """The SQL and parameters Django's compiler writes for `run.save(force_insert=True)`, the SQL compiled once per
    process, model and database: compiling it was a quarter of `POST /api/runs`'s CPU (docs/PROFILE-api.md). The
    parameters are each field's `pre_save(run, add=True)` (which sets created_at and updated_at on `run`, as the
    compiler does) made ready by its `get_db_prep_save`, as the compiler makes them; a value that is an
    expression, or a field with a placeholder or a database default of its own, takes the compiler's path. The
    third value: whether the SQL is the plain INSERT (one VALUES row of placeholders), which a group commit repeats
    for many runs (runs.group_commit); a run whose INSERT is not is written by itself."""
    model = type(run)
    fields = [f for f in model._meta.local_concrete_fields if not f.generated]
    key = (connection.alias, model)
    sql = _INSERT_SQL.get(key)
    if sql is not None:
        values = [f.pre_save(run, add=True) for f in fields]
        if not any(hasattr(v, "resolve_expression") for v in values):
            prepared = [f.get_db_prep_save(v, connection=connection) for f, v in zip(fields, values, strict=True)]
            return sql, prepared, True
    query = InsertQuery(model)
    query.insert_values(fields, [run])
    # as_sql() calls each field's pre_save(run, add=True): created_at and updated_at are set on `run` too.
    ((sql, params),) = query.get_compiler(connection=connection).as_sql()
    # A field with a database default of its own and a value (a Python default too: Run.undo_reason, which the
    # previous release's INSERTs leave out) is written as any other; one left to the database is not plain.
    plain = all(
        not hasattr(f, "get_placeholder_sql") and not isinstance(v, DatabaseDefault)
        for f, v in zip(fields, [getattr(run, f.attname) for f in fields], strict=True)
    )
    qn = connection.ops.quote_name
    expected = (
        f"INSERT INTO {qn(model._meta.db_table)} ({', '.join(qn(f.column) for f in fields)})"
        f" VALUES ({', '.join(['%s'] * len(fields))})"
    )
    plain = plain and sql == expected and len(params) == len(fields)
    if plain:
        _INSERT_SQL[key] = sql
    return sql, list(params), plain
