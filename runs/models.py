from __future__ import annotations

import uuid
from decimal import Decimal

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, connection, models, transaction
from django.db.models import Q
from django.utils import timezone


def new_trace_id() -> str:
    return uuid.uuid4().hex


class IdempotencyConflict(Exception):
    pass


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    WAITING_HUMAN = "waiting_human"
    PAUSED = "paused"  # parked by a kill switch or the cost limit
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # in the dead-letter queue
    CANCELLED = "cancelled"


class Run(models.Model):
    """One agent execution: advanced step by step by `runs.engine`, one job at a time."""

    Status = RunStatus

    FINISHED = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)
    PARKED = (Status.WAITING_HUMAN, Status.PAUSED)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workflow = models.CharField(max_length=100)
    workflow_version = models.PositiveIntegerField()
    tenant = models.CharField(max_length=100, default="default")
    input = models.JSONField(encoder=DjangoJSONEncoder)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    attempt = models.PositiveIntegerField(default=0, help_text="Failed attempts of the current step.")
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
    idempotency_key = models.CharField(max_length=200, null=True, blank=True, unique=True)
    trace_id = models.CharField(max_length=32, default=new_trace_id)
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
            models.Index(fields=["paused_switch"], condition=Q(status="paused"), name="runs_run_paused_switch"),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(status__in=RunStatus.values), name="runs_run_status_valid"),
            models.CheckConstraint(
                condition=Q(status__in=["succeeded", "failed", "cancelled"], finished_at__isnull=False)
                | (~Q(status__in=["succeeded", "failed", "cancelled"]) & Q(finished_at__isnull=True)),
                name="runs_run_finished_iff_finished_at",
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

    @classmethod
    def visible_to(cls, user):
        """The runs `user` may see: all of them for superusers, ops and admins; for others the runs they started
        and the runs with a card on a channel they may approve."""
        from guardian.shortcuts import get_objects_for_user

        from console.models import Channel, Role

        if not user.is_authenticated:
            return cls.objects.none()
        if user.is_superuser or user.groups.filter(name__in=[Role.OPS, Role.ADMIN]).exists():
            return cls.objects.all()
        channels = get_objects_for_user(user, "console.approve_channel", klass=Channel, accept_global_perms=False)
        with_cards = cls.objects.filter(approvals__channel__in=channels).values("pk")
        return cls.objects.filter(Q(created_by=user) | Q(pk__in=with_cards))

    def is_visible_to(self, user) -> bool:
        from console.models import Role

        if not user.is_authenticated:
            return False
        if user.is_superuser or self.created_by_id == user.pk:
            return True
        if user.groups.filter(name__in=[Role.OPS, Role.ADMIN]).exists():
            return True
        return any(user.has_perm("console.approve_channel", card.channel) for card in self.approvals.all())

    @classmethod
    def submit(
        cls,
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
        request raises IdempotencyConflict."""
        from runs import workflow as workflows

        definition = workflows.get(workflow)  # raises UnknownWorkflow
        try:
            with transaction.atomic():
                run = cls.objects.create(
                    workflow=definition.name,
                    workflow_version=definition.version,
                    input=input,
                    tenant=tenant,
                    priority=priority,
                    idempotency_key=idempotency_key,
                    created_by=created_by,
                    cost_limit=cost_limit,
                    max_attempts=settings.RUN_MAX_ATTEMPTS,
                )
                run.enqueue()
                return run, True
        except IntegrityError:
            if idempotency_key is None:
                raise
        existing = cls.objects.get(idempotency_key=idempotency_key)
        if existing.created_by_id != getattr(created_by, "pk", None):
            # Someone else's key: say nothing about their run.
            raise IdempotencyConflict(f"idempotency key {idempotency_key!r} is already in use")
        if (existing.workflow, existing.input, existing.tenant) != (definition.name, input, tenant):
            raise IdempotencyConflict(
                f"idempotency key {idempotency_key!r} was used for a different request (run {existing.id})"
            )
        return existing, False

    def enqueue(self, delay: float | None = None) -> None:
        """Defer `advance_run` for this run, as part of the caller's transaction (the outbox). At most one job
        per run waits in the queue (queueing lock) and one runs at a time (lock)."""
        from procrastinate.exceptions import AlreadyEnqueued

        from runs.tasks import advance_run

        assert connection.in_atomic_block, "enqueue() must run inside the transaction that changes the run"
        lock = f"run:{self.pk}"
        try:
            with transaction.atomic():  # a savepoint: AlreadyEnqueued must not abort the caller's transaction
                advance_run.configure(
                    lock=lock,
                    queueing_lock=lock,
                    priority=self.priority,
                    schedule_in={"seconds": delay} if delay else None,
                ).defer(run_id=str(self.pk))
        except AlreadyEnqueued:
            pass  # a job for this run is already waiting: it will see the new state

    @classmethod
    def paused_by(cls, switch: str):
        return cls.objects.filter(status=cls.Status.PAUSED, paused_switch=switch)

    @classmethod
    def resume_paused_by(cls, switch: str, **_) -> int:
        """Queue every run the kill switch `switch` paused, each with its job deferred in the caller's
        transaction (the release's: console.models.kill_switch_released)."""
        assert connection.in_atomic_block
        count = 0
        for run in cls.paused_by(switch).select_for_update():
            run.resume()
            count += 1
        return count

    def resume(self) -> None:
        """A parked run (a decision came, or its kill switch was released) goes back to the queue with its job,
        in the caller's transaction."""
        self.status = self.Status.QUEUED
        self.pause_reason = ""
        self.paused_switch = ""
        self.save(update_fields=["status", "pause_reason", "paused_switch", "updated_at"])
        self.enqueue()

    def cancel(self, by=None) -> Run:
        """Cancel: a parked or queued run ends now (its cards close as cancelled); a running one stops
        between steps. Finished runs are left as they are."""
        from console.models import AuditEntry
        from runs import gates

        with transaction.atomic():
            run = Run.objects.select_for_update().get(pk=self.pk)
            if run.is_finished:
                return run
            AuditEntry.record(
                "run.cancel",
                actor=by,
                target=f"run:{run.id}",
                run_id=run.id,
                trace_id=run.trace_id,
                data={"status": run.status},
            )
            run.cancel_requested = True
            if run.status != self.Status.RUNNING:
                run.status = self.Status.CANCELLED
                run.finished_at = timezone.now()
                run.result = {"outcome": "cancelled"}
                gates.backend().close_pending(run, "cancelled")
            run.save()
            return run


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


class Step(models.Model):
    """A checkpoint: one step of one run. A done step is never executed again; replay reads its output."""

    Kind = StepKind
    Status = StepStatus

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps")
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
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["run", "seq"], name="runs_step_one_per_seq"),
            models.CheckConstraint(condition=Q(kind__in=StepKind.values), name="runs_step_kind_valid"),
            models.CheckConstraint(condition=Q(status__in=StepStatus.values), name="runs_step_status_valid"),
            models.CheckConstraint(
                condition=~Q(status="done") | Q(ended_at__isnull=False), name="runs_step_done_has_ended_at"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq} {self.name}"


class Receipt(models.Model):
    """The idempotency record of one side effect: written before the call, completed after it."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DONE = "done"

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
            models.CheckConstraint(condition=Q(status__in=["pending", "done"]), name="runs_receipt_status_valid"),
            models.CheckConstraint(
                condition=Q(status="pending", completed_at__isnull=True) | Q(status="done", completed_at__isnull=False),
                name="runs_receipt_done_iff_completed_at",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.status})"

    def rearm(self) -> None:
        """Start a new attempt of this pending write (a person said the last one did not happen)."""
        self.created_at = timezone.now()
        Receipt.objects.filter(pk=self.pk, status=self.Status.PENDING).update(created_at=self.created_at)

    def complete(self, response: dict, *, reconciled: bool = False) -> dict:
        self.status = self.Status.DONE
        self.external_id = str(response.get("id", ""))
        self.response = response
        self.reconciled = reconciled
        self.completed_at = timezone.now()
        self.save(update_fields=["status", "external_id", "response", "reconciled", "completed_at"])
        return response


class SandboxCall(models.Model):
    """A call received by one of the demo's fake external systems (payments, email, crm) or its fake model.

    Deliberately not idempotent: every call is a row, so a duplicate side effect is visible."""

    system = models.CharField(max_length=16)
    operation = models.CharField(max_length=64)
    idempotency_key = models.CharField(max_length=300, blank=True)
    run_id = models.UUIDField(null=True, blank=True)
    payload = models.JSONField(default=dict, encoder=DjangoJSONEncoder)
    applied = models.BooleanField(default=True, help_text="False: received but refused (an injected fault).")
    external_id = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            models.Index(fields=["system", "idempotency_key"], name="runs_sandbox_system_key"),
            models.Index(fields=["run_id", "system", "operation"], name="runs_sandbox_run_op"),
        ]
