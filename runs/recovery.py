"""The invariants behind "nothing is lost", checked by a periodic sweep rather than assumed:

1. A `running` run is held by its owner (runs.ownership). A running run whose advisory lock is free lost its
   owner's session (the worker was SIGKILLed, crashed, or lost its connection): the sweep takes the lock itself,
   so nobody else can claim meanwhile, and puts the run back in the queue with a job. It reads every running run
   whose lock no session holds, oldest first, in batches. The dead job's row, still
   `doing`, is finished as aborted in the same transaction, since procrastinate fetches no job of a lock while
   another of the same lock is `doing`. No heartbeat is read: a stalled heartbeat never makes a run ownerless.
2. Every queued run has a job that will advance it: a queued run with neither a waiting nor a running job (a
   job lost with a restored backup, a retry strategy that gave up, a bug) gets one. A run waiting for a slot of
   its tenant has no job on purpose and is left alone while its tenant is full.

Each repair is an audited `run.retry` (cause `owner_gone` or `no_job`), so /metrics counts them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import structlog
from django.db import DatabaseError, connection, transaction
from django.db.models import CharField, Exists, OuterRef, Value
from django.db.models.functions import Cast, Concat
from django.utils import timezone
from procrastinate.contrib.django.models import ProcrastinateJob

from runs import engine, ownership
from runs.errors import TransitionRefused
from runs.models import Run
from runs.sql import queries

log = structlog.get_logger("runs.recovery")

# A queued run younger than this is not yet suspected of having lost its job.
GRACE = timedelta(seconds=5)


def _job_of(run_ref, status: str):
    # procrastinate's own partial indexes: queueing_lock for todo jobs, lock for doing ones (Run.enqueue sets
    # both to "run:<id>").
    column = "queueing_lock" if status == "todo" else "lock"
    lock = Concat(Value("run:"), Cast(run_ref, output_field=CharField()))
    return ProcrastinateJob.objects.filter(**{column: lock}, status=status).values("pk")


def sweep(limit: int = 200) -> dict[str, int]:
    """Repair what the two invariants say is wrong; returns how many runs of each kind were repaired."""
    repaired = {"owner_gone": 0, "no_job": 0}
    for run_id, owner in _ownerless_running_runs(limit):
        if _each(_recover_ownerless, run_id, owner):
            repaired["owner_gone"] += 1
    for run in _jobless_queued_runs(limit):
        if _each(_give_a_job, run):
            repaired["no_job"] += 1
    if any(repaired.values()):
        log.warning("recovered runs", **repaired)
    return repaired


def _each(repair, *args) -> bool:
    """One run's repair: its failure (a race with another sweep, say) is logged, and the sweep goes on."""
    try:
        return repair(*args)
    except DatabaseError as exc:
        log.exception("a recovery failed", repair=repair.__name__, error=str(exc))
        return False


def _ownerless_running_runs(batch: int) -> Iterator[tuple]:
    """Every running run whose lock looked free, oldest first, read in batches (a newer run never keeps an older
    one waiting). Looked: each is taken under its lock by _recover_ownerless, which re-checks."""
    after = {"after_at": datetime.min.replace(tzinfo=UTC), "after_id": uuid.UUID(int=0)}
    while True:
        with connection.cursor() as cursor:
            cursor.execute(queries["ownerless_running"], {**after, "limit": batch})
            rows = cursor.fetchall()
        for run_id, owner, _ in rows:
            yield run_id, owner
        if len(rows) < batch:
            return
        after = {"after_at": rows[-1][2], "after_id": rows[-1][0]}


def _recover_ownerless(run_id, owner: str) -> bool:
    with ownership.hold(run_id) as taken:
        if not taken:
            return False  # its owner is alive (or another sweep is here)
        with transaction.atomic():
            run = Run.objects.filter(pk=run_id).first()
            if run is None:
                return False
            with connection.cursor() as cursor:
                # The dead job is finished by procrastinate's own procedure, as a worker finishes a job, in this
                # transaction, if it is still `doing` (queries.sql says why).
                cursor.execute(queries["finish_dead_job"], [f"run:{run_id}"])
            try:
                run.recover(owner)  # a compare-and-swap on (running, that owner): it may have moved meanwhile
            except TransitionRefused:
                transaction.set_rollback(True)
                return False
            engine.record_retry(run, "owner_gone", previous_owner=owner)
    log.warning("a running run had lost its owner: requeued", run_id=str(run_id), previous_owner=owner)
    return True


def _jobless_queued_runs(limit: int) -> list[Run]:
    """Queued runs with neither a waiting nor a running job. A run waiting for a slot of its tenant has none on
    purpose: of those, only as many as the tenant has slots nobody is about to take, oldest first (as the
    wake-up in Run.wake_waiting_for_slot would have), or the sweep would wake every waiting run each period."""
    stale = timezone.now() - GRACE
    has_job = Exists(_job_of(OuterRef("pk"), "todo")) | Exists(_job_of(OuterRef("pk"), "doing"))
    jobless = list(
        Run.objects.filter(status=Run.Status.QUEUED, updated_at__lt=stale)
        .exclude(has_job)
        .order_by("-priority", "created_at")[:limit]
    )
    found = [run for run in jobless if run.waiting_for_slot_since is None]
    for tenant in {run.tenant for run in jobless if run.waiting_for_slot_since is not None}:
        woken = Run.waiting_for_slot(tenant).filter(has_job).count()  # waiting runs already given a job
        free = Run.free_slots(tenant) - woken
        found += [run for run in jobless if run.tenant == tenant and run.waiting_for_slot_since][: max(free, 0)]
    return found


def _give_a_job(run: Run) -> bool:
    with transaction.atomic():
        locked = Run.objects.select_for_update().filter(pk=run.pk, status=Run.Status.QUEUED).first()
        if locked is None or not locked.enqueue():
            return False  # it moved, or another sweep gave it a job meanwhile
        engine.record_retry(locked, "no_job", waiting_for_slot=locked.waiting_for_slot_since is not None)
    log.warning("a queued run had no job: gave it one", run_id=str(run.pk))
    return True
