"""A sync task's `.defer()` inside `transaction.atomic()` is part of that transaction, in a real worker process.

`manage.py worker` runs the worker loop on a psycopg pool but gives sync code procrastinate's DjangoConnector,
so the defer goes through the task thread's Django connection (`manage.py procrastinate worker` sent it to the
pool: committed at once, whatever the transaction then did).

The tasks below are loaded by the worker through WORKFLOW_MODULES (only in these tests)."""

from __future__ import annotations

import pytest
from django.db import transaction
from procrastinate.contrib.django import app
from procrastinate.contrib.django.models import ProcrastinateJob

from tests.worker import wait_with_logs

QUEUE = "test_worker"
THIS_MODULE = __name__


@app.task(name="test_worker.marker", queue=QUEUE)
def marker(tag: str) -> None:
    """Does nothing: its job's existence is what the tests look at."""


@app.task(name="test_worker.defer_in_atomic", queue=QUEUE)
def defer_in_atomic(tag: str, fail: bool) -> None:
    with transaction.atomic():
        marker.defer(tag=tag)
        # Same connection, same transaction: the job is visible here before the commit.
        assert ProcrastinateJob.objects.filter(task_name="test_worker.marker", args__tag=tag).exists()
        if fail:
            raise RuntimeError("rolled back on purpose")


def _status(job_id: int) -> str:
    return ProcrastinateJob.objects.values_list("status", flat=True).get(pk=job_id)


def _markers(tag: str):
    return ProcrastinateJob.objects.filter(task_name="test_worker.marker", args__tag=tag)


@pytest.fixture
def worker(start_worker):
    return start_worker(WORKFLOW_MODULES=THIS_MODULE)


def test_a_defer_in_a_transaction_that_rolls_back_is_rolled_back_with_it(worker):
    job_id = defer_in_atomic.defer(tag="rolled-back", fail=True)
    wait_with_logs(lambda: _status(job_id) == "failed", "the task to fail", [worker])
    assert "rolled back on purpose" in worker.log()
    assert not _markers("rolled-back").exists(), worker.log()


def test_a_defer_in_a_transaction_that_commits_is_committed_with_it(worker):
    job_id = defer_in_atomic.defer(tag="committed", fail=False)
    wait_with_logs(lambda: _status(job_id) == "succeeded", "the task to succeed", [worker])
    # The deferred job exists, and the worker ran it too (it was committed, so it was visible to fetches).
    wait_with_logs(
        lambda: _markers("committed").filter(status="succeeded").exists(), "the deferred job to run", [worker]
    )
    assert _markers("committed").count() == 1
