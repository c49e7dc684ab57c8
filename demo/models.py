"""The demo's fake external systems record every call they receive (demo.sandbox)."""

from __future__ import annotations

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models


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
        db_table = "runs_sandboxcall"  # made by runs' first migration, before the demo was an app of its own
        indexes = [
            models.Index(fields=["system", "idempotency_key"], name="runs_sandbox_system_key"),
            models.Index(fields=["run_id", "system", "operation"], name="runs_sandbox_run_op"),
        ]
