"""The parts of procrastinate that are not its public API and that this app relies on, checked at start-up.

We pin procrastinate==3.10.0 and reach past its public API in a few places (docs/DESIGN-NOTES.md, "Procrastinate
internals", says where and why; this list and that section are the same list, a test compares them). An upgrade
that renames or reshapes one of them would otherwise fail quietly: an override nobody calls any more (a worker
that stops heartbeating while it drains), an attribute read that raises in the middle of a job, a procedure that
no longer exists on the one path that defers without it. So:

* `check_python()` runs in every process (JobsConfig.ready: the web server, the workers, manage.py, the tests),
  with no database: each name below exists with the parameters we call or override it with (names and kinds, via
  `inspect`; annotations and defaults aside), the attributes procrastinate's Worker and PsycopgConnector set in
  their `__init__` exist with the type we use, and none of the names our Worker adds shadows one of procrastinate's.
* `check_database()` / `check_database_async()` run once when a worker starts (jobs.worker.Worker): each SQL
  function with its argument and result types (`pg_proc`), the body of each function a migration of ours replaced,
  the composite type we build rows of, attribute by
  attribute in order (`pg_type`, `pg_attribute`), the enum labels we write, and the columns our own SQL reads.

Either raises `InternalsMismatch`, whose message names the installed version, the pinned one and each mismatch.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from procrastinate import sql
from procrastinate.contrib.django import app
from procrastinate.psycopg_connector import PsycopgConnector
from procrastinate.worker import Worker as ProcrastinateWorker

PINNED_VERSION = "3.10.0"  # pyproject.toml pins the same (a test checks)


class InternalsMismatch(ImproperlyConfigured):
    pass


@dataclass(frozen=True)
class Internal:
    name: str  # dotted path, e.g. procrastinate.worker.Worker._shutdown
    signature: str  # as _shape() renders it: "(self, side_tasks)", "async (self)"
    where: str  # what of ours depends on it


# Worker methods that jobs.worker.Worker overrides: procrastinate's own code calls them by these names.
_OVERRIDDEN = [
    Internal("procrastinate.worker.Worker._fetch_and_process_jobs", "async (self)", "jobs/worker.py: outages"),
    Internal(
        "procrastinate.worker.Worker._persist_job_status",
        "async (self, job, status, retry_decision, context, job_result)",
        "jobs/worker.py: outcomes kept through outages (reads the `job` keyword)",
    ),
    Internal("procrastinate.worker.Worker._update_heartbeat", "async (self)", "jobs/worker.py: outages"),
    Internal("procrastinate.worker.Worker._periodic_deferrer", "async (self)", "jobs/worker.py: outages"),
    Internal("procrastinate.worker.Worker._poll_jobs_to_abort", "async (self)", "jobs/worker.py: outages"),
    Internal("procrastinate.worker.Worker._start_side_tasks", "(self)", "jobs/worker.py: our listener"),
    Internal("procrastinate.worker.Worker._shutdown", "async (self, side_tasks)", "jobs/worker.py: heartbeats"),
    Internal("procrastinate.worker.Worker._process_job", "async (self, context)", "jobs/worker.py: job threads"),
]
_CALLED = [
    Internal("procrastinate.worker.Worker._run_loop", "async (self)", "jobs/worker.py: Worker._run"),
    Internal(
        "procrastinate.worker.Worker._handle_abort_jobs_requested", "(self, job_ids)", "jobs/worker.py: abort poll"
    ),
    Internal("procrastinate.worker.Worker._abort_running_jobs", "async (self)", "jobs/worker.py: Worker._shutdown"),
    Internal(
        "procrastinate.worker.Worker._handle_notification",
        "async (self, *, channel, notification)",
        "jobs/worker.py: our listener",
    ),
    Internal(
        "procrastinate.worker.Worker._log_extra",
        "(self, action, context, job_result, **kwargs)",
        "jobs/worker.py: Worker._shutdown",
    ),
    Internal("procrastinate.app.App._worker", "(self, **kwargs)", "jobs/worker.py on_app_ready, manage.py worker"),
    Internal(
        "procrastinate.psycopg_connector.PsycopgConnector.__init__",
        "(self, *, json_dumps, json_loads, pool_factory, **kwargs)",
        "jobs/worker.py: WorkerConnector (pool_factory, pool kwargs)",
    ),
    Internal(
        "procrastinate.psycopg_connector.PsycopgConnector.open_async",
        "async (self, pool)",
        "jobs/worker.py: WorkerConnector.open_async",
    ),
    Internal(
        "procrastinate.psycopg_connector.PsycopgConnector._create_pool",
        "async (self, pool_args)",
        "jobs/worker.py: WorkerConnector.open_async",
    ),
    Internal(
        "procrastinate.psycopg_connector.PsycopgConnector._get_standalone_connection",
        "(self)",
        "jobs/worker.py: our listener",
    ),
    Internal(
        "procrastinate.psycopg_connector.PsycopgConnector._make_dynamic_query",
        "(self, query, **identifiers)",
        "jobs/worker.py: our listener",
    ),
    Internal(
        "procrastinate.psycopg_connector.PsycopgConnector._loop_notify",
        "async (self, on_notification, connection, timeout)",
        "jobs/worker.py: our listener",
    ),
    Internal("procrastinate.manager.get_channel_for_queues", "(queues)", "jobs/worker.py: our listener"),
    Internal(
        "procrastinate.utils.sync_to_async",
        "async (func, *args, **kwargs)",
        "jobs/worker.py: JobThreads (a sync task runs on the loop's default executor)",
    ),
    Internal("procrastinate.utils.causes", "(exc)", "jobs/worker.py: telling outages from errors"),
    Internal("procrastinate.utils.wait_any", "async (*coros_or_futures)", "jobs/worker.py: Worker._sleep"),
    Internal("procrastinate.utils.cancel_and_capture_errors", "async (tasks)", "jobs/worker.py: Worker._shutdown"),
    Internal("procrastinate.utils.queues_display", "(queues)", "jobs/worker.py: Worker._shutdown"),
    Internal("procrastinate.signals.on_stop", "(callback)", "jobs/worker.py: Worker.run"),
    Internal("procrastinate.cli.configure_worker_parser", "(subparsers)", "manage.py worker: its options"),
]
PYTHON = _OVERRIDDEN + _CALLED

# procrastinate's SQL queries (procrastinate/sql/queries.sql) that we run by name.
SQL_QUERIES = {"listen_queue": "jobs/worker.py: our listener"}

# Attributes the __init__ of procrastinate's Worker sets, which ours and runs/tasks.py read or replace.
WORKER_ATTRIBUTES = {
    "_stop_event": (asyncio.Event, "jobs/worker.py, runs/tasks.py: is the worker stopping?"),
    "_new_job_event": (asyncio.Event, "jobs/worker.py: replaced by a NotificationLatch"),
    "_running_jobs": (dict, "jobs/worker.py: jobs to wait for and reconcile"),
    "_loop": (type(None), "jobs/worker.py: set by Worker._run, read by procrastinate's stop()"),
}
# Attributes the __init__ of PsycopgConnector sets, which WorkerConnector reads and sets.
CONNECTOR_ATTRIBUTES = {
    "_async_pool": (type(None), "jobs/worker.py: WorkerConnector.open_async"),
    "_pool_args": (dict, "jobs/worker.py: WorkerConnector.open_async"),
}
# Instance attributes jobs.worker.Worker adds: procrastinate's Worker must not have them (they would clash).
OUR_WORKER_ATTRIBUTES = (
    "_outage",
    "_stop_requested_at",
    "_reconcile_due",
    "_database_checked",
    "_heartbeat_file",
    "job_threads",
)

# SQL (checked once when a worker starts): name -> ("(identity arguments) -> result", where).
SQL_FUNCTIONS = {
    "procrastinate_defer_jobs_v1": (
        "(jobs procrastinate_job_to_defer_v1[]) -> bigint[]",
        "runs/sql/queries.sql: insert_run_with_first_job (runs/submission.py)",
    ),
    "procrastinate_finish_job_v1": (
        "(job_id bigint, end_status procrastinate_job_status, delete_job boolean) -> void",
        "runs/sql/queries.sql: finish_dead_job (runs/recovery.py)",
    ),
}
# procrastinate's functions whose body is ours (a migration of ours replaced it): name -> (a line only our body
# has, where). A later procrastinate migration that puts its own back would undo what we rely on.
SQL_REPLACED = {
    "procrastinate_notify_queue_job_inserted_v1": (
        "-- console: one wake-up per transaction",
        "jobs/migrations/0003_one_wakeup_per_transaction.py: one notification per transaction (runs/group_commit.py)",
    ),
}
# Composite types we build rows of positionally: every attribute, in order.
SQL_TYPES = {
    "procrastinate_job_to_defer_v1": (
        "queue_name character varying, task_name character varying, priority integer, lock text, "
        "queueing_lock text, args jsonb, scheduled_at timestamp with time zone",
        "runs/sql/queries.sql: insert_run_with_first_job, ROW(...)::procrastinate_job_to_defer_v1",
    ),
}
# Enum labels we write or compare with (the enum may have more).
SQL_ENUMS = {
    "procrastinate_job_status": (
        {"todo", "doing", "aborted"},
        "runs/recovery.py, runs/sql/queries.sql, jobs/worker.py, jobs/monitoring.py",
    ),
    "procrastinate_job_event_type": ({"deferred"}, "jobs/monitoring.py"),
}
# Columns our own SQL reads or writes (the tables may have more).
SQL_COLUMNS = {
    "procrastinate_jobs": (
        {
            "id": "bigint",
            "queue_name": "character varying(128)",
            "lock": "text",
            "queueing_lock": "text",
            "status": "procrastinate_job_status",
            "scheduled_at": "timestamp with time zone",
            "worker_id": "bigint",
        },
        "runs/recovery.py, runs/sql/queries.sql, jobs/worker.py, jobs/monitoring.py",
    ),
    "procrastinate_workers": ({"id": "bigint"}, "jobs/worker.py"),
    "procrastinate_events": (
        {"job_id": "bigint", "type": "procrastinate_job_event_type", "at": "timestamp with time zone"},
        "jobs/monitoring.py",
    ),
}


def installed_version() -> str:
    return importlib.metadata.version("procrastinate")


def _fail(problems: list[str]) -> None:
    if problems:
        raise InternalsMismatch(
            f"procrastinate {installed_version()} is installed; this app is pinned to procrastinate=={PINNED_VERSION} "
            "and relies on parts of it that are not its public API (docs/DESIGN-NOTES.md, Procrastinate internals). "
            "These differ from what it expects:\n" + "\n".join(f"- {problem}" for problem in problems)
        )


def _shape(obj: Any) -> str:
    """The parameters' names and kinds (and whether it is a coroutine function), without annotations or
    defaults: what a caller or an override depends on."""
    signature = inspect.signature(obj)
    bare = [
        parameter.replace(annotation=inspect.Parameter.empty, default=inspect.Parameter.empty)
        for parameter in signature.parameters.values()
    ]
    text = str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))
    return f"async {text}" if inspect.iscoroutinefunction(inspect.unwrap(obj)) else text


def _resolve(name: str) -> Any:
    """The object at a dotted path: the longest importable module prefix, then attributes. AttributeError or
    ImportError when it is not there."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(f"no module in {name}")


def _attribute_problems(owner: str, instance: Any, expected: dict[str, tuple[type, str]]) -> list[str]:
    problems = []
    for attribute, (kind, where) in expected.items():
        if not hasattr(instance, attribute):
            problems.append(f"{owner}().{attribute} is missing (used by {where})")
        elif not isinstance(getattr(instance, attribute), kind):
            found = type(getattr(instance, attribute)).__name__
            problems.append(f"{owner}().{attribute} is a {found}, not a {kind.__name__} (used by {where})")
    return problems


def python_problems(ours: type, expected: list[Internal] = PYTHON) -> list[str]:
    """`ours` is jobs.worker.Worker, given by the caller: jobs.worker imports this module, not the reverse."""
    problems = []
    for internal in expected:
        try:
            found = _shape(_resolve(internal.name))
        except (ImportError, AttributeError):
            problems.append(f"{internal.name} is missing (used by {internal.where})")
            continue
        except (TypeError, ValueError) as exc:  # not a callable any more
            problems.append(f"{internal.name} has no signature ({exc}) (used by {internal.where})")
            continue
        if found != internal.signature:
            problems.append(f"{internal.name} is {found}, expected {internal.signature} (used by {internal.where})")
    for query, where in SQL_QUERIES.items():
        if query not in sql.queries:
            problems.append(f"procrastinate.sql.queries[{query!r}] is missing (used by {where})")

    # __init__ neither connects nor needs a running loop: a throwaway instance of each shows what it sets.
    worker = ProcrastinateWorker(app=app)
    problems += _attribute_problems("procrastinate.worker.Worker", worker, WORKER_ATTRIBUTES)
    problems += _attribute_problems(
        "procrastinate.psycopg_connector.PsycopgConnector", PsycopgConnector(), CONNECTOR_ATTRIBUTES
    )
    # A name our Worker adds that procrastinate's now has would silently replace procrastinate's.
    overridden = {internal.name.rsplit(".", 1)[1] for internal in expected if ".worker.Worker." in internal.name}
    public = {name for name in vars(ProcrastinateWorker) if not name.startswith("_")}
    for name in vars(ours):
        if hasattr(ProcrastinateWorker, name) and not name.startswith("__") and name not in overridden | public:
            problems.append(f"procrastinate.worker.Worker.{name} now exists, and jobs.worker.Worker.{name} replaces it")
    for name in OUR_WORKER_ATTRIBUTES:
        if hasattr(worker, name):
            problems.append(f"procrastinate.worker.Worker().{name} now exists, and jobs.worker.Worker sets its own")
    return problems


def check_python(ours: type, expected: list[Internal] = PYTHON) -> None:
    """Raises InternalsMismatch unless every Python internal we use (and `ours`, jobs.worker.Worker, adds) is as we
    expect. No database."""
    _fail(python_problems(ours, expected))


# One round trip: what the database has of each name we ask about.
DATABASE_FACTS = """
SELECT 'function' AS kind, p.proname::text AS name,
       '(' || pg_get_function_identity_arguments(p.oid) || ') -> ' || pg_get_function_result(p.oid) AS fact
  FROM pg_proc p WHERE p.proname = ANY(%(functions)s) AND pg_function_is_visible(p.oid)
UNION ALL
SELECT 'source', p.proname::text, p.prosrc
  FROM pg_proc p WHERE p.proname = ANY(%(replaced)s) AND pg_function_is_visible(p.oid)
UNION ALL
SELECT 'type', t.typname::text,
       string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod), ', ' ORDER BY a.attnum)
  FROM pg_type t JOIN pg_attribute a ON a.attrelid = t.typrelid AND a.attnum > 0 AND NOT a.attisdropped
 WHERE t.typname = ANY(%(types)s) AND t.typtype = 'c' AND pg_type_is_visible(t.oid)
 GROUP BY t.typname
UNION ALL
SELECT 'enum', t.typname::text, e.enumlabel::text
  FROM pg_type t JOIN pg_enum e ON e.enumtypid = t.oid
 WHERE t.typname = ANY(%(enums)s) AND pg_type_is_visible(t.oid)
UNION ALL
SELECT 'column', c.relname || '.' || a.attname, format_type(a.atttypid, a.atttypmod)
  FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
 WHERE c.relname = ANY(%(tables)s) AND c.relkind IN ('r', 'p') AND pg_table_is_visible(c.oid)
"""


def _database_arguments(functions: dict) -> dict[str, list[str]]:
    return {
        "functions": list(functions),
        "replaced": list(SQL_REPLACED),
        "types": list(SQL_TYPES),
        "enums": list(SQL_ENUMS),
        "tables": list(SQL_COLUMNS),
    }


def database_problems(rows: list[tuple[str, str, str]], functions: dict = SQL_FUNCTIONS) -> list[str]:
    """Compares DATABASE_FACTS' rows (kind, name, fact) with what we expect."""
    facts: dict[tuple[str, str], list[str]] = {}
    for kind, name, fact in rows:
        facts.setdefault((kind, name), []).append(fact)
    problems = []
    for name, (expected, where) in functions.items():
        found = facts.get(("function", name), [])
        if expected not in found:  # overloads: ours must be one of them
            have = "; ".join(f"{name}{fact}" for fact in found) or "no such function"
            problems.append(f"SQL function {name}{expected} expected, found {have} (used by {where})")
    for name, (line, where) in SQL_REPLACED.items():
        if not any(line in source for source in facts.get(("source", name), [])):
            problems.append(f"SQL function {name} is not ours: its body lacks {line!r} (used by {where})")
    for name, (expected, where) in SQL_TYPES.items():
        found = facts.get(("type", name), [])
        if found != [expected]:
            have = found[0] if found else "no such composite type"
            problems.append(f"SQL type {name} ({expected}) expected, found ({have}) (used by {where})")
    for name, (labels, where) in SQL_ENUMS.items():
        missing = labels - set(facts.get(("enum", name), []))
        if missing:
            problems.append(f"SQL enum {name} lacks {', '.join(sorted(missing))} (used by {where})")
    for table, (columns, where) in SQL_COLUMNS.items():
        for column, expected in columns.items():
            found = facts.get(("column", f"{table}.{column}"), [])
            if found != [expected]:
                have = found[0] if found else "no such column"
                problems.append(f"SQL column {table}.{column} {expected} expected, found {have} (used by {where})")
    return problems


def check_database(connection, functions: dict = SQL_FUNCTIONS) -> None:
    """Raises InternalsMismatch unless the database has every SQL internal we use as we expect (a Django
    connection)."""
    with connection.cursor() as cursor:
        cursor.execute(DATABASE_FACTS, _database_arguments(functions))
        rows = cursor.fetchall()
    _fail(database_problems(rows, functions))


async def check_database_async(connector, functions: dict = SQL_FUNCTIONS) -> None:
    """As check_database, through a procrastinate connector (the worker's pool)."""
    rows = await connector.execute_query_all_async(DATABASE_FACTS, **_database_arguments(functions))
    _fail(database_problems([(row["kind"], row["name"], row["fact"]) for row in rows], functions))
