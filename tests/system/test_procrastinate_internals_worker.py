"""A real worker checks the procrastinate SQL internals we rely on when it starts (jobs/internals.py), and does
not start on a database where one changed (the checks in process:
tests/integration/jobs/test_procrastinate_internals.py)."""

from __future__ import annotations

from django.db import connection
from procrastinate.contrib.django.models import ProcrastinateWorker


def test_a_worker_does_not_start_on_a_database_whose_procedure_changed(start_worker):
    """`manage.py worker` checks the SQL once at start, before it registers: a procedure it calls that is not
    there stops it with the message, and no job is taken."""
    signature = "procrastinate_finish_job_v1(bigint, procrastinate_job_status, boolean)"
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER FUNCTION {signature} RENAME TO procrastinate_finish_job_v1_elsewhere")
    try:
        worker = start_worker()
        assert worker.wait(timeout=60) != 0
    finally:
        with connection.cursor() as cursor:
            renamed = signature.replace("finish_job_v1(", "finish_job_v1_elsewhere(")
            cursor.execute(f"ALTER FUNCTION {renamed} RENAME TO procrastinate_finish_job_v1")
    log = worker.log()
    assert "pinned to procrastinate==3.10.0" in log, log[-3000:]
    assert "SQL function procrastinate_finish_job_v1(" in log and "found no such function" in log
    assert not ProcrastinateWorker.objects.exists()  # it never registered
