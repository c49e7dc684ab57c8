"""Group commit of run submissions (runs.group_commit): requests that come while a batch is being written are
written together, in one statement and one transaction, and each gets what it would have got alone.

The batches are made deterministic by holding a SHARE lock on runs_run from another session: the first request's
statement waits on it, the others queue in the process; releasing the lock lets the first commit and the queued
ones follow as one batch. Runs written in one transaction share their `xmin`, which is how the tests see the
batches (and that each run's first job was written in the same transaction as the run)."""

from __future__ import annotations

import threading
import time
from decimal import Decimal

import psycopg
import pytest
from django.db import DataError, connection, transaction

from runs import group_commit, submission, webhooks
from runs.errors import IdempotencyConflict, InvalidInput
from runs.models import Run, WebhookDelivery
from tests.engine_helpers import REFUND
from tests.worker import database_url

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def hold():
    """`hold(table)`: a SHARE lock on `table` (INSERTs into it wait), taken with `take()` from a session of its own
    and held until `release()` or the test's end."""
    holders = []

    def make(table: str) -> Holder:
        holders.append(Holder(psycopg.connect(database_url(connection.settings_dict), autocommit=False), table))
        return holders[-1]

    yield make
    for holder in holders:
        holder.release()
        holder.other.close()


@pytest.fixture
def lock(hold):
    return hold("runs_run")


@pytest.fixture
def jobs_lock(hold):
    """A statement that inserted its runs waits before its jobs."""
    return hold("procrastinate_jobs")


@pytest.fixture
def deliveries_lock(hold):
    """A batch of deliveries waits in its first work."""
    return hold("runs_webhookdelivery")


class Holder:
    def __init__(self, other, table: str):
        self.other = other
        self.table = table
        self.held = False

    def take(self):
        self.other.execute(f"LOCK TABLE {self.table} IN SHARE MODE")
        self.held = True

    def release(self):
        if self.held:
            self.other.rollback()
            self.held = False

    def waiting(self, grouped: bool | None = None) -> list[int]:
        """The backends waiting for a lock; with `grouped`, only those whose statement is (or is not) a group
        commit's. (In a transaction, pg_stat_activity is read once unless its snapshot is cleared.)"""
        self.other.execute("SELECT pg_stat_clear_snapshot()")
        rows = self.other.execute(
            "SELECT pid, query FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).fetchall()
        return [pid for pid, query in rows if grouped is None or grouped == query.startswith("/* runs.group_commit */")]


def submit_in_threads(calls: list, holder: Holder, queued: int, group=None, do=None) -> tuple[list, list]:
    """Run `do(call)` (`submission.submit(**call)`) for each call on a thread of its own while the lock is held;
    return once the first waits on it and `queued` more requests are queued in `group` (group_commit.RUNS): each
    thread's result or exception, and the threads."""
    results: list = [None] * len(calls)
    group = group or group_commit.RUNS
    do = do or (lambda call: submission.submit(**call))

    def one(i: int) -> None:
        try:
            results[i] = do(calls[i])
        except Exception as exc:  # noqa: BLE001 (the test looks at it)
            results[i] = exc
        finally:
            connection.close()

    holder.take()
    first = threading.Thread(target=one, args=(0,))
    first.start()
    wait_for(lambda: holder.waiting(), "the first statement to wait on the lock")
    others = [threading.Thread(target=one, args=(i,)) for i in range(1, len(calls))]
    for thread in others:
        thread.start()
    wait_for(lambda: len(group._queue) >= queued, f"{queued} requests to queue")
    return results, [first, *others]


def wait_for(condition, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def join(threads) -> None:
    for thread in threads:
        thread.join(20)
        assert not thread.is_alive()


def transactions_of(run_ids) -> dict:
    """Each run's writing transaction (xmin), and its job's (the same when written in one statement)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT r.id, r.xmin::text, array_agg(j.xmin::text) FROM runs_run r "
            "LEFT JOIN procrastinate_jobs j ON j.lock = 'run:' || r.id::text "
            "WHERE r.id = ANY(%s) GROUP BY r.id, r.xmin",
            [list(run_ids)],
        )
        return {run_id: (xmin, jobs) for run_id, xmin, jobs in cursor.fetchall()}


def call(**fields) -> dict:
    return {"workflow": "refund", "input": REFUND, **fields}


def test_requests_that_come_while_a_batch_is_written_are_written_together(lock):
    results, threads = submit_in_threads([call(idempotency_key=f"k{i}") for i in range(6)], lock, queued=5)
    lock.release()
    join(threads)

    assert all(created for _, created in results), results
    xmins = transactions_of([run.pk for run, _ in results])
    assert len(xmins) == 6
    first = xmins[results[0][0].pk][0]
    # The first alone; the five that queued behind it in one transaction; each run's one job in its run's.
    assert {xmin for xmin, _ in xmins.values()} - {first} == {xmins[results[1][0].pk][0]}
    assert all(jobs == [xmin] for xmin, jobs in xmins.values())


def test_a_key_sent_twice_in_one_batch_makes_one_run_and_a_different_request_under_it_is_refused(lock):
    other_input = {**REFUND, "amount_cents": 1}
    calls = [call(), call(idempotency_key="same"), call(idempotency_key="same"), call(idempotency_key="same"),
             call(idempotency_key="same", input=other_input)]  # fmt: skip
    results, threads = submit_in_threads(calls, lock, queued=4)
    lock.release()
    join(threads)

    same = results[1:4]
    assert sorted(created for _, created in same) == [False, False, True]
    assert len({run.pk for run, _ in same}) == 1
    assert isinstance(results[4], IdempotencyConflict)
    assert Run.objects.filter(idempotency_key="same").count() == 1
    assert Run.objects.count() == 2


def test_a_run_the_database_refuses_fails_alone_and_the_rest_of_its_batch_is_written(lock):
    calls = [call(), call(), call(cost_limit=Decimal("10000000")), call()]  # 13 digits: numeric(12, 6) overflows
    results, threads = submit_in_threads(calls, lock, queued=3)
    lock.release()
    join(threads)

    assert isinstance(results[2], DataError), results[2]
    written = [results[i][0].pk for i in (0, 1, 3)]
    assert set(Run.objects.values_list("pk", flat=True)) == set(written)
    assert all(len(jobs) == 1 for _, jobs in transactions_of(written).values())


def test_a_batch_whose_connection_is_lost_is_settled_by_each_request_and_no_run_is_made_twice(lock, jobs_lock):
    calls = [call(idempotency_key=f"lost{i}") for i in range(5)]
    results, threads = submit_in_threads(calls, lock, queued=4)
    # The first request's statement waits on runs_run; the four queued behind it will be the next batch. Let the
    # first one through to its runs' INSERT and stop it before its jobs; cut its connection (a batch of one), then
    # the next batch's, in flight with four runs.
    jobs_lock.take()
    (first,) = lock.waiting()
    lock.release()
    wait_for(lambda: jobs_lock.waiting() == [first], "the first statement to wait before its jobs")
    jobs_lock.other.execute("SELECT pg_terminate_backend(%s)", [first])
    # Now the first request sends its run again by itself, and the next batch's statement runs: both wait.
    wait_for(lambda: len(jobs_lock.waiting(grouped=True)) == 1, "the batch of four")
    (second,) = jobs_lock.waiting(grouped=True)
    jobs_lock.other.execute("SELECT pg_terminate_backend(%s)", [second])
    jobs_lock.release()
    join(threads)

    assert all(not isinstance(result, Exception) for result in results), results
    assert all(created for _, created in results)
    assert Run.objects.count() == 5
    assert all(len(jobs) == 1 for _, jobs in transactions_of([run.pk for run, _ in results]).values())


def deliveries(ids: list[str], holder: Holder, queued: int, inputs: dict | None = None) -> tuple[list, list]:
    source = webhooks.served_source("demo") or webhooks.Source("demo", workflow="refund", to_input=dict)
    inputs = inputs or {}
    return submit_in_threads(
        ids, holder, queued, group=group_commit.WORK, do=lambda i: webhooks.ingest(source, i, inputs.get(i, REFUND))
    )


@pytest.fixture
def batches(monkeypatch) -> list[int]:
    """The size of each batch of works written (rows in a savepoint have the savepoint's xmin, so xmin cannot
    tell a batch of works as it tells one of runs)."""
    sizes: list[int] = []
    write = group_commit.WORK.write

    def counted(batch):
        sizes.append(len(batch))
        write(batch)

    monkeypatch.setattr(group_commit.WORK, "write", counted)
    return sizes


def one_job_each() -> bool:
    return {len(jobs) for _, jobs in transactions_of(Run.objects.values_list("pk", flat=True)).values()} == {1}


def test_deliveries_that_come_together_are_written_in_one_transaction_each_as_it_would_be_alone(
    deliveries_lock, batches
):
    bad = {**REFUND, "amount_cents": "lots"}  # the workflow's schema refuses it
    ids = ["d0", "d1", "d2", "d2", "bad", "d3"]
    results, threads = deliveries(ids, deliveries_lock, queued=5, inputs={"bad": bad})
    deliveries_lock.release()
    join(threads)

    assert isinstance(results[4], InvalidInput), results[4]
    created = [result[1] for i, result in enumerate(results) if i != 4]
    assert sorted(created) == [False, True, True, True, True]  # one copy of d2 is the other's duplicate
    assert results[2][0].run_id == results[3][0].run_id
    # d0 alone (its transaction waited on the lock), the five after it in one.
    assert batches == [1, 5]
    assert sorted(WebhookDelivery.objects.values_list("delivery_id", flat=True)) == ["d0", "d1", "d2", "d3"]
    assert Run.objects.count() == 4 and one_job_each()


def test_deliveries_whose_transaction_is_lost_are_each_written_again_by_themselves_once(
    deliveries_lock, jobs_lock, batches
):
    ids = ["e0", "e1", "e2", "e3"]
    source = webhooks.served_source("demo")

    def named(delivery_id):  # its connection named after it (pg_stat_activity.application_name)
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('application_name', %s, false)", [delivery_id])
        return webhooks.ingest(source, delivery_id, REFUND)

    results, threads = submit_in_threads(ids, deliveries_lock, queued=3, group=group_commit.WORK, do=named)
    # e0's transaction waits on the deliveries, the three queued behind it will be the next. Stop each at its
    # first run's job and cut its connection: e0's (a batch of one), then e1's, which leads the three.
    jobs_lock.take()
    deliveries_lock.release()
    for leaders in (["e0"], ["e1", "e2", "e3"]):  # the second batch's leader is whichever queued first
        wait_for(lambda leaders=leaders: waiting_as(jobs_lock, leaders), f"{leaders}'s transaction at its first job")
        jobs_lock.other.execute("SELECT pg_terminate_backend(%s)", [waiting_as(jobs_lock, leaders)])
    jobs_lock.release()
    join(threads)

    assert all(not isinstance(result, Exception) for result in results), results
    assert all(created for _, created in results)
    assert batches == [1, 3]
    assert sorted(WebhookDelivery.objects.values_list("delivery_id", flat=True)) == ids
    assert Run.objects.count() == 4 and one_job_each()


def waiting_as(holder: Holder, names: list[str]) -> int | None:
    holder.other.execute("SELECT pg_stat_clear_snapshot()")
    row = holder.other.execute(
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = ANY(%s)", [names]
    ).fetchone()
    return row[0] if row else None


def test_a_submission_inside_a_transaction_is_the_callers_and_not_grouped():
    with transaction.atomic():
        run, created = submission.submit(**call())
        assert not group_commit.RUNS._queue
    assert created and Run.objects.filter(pk=run.pk).exists()
