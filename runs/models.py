"""The engine's records: runs and their steps (the checkpoints), model usage, the receipts of side effects, signed
webhook deliveries, shadow mode's kept effects, circuit breakers and tenant throttles."""

from __future__ import annotations

import functools
import json
import uuid
from decimal import ROUND_HALF_UP, Decimal

import psycopg
from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, connection, models, transaction
from django.db.models import F, Q
from django.utils import timezone
from procrastinate.contrib.django import app
from procrastinate.exceptions import AlreadyEnqueued
from procrastinate.jobs import JobDeferrer

from core import tracing
from core.models import AuditEntry
from runs import gates, ownership
from runs.errors import OwnershipLost, TransitionRefused
from runs.sql import pipelined, prepared_cursor, queries
from runs.transitions import FINISHED, OWNED, PARKED, TRANSITIONS, RunStatus


def new_trace_id() -> str:
    """A new run's trace id: the trace of the request that creates it (its span, or the caller's traceparent with
    tracing off: core.tracing.current), else a new random one."""
    found = tracing.current()
    return found[0] if found is not None else uuid.uuid4().hex


def new_trace_parent() -> str:
    """A new run's root in its trace (a W3C traceparent): the request's span that creates it; "" when none."""
    found = tracing.current()
    return found[1] if found is not None else ""


_FINISHED = list(FINISHED)


_COST_QUANTUM = Decimal("0.000001")

_CANCELLED = {"outcome": "cancelled"}  # a cancelled run's result


# The workflow name of an external agent's run (status `external`): its timeline holds the approval requests it
# made (external.models).
EXTERNAL_WORKFLOW = "external"


class Run(models.Model):
    """One agent execution: advanced step by step by `runs.engine`, one job at a time."""

    Status = RunStatus

    FINISHED = FINISHED
    PARKED = PARKED
    OWNED = OWNED
    # Its record still moves (a job may write its next step): neither replayed nor forked (runs.replay, runs.forks).
    MOVING = (RunStatus.QUEUED, *OWNED)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workflow = models.CharField(max_length=100)
    workflow_version = models.PositiveIntegerField()
    tenant = models.CharField(max_length=100, default="default")
    input = models.JSONField(encoder=DjangoJSONEncoder)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED)
    attempt = models.PositiveIntegerField(
        default=0, help_text="Finished attempts of the step at the cursor: failures, and executions cut off by a crash."
    )
    max_attempts = models.PositiveIntegerField(default=3)
    cursor = models.PositiveIntegerField(default=0, help_text="Index of the next step to run.")
    result = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    error = models.TextField(blank=True)
    pause_reason = models.TextField(blank=True)
    paused_switch = models.CharField(
        max_length=64,
        blank=True,
        help_text="The kill switch that paused the run (a channel's name, or '*' for the global one): "
        "releasing it resumes the run.",
    )
    cancel_requested = models.BooleanField(default=False)
    undo_reason = models.CharField(
        max_length=16,
        blank=True,
        default="",
        db_default="",
        choices=[(r, r) for r in ("failed", "rejected", "cancelled", "budget")],
        help_text="Why the run's effects are being undone (runs.compensations); blank: they are not.",
    )
    # A fork (runs.forks): the run it was forked from, at which step and why. It reuses the original's outputs
    # before that step and shares its effects' receipts by key (`effects_of`: the original's id, which its
    # effects' default keys start with), so nothing the original did is done again.
    # Indexed only where set (runs_run_fork_of, below): nearly every run is no fork, and a run's status changes
    # (its start and its end, updates that cannot be HOT) would otherwise add a NULL entry each time.
    fork_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="forks", db_index=False
    )
    fork_from_step = models.PositiveIntegerField(null=True, blank=True)
    fork_reason = models.CharField(max_length=500, blank=True, default="", db_default="")
    effects_of = models.UUIDField(null=True, blank=True)
    owner = models.CharField(
        max_length=200,
        blank=True,
        help_text="The job driving the run (worker/job/nonce), set when it is claimed; blank unless running. "
        "Only a job holding the run's advisory lock (runs.ownership) claims it.",
    )
    waiting_for_slot_since = models.DateTimeField(
        null=True, blank=True, help_text="Queued without a job until a run of its tenant leaves `running`."
    )
    idempotency_key = models.CharField(
        max_length=200, null=True, blank=True, help_text="Unique per creator: two clients never collide on a key."
    )
    trace_id = models.CharField(max_length=32, default=new_trace_id)
    trace_parent = models.CharField(
        max_length=55,
        blank=True,
        default=new_trace_parent,
        db_default="",
        help_text="The W3C traceparent of the run's root span (the request that created it): its steps' parent.",
    )
    priority = models.IntegerField(default=0)
    not_before = models.DateTimeField(null=True, blank=True)
    tokens_in = models.PositiveIntegerField(default=0)
    tokens_out = models.PositiveIntegerField(default=0)
    cost = models.DecimalField(max_digits=12, decimal_places=6, default=Decimal(0))
    cost_limit = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="runs"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["status", "tenant"], name="runs_run_status_tenant"),
            models.Index(fields=["-created_at"], name="runs_run_created"),
            models.Index(fields=["paused_switch"], condition=Q(status=RunStatus.PAUSED), name="runs_run_paused_switch"),
            models.Index(
                fields=["tenant", "-priority", "created_at"],
                condition=Q(status=RunStatus.QUEUED, waiting_for_slot_since__isnull=False),
                name="runs_run_waiting_for_slot",
            ),
            models.Index(fields=["fork_of"], condition=Q(fork_of__isnull=False), name="runs_run_fork_of"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["created_by", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                nulls_distinct=False,  # runs started by the system (no creator) share one key space
                name="runs_run_idempotency_key_per_creator",
            ),
            models.CheckConstraint(condition=Q(status__in=RunStatus.values), name="runs_run_status_valid"),
            models.CheckConstraint(
                condition=Q(status__in=_FINISHED, finished_at__isnull=False)
                | (~Q(status__in=_FINISHED) & Q(finished_at__isnull=True)),
                name="runs_run_finished_iff_finished_at",
            ),
            models.CheckConstraint(
                condition=(Q(status=RunStatus.RUNNING) & ~Q(owner=""))
                | (Q(status=RunStatus.COMPENSATING) & (~Q(owner="") | Q(workflow=EXTERNAL_WORKFLOW)))
                | (~Q(status__in=list(OWNED)) & Q(owner="")),
                name="runs_run_owned_iff_owner",
            ),
            models.CheckConstraint(
                condition=Q(undo_reason="") | ~Q(status__in=[RunStatus.SUCCEEDED, RunStatus.FAILED]),
                name="runs_run_undone_never_succeeded",
            ),
            models.CheckConstraint(
                condition=Q(waiting_for_slot_since__isnull=True) | Q(status=RunStatus.QUEUED),
                name="runs_run_waits_for_slot_only_queued",
            ),
            models.CheckConstraint(
                condition=Q(cost_limit__isnull=True) | Q(cost_limit__gte=0),
                name="runs_run_cost_limit_positive",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.workflow} {self.id}"

    @property
    def is_finished(self) -> bool:
        return self.status in self.FINISHED

    @property
    def effects_root(self):
        """The run whose id its effects' default receipt keys start with (runs.steps.Context.effect): its own, or for
        a fork the original's (`effects_of`), so that an effect the original already made is found done, not
        made again."""
        return self.effects_of or self.id

    @property
    def cancellable(self) -> bool:
        """Whether a cancel takes it (Run.cancel): not a run being undone, parked or not (an external run whose
        compensation failed aside: no card can try it again). A finished run is left as it is."""
        undoing = self.undo_reason or self.status in (RunStatus.COMPENSATING, RunStatus.COMPENSATION_FAILED)
        return not undoing or (self.workflow == EXTERNAL_WORKFLOW and self.status == RunStatus.COMPENSATION_FAILED)

    def advance_job(self, delay: float | None = None) -> JobDeferrer:
        """This run's `advance_run` job (runs.tasks), configured by the task's name (a model does not import its
        tasks): at most one per run waits in the queue (queueing lock) and one runs at a time (lock)."""
        lock = f"run:{self.pk}"
        return app.configure_task(
            "advance_run",
            allow_unknown=False,  # not a job on procrastinate's default queue, which no worker of ours reads
            lock=lock,
            queueing_lock=lock,
            priority=self.priority,
            schedule_in={"seconds": delay} if delay else None,
            task_kwargs={"run_id": str(self.pk)},
        )

    def enqueue(self, delay: float | None = None) -> bool:
        """Defer the run's job, as part of the caller's transaction (the outbox). False when one already
        waited."""
        assert connection.in_atomic_block, "enqueue() must run inside the transaction that changes the run"
        try:
            with transaction.atomic():  # a savepoint: AlreadyEnqueued must not abort the caller's transaction
                self.advance_job(delay).defer()
        except AlreadyEnqueued:
            return False  # a job for this run is already waiting: it will see the new state
        return True

    @classmethod
    def paused_by(cls, switch: str):
        return cls.objects.filter(status=cls.Status.PAUSED, paused_switch=switch)

    @classmethod
    def resume_paused_by(cls, switch: str, **_) -> int:
        """Queue every run the kill switch `switch` paused, each with its job deferred in the caller's
        transaction (the release's: core.models.kill_switch_released)."""
        assert connection.in_atomic_block
        count = 0
        for run in cls.paused_by(switch).select_for_update():
            run.resume()
            count += 1
        return count

    # The state machine. Every change of `status` goes through one of these methods, each a compare-and-swap
    # from the states its transition may leave (runs.transitions.TRANSITIONS; and, for the owner's transitions,
    # the owner token), raising TransitionRefused when no row changed. Owner transitions run under the run's
    # advisory lock.

    def _swap(
        self,
        transition: str,
        *,
        by_owner: str | None = None,
        locked: bool = False,
        where: dict | None = None,
        **changes,
    ) -> None:
        """Take `transition`: from one of its source states to its target, with `changes`. `by_owner`: only while
        that job owns the run; `locked` (implied by `by_owner`): only from the session that holds the run's lock
        (runs.ownership), raising OwnershipLost otherwise."""
        leaving, target = TRANSITIONS[transition]
        rows = Run.objects.filter(pk=self.pk, status__in=leaving, **(where or {}))
        if by_owner is not None:
            rows = rows.filter(owner=by_owner)
        if by_owner is not None or locked:
            rows = rows.filter(ownership.held(self.pk))
        changes["status"] = target
        changes["updated_at"] = timezone.now()
        if rows.update(**changes) != 1:
            error = OwnershipLost if by_owner is not None or locked else TransitionRefused
            raise error(f"run {self.pk}: cannot {transition} (to {target}) from its current state")
        for name, value in changes.items():
            if not hasattr(value, "resolve_expression"):
                setattr(self, name, value)
        if Run.Status.RUNNING in leaving and target != Run.Status.RUNNING:
            Run.wake_waiting_for_slot(self.tenant)  # a slot of its tenant is free

    @classmethod
    def take(cls, run_id, owner: str, lock: ownership.Taking) -> tuple[Run | None, bool]:
        """A job's first statements, in one round trip (sql.pipelined: one transaction, in autocommit): the run's
        lock and, if it was taken, the run's row and its tenant's lock (`claim_take`); then the start of a queued
        run under `owner` (`start`, which checks the lock in its own statement) and the run's step rows, in a
        statement whose snapshot comes after those locks (`start_then_steps`). Sets
        `lock.taken`; returns as Run.claim does. A queued run that started (a new run, a decided one resuming), or
        one with nothing to drive (parked, finished), needs nothing more; any other (running: its owner's session
        ended; queued without a free slot, or cancelled) goes on with Run.claim, under the lock.

        Django's health check of a connection kept from an earlier job (a `SELECT 1` before its first query) is
        this statement: if the kept connection turns out dead, it is closed and the statements are sent again on a
        new one (a session that ended took whatever the first sending did with it, its lock included)."""
        fields = _run_fields()
        params = {
            "id": run_id,
            "owner": owner,
            "now": timezone.now(),
            "max": settings.TENANT_MAX_RUNNING,
            **ownership.lock_params(run_id),
        }
        statements = ((_claim_take_sql(), params), (queries["start_then_steps"], params))
        kept = (
            connection.connection is not None
            and connection.health_check_enabled
            and not connection.health_check_done
            and not connection.in_atomic_block
        )
        lock.taken = None  # not known until the statement answers
        try:
            taken, started = pipelined(*statements, health_check=False)
        except DatabaseError:
            if not kept or connection.is_usable():
                raise
            connection.close()
            taken, started = pipelined(*statements, health_check=False)
        connection.health_check_done = True
        row = taken.rows[0]
        lock.taken = bool(row[0])
        if not lock.taken or row[1] is None:
            return None, False  # another session holds the run's lock, or there is no such run
        values = [
            value if convert is None else convert(value, None, connection)
            for (_, convert), value in zip(fields, row[1 : len(fields) + 1], strict=True)
        ]
        run = cls.from_db(connection.alias, [attname for attname, _ in fields], values)
        count, rows = started.rows[0]
        if count == 1:
            run.step_rows = (json.loads(rows) if isinstance(rows, str | bytes) else rows) or []
            run.status, run.owner, run.waiting_for_slot_since = TRANSITIONS["start"].target, owner, None
            run.updated_at = params["now"]
            return run, False
        if run.status not in (cls.Status.QUEUED, *OWNED):
            return None, False  # parked or finished: nothing to drive
        return cls.claim(run_id, owner)

    @classmethod
    def claim(cls, run_id, owner: str) -> tuple[Run | None, bool]:
        """The job holding the run's advisory lock takes it: queued -> running, or running -> running under a
        new owner (the previous owner's session ended, or it would still hold the lock: the run resumes from
        its last checkpoint). Returns (run, took_over), or (None, False) when there is nothing to drive:
        parked, finished, cancelled before it started, or waiting for a slot of its tenant."""
        with transaction.atomic():
            run, started = cls._row_for_update(run_id, owner)
            if started:  # it was queued, and is now running under `owner`
                return run, False
            if run is None or run.status not in (cls.Status.QUEUED, *OWNED):
                return None, False
            if run.status == cls.Status.QUEUED:
                if run.cancel_requested and not run.undo_reason:  # a cancel and undo starts: its undo runs
                    run._swap("cancel_queued", **run._finished({"outcome": "cancelled"}))
                    run._close_cards("cancelled")
                    return None, False
                # No free slot of its tenant, or an older run of it waits for one.
                run._swap("wait_for_slot", waiting_for_slot_since=run.waiting_for_slot_since or timezone.now())
                return None, False
            # The execution its previous owner was in when its session ended counts as an attempt of the step (or
            # of the compensation it was running).
            undoing = run.status == cls.Status.COMPENSATING
            run._swap("take_over_undo" if undoing else "take_over", locked=True, owner=owner, attempt=run.attempt + 1)
            return run, True

    def owned(self) -> bool:
        """This run's row while this job owns it: the guard every step write takes (FOR NO KEY UPDATE, which a
        claim's FOR UPDATE waits for), inside the write's transaction, which runs in the session that holds the
        run's lock (a job whose session was cut is refused even though its token is still on the row: a
        transaction never spans two sessions). Raises OwnershipLost. Returns (and keeps) `cancel_requested` as
        the locked row has it: a cancel committed before this is seen, a later one waits for the write."""
        assert connection.in_atomic_block
        with connection.cursor() as cursor:
            cursor.execute(queries["owned"], {"id": self.pk, "owner": self.owner, **ownership.lock_params(self.pk)})
            row = cursor.fetchone()
        if row is None:
            raise OwnershipLost(f"run {self.pk} is no longer owned by {self.owner} in this database session")
        self.cancel_requested, self.undo_reason = row
        return self.cancel_requested

    def checkpoint(
        self,
        seq: int,
        usage,
        *,
        name: str,
        kind: str,
        input,
        input_hash: str,
        output,
        started_at,
        latency_ms: float | None = None,
        prompt_version: str = "",
        tools_version: str = "",
        tape: list | None = None,
        new: bool = False,
        finish: bool = False,
        result=None,
    ):
        """The step at `seq` is done: its row (inserted, or the row an earlier attempt left updated, with `usage`,
        this attempt's, added to the earlier ones') and the run's cursor moved past it, in ONE statement (a
        data-modifying CTE, atomic on its own in autocommit): the run's UPDATE checks the owner and the cursor,
        and the step's row is inserted only from the row that UPDATE returned, so a job that lost the run writes
        nothing and gets OwnershipLost. The run's totals are not added to here: each model call counted itself as
        it answered (ModelUsage). `new`: no earlier attempt left a row for this step (the engine knows from the
        rows it read at the claim), so the row is a plain INSERT (less WAL than an upsert's speculative insertion);
        a row there after all is an IntegrityError, with nothing written.

        Returns the output as stored (jsonb rewrites numbers, dates become strings: later steps see what a replay
        would see), and refreshes `cancel_requested` from the row it updated (a cancel committed while the step
        ran is seen here, with no read of its own).

        `finish`: this is the run's last step, and the same statement ends the run (Run.finish's effects, one write
        transaction for both): succeeded with `result`, or cancelled if a cancel was committed while the step ran,
        with the tenant's lock, then the wake-up of its runs waiting for a slot (and, cancelled, its cards
        closed), in the caller's transaction."""
        assert not finish or connection.in_atomic_block, "the wake-up of a waiting run belongs to the finish"
        # Rounded as the column stores it, so the copy in memory stays equal to the row.
        cost = Decimal(usage.cost).quantize(_COST_QUANTUM, rounding=ROUND_HALF_UP)
        now = timezone.now()
        params = {
            **ownership.lock_params(self.pk),
            "run": self.pk,
            "owner": self.owner,
            "seq": seq,
            "next": seq + 1,
            "tokens_in": usage.tokens_in,
            "tokens_out": usage.tokens_out,
            "cost": cost,
            "now": now,
            "name": name,
            "kind": kind,
            "input": json.dumps(input, cls=DjangoJSONEncoder),
            "input_hash": input_hash,
            "output": None if output is None else json.dumps(output, cls=DjangoJSONEncoder),  # NULL, as the ORM
            "attempt": self.attempt + 1,
            "latency_ms": latency_ms,
            "prompt_version": prompt_version,
            "tools_version": tools_version,
            "tape": None if tape is None else json.dumps(tape, cls=DjangoJSONEncoder),
            "started_at": started_at,
        }
        statement = ("checkpoint_finish" if finish else "checkpoint") + ("_new" if new else "")
        waiting = None
        if finish:
            # The last step's: the wake-up's count is a statement of its own (its snapshot comes after the
            # tenant's lock), sent with the checkpoint in one round trip (with the transaction's BEGIN), both
            # prepared: once a run.
            params.update(
                result=None if result is None else json.dumps(result, cls=DjangoJSONEncoder),
                cancelled=json.dumps(_CANCELLED),
                tenant=self.tenant,
                max=settings.TENANT_MAX_RUNNING,
            )
            checkpointed, woken = pipelined((queries[statement], params), (queries["wake"], params))
            row, waiting = (checkpointed.rows or [None])[0], woken.rows
        else:
            # The steps before the last: one prepared statement (sql.prepared_cursor), in autocommit.
            with prepared_cursor() as cursor:
                cursor.execute(queries[statement], params)
                row = cursor.fetchone()
        if row is None:
            raise OwnershipLost(f"run {self.pk}: cannot go to its next step from its current state")
        self.cancel_requested, stored, self.undo_reason = row[:3]
        self.cursor, self.attempt, self.error, self.updated_at = seq + 1, 0, "", now
        if finish and self.cancel_requested and self.undo_reason:
            pass  # a cancel and undo came while the last step ran: the run stays its owner's, to be undone
        elif finish:
            status = TRANSITIONS["stop" if self.cancel_requested else "succeed"].target
            result = dict(_CANCELLED) if self.cancel_requested else result
            self.status, self.owner, self.result, self.finished_at = status, "", result, now
            Run.wake_waiting_for_slot(self.tenant, locked=True, waiting=waiting)
            if status == Run.Status.CANCELLED:
                self._close_cards("cancelled")
        return json.loads(stored) if isinstance(stored, str | bytes) else stored

    def park(self, *, paused: bool, reason: str = "", paused_switch: str = "") -> bool:
        """Wait for a person (waiting_human) or for a switch or budget (paused), in the transaction that opens
        the card. A cancel requested while the step ran wins: the run ends cancelled instead, and False is
        returned (open no card)."""
        assert connection.in_atomic_block
        if self.owned():  # locks the row: a cancel committed before this is seen, a later one sees the park
            if not self.undo_reason:
                self.finish(Run.Status.CANCELLED, {"outcome": "cancelled"})
                return False
            if self.status == Run.Status.RUNNING:  # a cancel and undo: the owner undoes the run instead
                self.start_undo()
                return False
            # An undo under way is not stopped by a cancel: it parks like any other.
        self._swap(
            "pause" if paused else "park",
            by_owner=self.owner,
            owner="",
            pause_reason=reason,
            paused_switch=paused_switch,
        )
        return True

    def finish(self, status: str, result) -> None:
        """Succeeded, or cancelled, by its owner (the transitions `succeed` and `stop`)."""
        transition = {Run.Status.SUCCEEDED: "succeed", Run.Status.CANCELLED: "stop"}[status]
        assert connection.in_atomic_block, "the wake-up of a waiting run belongs to the finish's transaction"
        changes = {"status": TRANSITIONS[transition].target, **self._finished(result)}
        with connection.cursor() as cursor:
            # The CAS and the tenant's lock in one statement (the lock is taken once the row is updated, the
            # order of Run._swap), then the wake-up, whose snapshot comes after the lock (Run.free_slots).
            cursor.execute(
                queries["finish"],
                {
                    **ownership.lock_params(self.pk),
                    "id": self.pk,
                    "owner": self.owner,
                    "status": changes["status"],
                    "result": None if result is None else json.dumps(result, cls=DjangoJSONEncoder),
                    "now": changes["finished_at"],
                },
            )
            if cursor.fetchone() is None:
                raise OwnershipLost(f"run {self.pk}: cannot {transition} (to {status}) from its current state")
        for name, value in changes.items():
            setattr(self, name, value)
        self.updated_at = changes["finished_at"]
        Run.wake_waiting_for_slot(self.tenant, locked=True)
        if status == Run.Status.CANCELLED:
            self._close_cards("cancelled")

    def fail(self, error: str) -> None:
        """Failed for good (the caller writes its dead letter in the same transaction)."""
        self._swap("fail", by_owner=self.owner, **self._finished(None), error=error, undo_reason="")
        self._close_cards("cancelled")

    # Undo (runs.compensations decides when, and runs the compensations).

    def start_undo(self, reason: str = "", cause: dict | None = None) -> None:
        """The owner begins (or, a new owner, goes on with) undoing the run: `reason` why (Run.undo_reason, kept
        when blank), `cause` what ended its way forward (an error, a rejection, a cancel), kept in its result until
        the undo ends. Its pending cards close: nothing of its way forward runs any more."""
        reason = reason or self.undo_reason
        assert reason, "an undo has a reason"
        changes = {"undo_reason": reason}
        if cause is not None:  # its start: the compensations have attempts of their own
            changes.update(result={"outcome": "undoing", "reason": reason, "cause": cause}, attempt=0, error="")
        self._swap("start_undo", by_owner=self.owner, **changes)
        self._close_cards("cancelled")

    def end_undo(self, result: dict) -> None:
        """Every compensation ran (or a person took it over): the run is compensated."""
        self._swap("compensated", by_owner=self.owner, **self._finished(result))
        self._close_cards("cancelled")

    def undo_failed(self, error: str) -> None:
        """A compensation failed for good: the run parks for a person (the caller opens the card)."""
        self._swap("compensation_failed", by_owner=self.owner, owner="", error=error, attempt=0)

    def begin_external_undo(self, result: dict, reason: str = "cancelled") -> None:
        """An external run's cancel and undo, or reject and undo (external.undo): its agent runs the approved
        compensations, in the caller's transaction (the run's row locked). No job owns it; its pending cards close."""
        self._swap("undo_external", undo_reason=reason, cancel_requested=True, result=result)
        self._close_cards("cancelled")

    def end_external_undo(self, result: dict) -> None:
        """An external run's agent reported its last compensation (external.undo): compensated."""
        self._swap("external_compensated", where={"workflow": EXTERNAL_WORKFLOW}, **self._finished(result))

    def external_undo_failed(self, error: str) -> None:
        """An external run's agent reported that a compensation failed (external.undo): parked for a person."""
        self._swap("compensation_failed", where={"workflow": EXTERNAL_WORKFLOW}, error=error)

    def request_undo(self, reason: str = "cancelled") -> None:
        """A person's cancel and undo of a run no job drives (queued or parked): back to the queue, to be undone
        by its next job, in the caller's transaction (the run's row locked). Its pending cards close."""
        self._swap("undo", undo_reason=reason, pause_reason="", paused_switch="", waiting_for_slot_since=None)
        self._close_cards("cancelled")
        self.enqueue()

    def retry_later(self, error: str, attempt: int) -> None:
        """The step failed and will be retried by the same job (its retry strategy schedules it)."""
        self._swap("retry_later", by_owner=self.owner, owner="", error=error, attempt=attempt)

    def release(self, delay: float | None = None) -> None:
        """The owner gives the run back to the queue with a new job (its worker is stopping, or the kill
        switch that stopped an effect was released before the run could park)."""
        self._swap("release", by_owner=self.owner, owner="")
        self.enqueue(delay)

    def resume(self) -> None:
        """A parked run (a decision came, or its kill switch was released) goes back to the queue with its job,
        in the caller's transaction."""
        if self.workflow == EXTERNAL_WORKFLOW:
            return  # an external run's agent drives it, never a job (its compensation that failed: external.undo)
        self._swap("resume", pause_reason="", paused_switch="")
        self.enqueue()

    def requeue_failed(self) -> None:
        """The dead-letter queue gives a failed run a fresh attempt budget, from its last checkpoint."""
        self._swap("requeue_failed", finished_at=None, error="", attempt=0, cancel_requested=False)
        self.enqueue()

    def recover(self, owner: str) -> None:
        """A periodic sweep found this running run's lock free (its owner's session ended): back to the queue
        with a job, unless it moved meanwhile. Called under the run's advisory lock."""
        # The execution its owner was in counts as an attempt of the step (a step that kills its worker every
        # time ends in the dead-letter queue, not in a loop).
        self._swap("recover", by_owner=owner, owner="", attempt=F("attempt") + 1)
        self.enqueue()

    def cancel(self, by=None, reason: str = "") -> Run:
        """Cancel: a parked, queued or external run ends now (its cards close as cancelled); a running one stops
        between steps (its owner sees `cancel_requested`). Finished runs are left as they are, and so is a run
        being undone, parked or not (TransitionRefused: a channel's kill switch holds its compensations, and one that
        failed is decided on its card), but for an external run whose compensation failed (its undo is given up: no
        card can try it again). Cancel and undo: runs.compensations. `reason`: why, when not a person's own cancel
        (an erasure: runs.erasure), in its audit entry (and the result of a run that ends here)."""
        with transaction.atomic():
            # The run first, then its cards: the lock order of Approval.decide() and the engine.
            run = Run.objects.select_for_update().get(pk=self.pk)
            if run.is_finished:
                return run
            if not run.cancellable:
                raise TransitionRefused(
                    "the run is being undone: a cancel does not stop its compensations (a channel's kill switch "
                    "holds them; a compensation that failed is decided on its card)"
                )
            run.audit("run.cancel", {"status": run.status, **({"reason": reason} if reason else {})}, actor=by)
            Run.objects.filter(pk=run.pk).update(cancel_requested=True)
            run.cancel_requested = True
            if run.status != self.Status.RUNNING:
                result = {"outcome": "cancelled", **({"reason": reason} if reason else {})}
                run._swap("cancel", **run._finished(result), waiting_for_slot_since=None)
                run._close_cards("cancelled")
            return run

    def audit(self, action: str, data: dict, *, actor="engine", channel: str = "") -> None:
        """An audit entry about this run (its target, id and trace), in the caller's transaction. `actor`: a user, or a
        component's name."""
        AuditEntry.record(
            action,
            actor=actor,
            target=f"run:{self.id}",
            run_id=self.id,
            trace_id=self.trace_id,
            channel=channel,
            data=data,
        )

    @staticmethod
    def _finished(result) -> dict:
        return {"owner": "", "result": result, "finished_at": timezone.now()}

    def _close_cards(self, status: str) -> None:
        gates.backend().close_pending(self, status)

    @classmethod
    def _row_for_update(cls, run_id, owner: str) -> tuple[Run | None, bool]:
        """The run's row locked FOR UPDATE, then its tenant's transaction lock (the order of Run._swap's wake-up),
        in one precompiled statement (the claim's: no ORM compile), which also says whether this session holds
        the run's lock (OwnershipLost if not: the claim is made under it, runs.ownership). Then the start of a
        queued run under `owner` (`queries["start"]`: a free slot of its tenant and no older run of it waiting for one),
        a statement of its own, whose snapshot comes after the tenant's lock (Run.free_slots); then the run's step
        rows (`queries["step_rows"]`, in a snapshot after the row lock), kept as `step_rows`. All in one round trip
        (Django's client-side binding cursor runs them as one query string; with server-side binding, one after
        the other). Returns (run, started)."""
        fields = _run_fields()
        params = {
            "id": run_id,
            "owner": owner,
            "now": timezone.now(),
            "max": settings.TENANT_MAX_RUNNING,
            **ownership.lock_params(run_id),
        }
        with connection.cursor() as cursor:
            together = isinstance(cursor.cursor, psycopg.ClientCursor)
            sql = _claim_select_sql() + (";" + queries["start"] + ";" + queries["step_rows"] if together else "")
            cursor.execute(sql, params)
            row = cursor.fetchone()
            if together:
                cursor.nextset()
                started = cursor.rowcount == 1
                cursor.nextset()
                steps = cursor.fetchone()[0]
            if row is None:
                return None, False
            if not row[len(fields) + 1]:
                # The row and its start were read and written in this session, which does not hold the run's lock:
                # nothing may follow (a started run rolls back with the caller's transaction).
                raise OwnershipLost(f"run {run_id}: this database session does not hold the run's lock")
            values = [
                value if convert is None else convert(value, None, connection)
                for (_, convert), value in zip(fields, row[: len(fields)], strict=True)
            ]
            run = cls.from_db(connection.alias, [attname for attname, _ in fields], values)
            if not together:
                startable = run.status in TRANSITIONS["start"].sources and (not run.cancel_requested or run.undo_reason)
                started = startable and cursor.execute(queries["start"], params).rowcount == 1
                cursor.execute(queries["step_rows"], params)
                steps = cursor.fetchone()[0]
        run.step_rows = (json.loads(steps) if isinstance(steps, str | bytes) else steps) or []
        if started:
            run.status, run.owner, run.waiting_for_slot_since = TRANSITIONS["start"].target, owner, None
            run.updated_at = params["now"]
        return run, started

    @classmethod
    def waiting_for_slot(cls, tenant: str):
        return cls.objects.filter(
            tenant=tenant, status=cls.Status.QUEUED, waiting_for_slot_since__isnull=False
        ).order_by("-priority", "created_at")

    @classmethod
    def free_slots(cls, tenant: str) -> int:
        """Slots of `tenant` no running run takes, read under the tenant's transaction lock, which serialises
        claims (`queries["start"]`) with wake-ups (`wake_waiting_for_slot`): a run cannot start waiting just after
        the wake-up that would have given it the slot."""
        with connection.cursor() as cursor:
            cursor.execute(queries["lock_tenant"], [f"tenant:{tenant}"])
        return settings.TENANT_MAX_RUNNING - cls.objects.filter(tenant=tenant, status=cls.Status.RUNNING).count()

    @classmethod
    def wake_waiting_for_slot(cls, tenant: str, *, locked: bool = False, waiting: list | None = None) -> None:
        """A run of `tenant` left `running`: give the oldest runs waiting for a slot, one per free slot, their
        job (in the caller's transaction). `locked`: the caller already holds the tenant's lock (Run.finish).
        `waiting`: the caller already counted them (`queries["wake"]`, after the lock: Run.checkpoint)."""
        if waiting is None:
            with connection.cursor() as cursor:
                if not locked:
                    cursor.execute(queries["lock_tenant"], [f"tenant:{tenant}"])
                # Free slots and the runs waiting for them, counted in one statement after the lock.
                cursor.execute(queries["wake"], {"tenant": tenant, "max": settings.TENANT_MAX_RUNNING})
                waiting = cursor.fetchall()
        for pk, priority in waiting:
            Run(pk=pk, priority=priority).enqueue()


def _run_fields() -> list:
    """(attname, from_db_value or None) of the run's columns, in order."""
    global _RUN_FIELDS
    if _RUN_FIELDS is None:
        _RUN_FIELDS = [(f.attname, getattr(f, "from_db_value", None)) for f in Run._meta.concrete_fields]
    return _RUN_FIELDS


def _run_columns() -> str:
    return ", ".join(f'"{Run._meta.get_field(attname).column}"' for attname, _ in _run_fields())


@functools.cache
def _claim_select_sql() -> str:
    return queries["claim"].format(columns=_run_columns())


@functools.cache
def _claim_take_sql() -> str:
    return queries["claim_take"].format(columns=_run_columns())


_RUN_FIELDS = None


class StepKind(models.TextChoices):
    COMPUTE = "compute"
    READ = "read"
    EFFECT = "effect"
    GATE = "gate"


class StepStatus(models.TextChoices):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    UNKNOWN = "unknown"  # an effect whose outcome is not known (ambiguous write)
    WAITING = "waiting"  # parked in this step: resuming it is not a new attempt


class Step(models.Model):
    """A checkpoint: one step of one run. A done step is never executed again; replay reads its output."""

    Kind = StepKind
    Status = StepStatus

    # No index of its own: the unique (run, seq) below starts with it (one index fewer to write at every step).
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps", db_index=False)
    seq = models.PositiveIntegerField()
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=8, choices=Kind.choices)
    input = models.JSONField(null=True, encoder=DjangoJSONEncoder)
    input_hash = models.CharField(max_length=64)
    output = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.RUNNING)
    attempt = models.PositiveIntegerField(default=1)
    error = models.TextField(blank=True)
    tokens_in = models.PositiveIntegerField(default=0)
    tokens_out = models.PositiveIntegerField(default=0)
    cost = models.DecimalField(max_digits=12, decimal_places=6, default=Decimal(0))
    latency_ms = models.FloatField(null=True, blank=True)
    # An agent's steps (runs.agent): the prompt's version and a hash of the tools' schemas the turn was run with.
    prompt_version = models.CharField(max_length=64, blank=True)
    tools_version = models.CharField(max_length=64, blank=True)
    # What the step's code drew from outside, in order (runs.tape): the model's answers, reads, effects' keys, time
    # and ids, each with a hash of what was asked. Replay (runs.replay) feeds them back. NULL when it drew nothing.
    tape = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["run", "seq"], name="runs_step_one_per_seq"),
            models.CheckConstraint(condition=Q(kind__in=StepKind.values), name="runs_step_kind_valid"),
            models.CheckConstraint(condition=Q(status__in=StepStatus.values), name="runs_step_status_valid"),
            models.CheckConstraint(
                condition=~Q(status=StepStatus.DONE) | Q(ended_at__isnull=False), name="runs_step_done_has_ended_at"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq} {self.name}"


class ModelUsage(models.Model):
    """What one model call used, written as it answers, whatever happens to its step after (it fails, its job
    loses the run, its worker dies before the checkpoint): every attempt counts toward the run's cost limit (the
    run's totals are added to in the same statement) and the tenant's token rate (runs.ratelimit)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="model_usage")
    tenant = models.CharField(max_length=100)
    step = models.CharField(max_length=100)
    at = models.DateTimeField()
    tokens_in = models.PositiveIntegerField()
    tokens_out = models.PositiveIntegerField()
    cost = models.DecimalField(max_digits=12, decimal_places=6)

    class Meta:
        ordering = ["at"]
        indexes = [models.Index(fields=["tenant", "at"], name="runs_modelusage_tenant_at")]

    def __str__(self) -> str:
        return f"{self.step} of {self.run_id}: {self.tokens_in}+{self.tokens_out} tokens"

    @classmethod
    def record(cls, run: Run, step: str, tokens_in: int, tokens_out: int, cost: Decimal) -> None:
        """Count a model call's usage for `run` (its totals in memory follow the row). Not an owner's write: a
        job that lost the run still spent it. Its own statement, in autocommit; a connection found cut is
        reopened once (the tokens were spent whether or not the step goes on)."""
        params = {
            "run": run.pk,
            "tenant": run.tenant,
            "step": step[:100],
            "at": timezone.now(),
            "tokens_in": tokens_in,
            "tokens_out": tokens_out,
            "cost": Decimal(cost).quantize(_COST_QUANTUM, rounding=ROUND_HALF_UP),
        }
        for last_try in (False, True):
            try:
                with connection.cursor() as cursor:
                    cursor.execute(queries["record_usage"], params)
                    row = cursor.fetchone()
                break
            except DatabaseError:
                if last_try or connection.in_atomic_block:
                    raise
                connection.close()  # a session that was cut: the next statement opens a new one
        if row is not None:
            run.tokens_in, run.tokens_out, run.cost = row


class ReceiptStatus(models.TextChoices):
    PENDING = "pending"
    DONE = "done"


class Receipt(models.Model):
    """The idempotency record of one side effect: written before the call, completed after it."""

    Status = ReceiptStatus
    UNDO_PREFIX = "undo:"  # a compensation's key: the prefix, then its effect's key (runs.compensations)

    key = models.CharField(max_length=300, unique=True)
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="receipts")
    step_seq = models.PositiveIntegerField()
    channel = models.CharField(max_length=64)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    external_id = models.CharField(max_length=200, blank=True)
    response = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    reconciled = models.BooleanField(default=False, help_text="Completed by a lookup or a person, not the call.")
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(status__in=ReceiptStatus.values), name="runs_receipt_status_valid"),
            models.CheckConstraint(
                condition=Q(status=ReceiptStatus.PENDING, completed_at__isnull=True)
                | Q(status=ReceiptStatus.DONE, completed_at__isnull=False),
                name="runs_receipt_done_iff_completed_at",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.status})"

    def rearm(self) -> None:
        """Start a new attempt of this pending write (a person said the last one did not happen)."""
        with transaction.atomic():
            self.run.owned()
            self.created_at = timezone.now()
            Receipt.objects.filter(pk=self.pk, status=self.Status.PENDING).update(created_at=self.created_at)

    def complete(self, response: dict, *, reconciled: bool = False) -> dict:
        """The write happened (its answer, or a reconciliation says so): recorded by the run's owner."""
        with transaction.atomic():
            self.run.owned()
            self.status = self.Status.DONE
            self.external_id = str(response.get("id", ""))
            self.response = response
            self.reconciled = reconciled
            self.completed_at = timezone.now()
            self.save(update_fields=["status", "external_id", "response", "reconciled", "completed_at"])
        return response

    def complete_outcome(self, response: dict) -> None:
        """The outcome of an external agent's execution (external.executions.report), which no engine job owns:
        recorded once, by a compare-and-swap from pending (the caller holds the run's row lock)."""
        now = timezone.now()
        if not Receipt.objects.filter(pk=self.pk, status=self.Status.PENDING).update(
            status=self.Status.DONE, response=response, completed_at=now, external_id=str(response.get("id", ""))[:200]
        ):
            raise TransitionRefused(f"receipt {self.key} is not pending")
        self.status, self.response, self.completed_at = self.Status.DONE, response, now

    def discard(self) -> None:
        """The tool says the call was not applied: forget the pending write, so the next attempt calls again.
        Only the run's owner may (a successor that found it pending reconciles it instead)."""
        with transaction.atomic():
            self.run.owned()
            Receipt.objects.filter(pk=self.pk, status=self.Status.PENDING).delete()


class WebhookDelivery(models.Model):
    """A signed webhook delivery (runs.webhooks): the provider's delivery id, unique per source, is what makes
    the same delivery sent again (retried, or sent twice at once) answer with the run the first one made.

    `refused`: signed, but its body was not JSON or not a valid input; no run. A refused delivery does not
    block a later one with the same id (the provider may retry after a fix on either side)."""

    class Status(models.TextChoices):
        ACCEPTED = "accepted"  # made its run
        REFUSED = "refused"

    received_at = models.DateTimeField(default=timezone.now)
    source = models.CharField(max_length=64)
    delivery_id = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices)
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.PROTECT, related_name="webhook_deliveries")
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-received_at"]
        verbose_name_plural = "webhook deliveries"
        constraints = [
            models.UniqueConstraint(fields=["source", "delivery_id"], name="runs_webhookdelivery_source_delivery_id"),
            models.CheckConstraint(
                condition=Q(status__in=["accepted", "refused"]), name="runs_webhookdelivery_status_valid"
            ),
            # Not "accepted iff run": the accepted row is inserted before its run, in the run's transaction, so
            # that a concurrent copy of the delivery waits on the unique index instead of making a run too.
            models.CheckConstraint(
                condition=~Q(status="refused") | Q(run__isnull=True), name="runs_webhookdelivery_refused_no_run"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.source}:{self.delivery_id}"


class ShadowEffect(models.Model):
    """A side effect that shadow mode kept from its external system (runs.steps.Context.effect): what the
    agent would have done, for the person who does it by hand and for the team deciding when to go live.

    Written in the transaction that inserts the effect's receipt, so that it also says how that receipt's first
    attempt went: a pending receipt with a shadow effect never called out, and is completed without asking."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="shadow_effects")
    step_seq = models.PositiveIntegerField()
    step = models.CharField(max_length=100)
    channel = models.CharField(max_length=64)
    key = models.CharField(max_length=300, unique=True, help_text="The effect's receipt key.")
    preview = models.JSONField(
        null=True, blank=True, encoder=DjangoJSONEncoder, help_text="The call's arguments, as the step described them."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["run", "step_seq"], name="runs_shadoweffect_run_step")]

    def __str__(self) -> str:
        return f"shadow {self.channel} effect {self.key}"


class BreakerState(models.TextChoices):
    CLOSED = "closed"  # calls go through; their outcomes are counted
    OPEN = "open"  # calls are held back: steps that need the system wait
    HALF_OPEN = "half_open"  # one probe call is on its way; the others still wait


class Breaker(models.Model):
    """The circuit breaker of one external system (`model`, `payments`, `email`, `crm`, or a tool's own name),
    shared by every worker process: runs.breakers reads it before each call and counts outcomes on it, in
    short transactions that never span a call. A row is made the first time its system is guarded."""

    State = BreakerState

    system = models.SlugField(max_length=64, unique=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.CLOSED)
    forced = models.BooleanField(default=False, help_text="Held open by ops until they close it: no probe.")
    opened_at = models.DateTimeField(null=True, blank=True)
    open_until = models.DateTimeField(null=True, blank=True, help_text="When a probe may go (not when forced).")
    probe_started_at = models.DateTimeField(null=True, blank=True)
    window = models.JSONField(
        default=list, help_text="The latest outcomes in the window, oldest first: [unix time, 1 if it failed]."
    )
    held_back = models.PositiveIntegerField(default=0, help_text="Calls held back since it last opened.")
    last_error = models.TextField(blank=True)
    changed_at = models.DateTimeField(default=timezone.now)
    changed_by = models.CharField(max_length=150, blank=True, help_text="Who forced the last change; blank: itself.")

    class Meta:
        ordering = ["system"]
        constraints = [
            models.CheckConstraint(condition=Q(state__in=BreakerState.values), name="runs_breaker_state_valid"),
            models.CheckConstraint(
                condition=Q(state=BreakerState.CLOSED) | Q(opened_at__isnull=False),
                name="runs_breaker_open_has_opened_at",
            ),
            models.CheckConstraint(
                condition=Q(state=BreakerState.HALF_OPEN, probe_started_at__isnull=False)
                | (~Q(state=BreakerState.HALF_OPEN) & Q(probe_started_at__isnull=True)),
                name="runs_breaker_half_open_iff_probe",
            ),
            models.CheckConstraint(
                condition=Q(forced=False) | Q(state=BreakerState.OPEN), name="runs_breaker_forced_is_open"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.system} breaker ({self.state})"


class TenantThrottle(models.Model):
    """A tenant whose steps waited for the token rate limit (runs.ratelimit): until when the latest one waits,
    and how many waits there were. Written only when a step is held back, so the dashboard can say who is
    throttled."""

    tenant = models.CharField(max_length=100, unique=True)
    waiting_until = models.DateTimeField()
    used = models.PositiveIntegerField(help_text="Tokens the tenant had used in the last minute, at the last wait.")
    limit = models.PositiveIntegerField()
    waits = models.PositiveIntegerField(default=0)
    last_wait_at = models.DateTimeField()

    class Meta:
        ordering = ["-waiting_until"]

    def __str__(self) -> str:
        return f"{self.tenant} throttled until {self.waiting_until}"
