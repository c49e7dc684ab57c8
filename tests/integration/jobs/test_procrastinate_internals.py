"""The start-up check of the procrastinate internals we rely on (jobs/internals.py), its SQL side: the database has
every SQL function and type it relies on, and one that changed stops a worker with a message naming the installed
version, the pinned one and what differs. Its Python side: tests/unit/test_procrastinate_internals.py. A real
worker refusing to start: tests/system/test_procrastinate_internals_worker.py."""

from __future__ import annotations

from importlib import import_module

import psycopg
from django.db import connection, transaction

from jobs import internals
from runs import submission
from tests.engine_helpers import REFUND
from tests.unit.test_procrastinate_internals import _mismatch
from tests.worker import database_url


def test_the_database_has_every_sql_internal_we_rely_on(db):
    internals.check_database(connection)


def test_an_sql_function_with_other_arguments_stops_a_worker(db):
    expected = {"procrastinate_finish_job_v1": ("(job_id bigint, end_status text) -> void", "runs/recovery.py")}

    message = _mismatch(lambda: internals.check_database(connection, functions=expected))

    assert (
        "SQL function procrastinate_finish_job_v1(job_id bigint, end_status text) -> void expected, found "
        "procrastinate_finish_job_v1(job_id bigint, end_status procrastinate_job_status, delete_job boolean) -> void"
    ) in message


def test_an_sql_function_gone_stops_a_worker(db):
    expected = {
        "procrastinate_defer_jobs_v2": ("(jobs procrastinate_job_to_defer_v2[]) -> bigint[]", "runs/submission.py")
    }

    message = _mismatch(lambda: internals.check_database(connection, functions=expected))

    assert "found no such function (used by runs/submission.py)" in message


def test_a_composite_type_with_other_attributes_stops_a_worker(db):
    with connection.cursor() as cursor:  # rolled back with the test's transaction
        cursor.execute("ALTER TYPE procrastinate_job_to_defer_v1 ADD ATTRIBUTE priority_class text")

    message = _mismatch(lambda: internals.check_database(connection))

    assert "SQL type procrastinate_job_to_defer_v1" in message and "priority_class text" in message


def test_procrastinates_own_job_insert_notification_put_back_stops_a_worker(db):
    # As a later procrastinate migration would: its body, one notification per job (rolled back with the test).
    migration = import_module("jobs.migrations.0003_one_wakeup_per_transaction")
    with connection.cursor() as cursor:
        cursor.execute(migration.PROCRASTINATES)

    message = _mismatch(lambda: internals.check_database(connection))

    assert "SQL function procrastinate_notify_queue_job_inserted_v1 is not ours" in message


def test_a_transaction_of_many_jobs_notifies_each_listener_once(transactional_db):
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as listener:
        listener.execute('LISTEN "procrastinate_any_queue_v1"')
        with transaction.atomic():
            for _ in range(5):
                submission.submit(workflow="refund", input=REFUND)
        listener.execute("SELECT 1")  # notifications arrive with the next round trip's answer
        payloads = [n.payload for n in listener.notifies(timeout=0.5)]

    assert payloads == ['{"type" : "job_inserted"}']
