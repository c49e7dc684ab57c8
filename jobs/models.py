"""Dead letters: the runs that failed for good, kept with what the on-call person needs, and how each was resolved
(requeued, or marked resolved)."""

from __future__ import annotations

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q


class Resolution(models.TextChoices):
    REQUEUED = "requeued"
    RESOLVED = "resolved"


class DeadLetter(models.Model):
    """A run that failed for good, with what the on-call person needs: the original input, the last error
    and its traceback, the attempts, the step, the trace id and the job id."""

    run_id = models.UUIDField(db_index=True)  # not a foreign key: jobs sits below runs
    workflow = models.CharField(max_length=100)
    input = models.JSONField(encoder=DjangoJSONEncoder)
    error = models.TextField()
    error_class = models.CharField(max_length=200)
    traceback = models.TextField()
    attempts = models.PositiveIntegerField()
    step = models.CharField(max_length=100, blank=True)
    trace_id = models.CharField(max_length=32)
    job_id = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    Resolution = Resolution

    resolution = models.CharField(max_length=16, blank=True, choices=Resolution.choices)
    note = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(resolved_at__isnull=True, resolution="")
                | Q(resolved_at__isnull=False, resolution__in=Resolution.values),
                name="jobs_deadletter_resolved_iff_resolution",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.workflow} {self.run_id}: {self.error_class}"
