"""Runs in Django admin, read-only, with their checkpointed steps: where a dead letter links to. Runs change
only through the engine, the API and the dead-letter actions, which are audited."""

from __future__ import annotations

import json

from django.contrib import admin, messages
from django.core.serializers.json import DjangoJSONEncoder
from django.urls import reverse
from django.utils.html import format_html

import runs.dead_letter_admin  # noqa: F401 - registers the dead-letter queue (jobs.DeadLetter)
from core.access import has_role, oversees
from core.admin import ReadOnly
from core.models import PiiSubject, Role
from runs.erasure import UnknownSubject, erase_subject
from runs.models import Receipt, Run, ShadowEffect, Step, WebhookDelivery


def _pretty(value):
    text = json.dumps(value, indent=2, sort_keys=True, cls=DjangoJSONEncoder)
    return format_html('<pre style="white-space: pre-wrap; margin: 0">{}</pre>', text)


class ReadOnlyForOpsAndAdmins(ReadOnly):
    """Ops and admins see runs (as in the API); nobody edits them here."""

    def has_module_permission(self, request):
        return oversees(request.user)

    def has_view_permission(self, request, obj=None):
        return oversees(request.user)


class StepInline(ReadOnlyForOpsAndAdmins, admin.TabularInline):
    model = Step
    fields = ["seq", "name", "kind", "status", "attempt", "error", "tokens_in", "tokens_out", "cost", "latency_ms"]
    readonly_fields = fields
    ordering = ["seq"]
    extra = 0
    can_delete = False
    show_change_link = False


class ReceiptInline(ReadOnlyForOpsAndAdmins, admin.TabularInline):
    """What each side effect of the run did: a done receipt is why an effect asked for again is a no-op."""

    model = Receipt
    fields = ["key", "channel", "step_seq", "status", "reconciled", "external_id", "created_at", "completed_at"]
    readonly_fields = fields
    ordering = ["step_seq", "created_at"]
    extra = 0
    can_delete = False


class ShadowEffectInline(ReadOnlyForOpsAndAdmins, admin.TabularInline):
    """Effects that shadow mode recorded instead of sending (runs.steps.Context.effect)."""

    model = ShadowEffect
    fields = ["step_seq", "step", "channel", "key", "preview", "created_at"]
    readonly_fields = fields
    ordering = ["step_seq", "created_at"]
    extra = 0
    can_delete = False


@admin.register(Run)
class RunAdmin(ReadOnlyForOpsAndAdmins, admin.ModelAdmin):
    list_display = ["id", "workflow", "status", "tenant", "cursor", "attempt", "cost", "created_at", "finished_at"]
    list_filter = ["status", "workflow", "tenant"]
    search_fields = ["=id", "=trace_id", "=idempotency_key"]
    list_per_page = 50
    inlines = [StepInline, ReceiptInline, ShadowEffectInline]
    fieldsets = [
        (None, {"fields": ["id", "workflow", "workflow_version", "tenant", "status", "dead_letter_link"]}),
        ("Progress", {"fields": ["cursor", "attempt", "max_attempts", "error", "pause_reason", "cancel_requested"]}),
        ("Data", {"fields": ["pretty_input", "pretty_result"]}),
        ("Cost", {"fields": ["tokens_in", "tokens_out", "cost", "cost_limit"]}),
        (
            "Tracing",
            {"fields": ["trace_id", "idempotency_key", "created_by", "created_at", "updated_at", "finished_at"]},
        ),
    ]
    readonly_fields = [field for _, options in fieldsets for field in options["fields"]]

    @admin.display(description="input")
    def pretty_input(self, run: Run):
        return _pretty(run.input)

    @admin.display(description="result")
    def pretty_result(self, run: Run):
        return _pretty(run.result)

    @admin.display(description="dead letters")
    def dead_letter_link(self, run: Run):
        url = reverse("admin:jobs_deadletter_changelist") + f"?q={run.id}"
        return format_html('<a href="{}">dead letters of this run</a>', url)


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyForOpsAndAdmins, admin.ModelAdmin):
    """Signed webhook deliveries (runs.webhooks): which made a run, which were refused and why."""

    list_display = ["received_at", "source", "delivery_id", "status", "run_link"]
    list_filter = ["status", "source"]
    search_fields = ["=delivery_id", "=run__id"]
    list_select_related = ["run"]
    list_per_page = 50
    fields = ["received_at", "source", "delivery_id", "status", "run_link", "error"]
    readonly_fields = fields

    @admin.display(description="run")
    def run_link(self, delivery: WebhookDelivery):
        if delivery.run_id is None:
            return "-"
        url = reverse("admin:runs_run_change", args=[delivery.run_id])
        return format_html('<a href="{}">{}</a>', url, delivery.run)


@admin.register(ShadowEffect)
class ShadowEffectAdmin(ReadOnlyForOpsAndAdmins, admin.ModelAdmin):
    """Side effects that shadow mode kept from the external systems: what the agent would have done."""

    list_display = ["created_at", "channel", "step", "key", "run_link"]
    list_filter = ["channel", "step"]
    search_fields = ["=key", "=run__id"]
    list_select_related = ["run"]
    list_per_page = 50
    fields = ["created_at", "run_link", "step_seq", "step", "channel", "key", "pretty_preview"]
    readonly_fields = fields

    @admin.display(description="run")
    def run_link(self, effect: ShadowEffect):
        return format_html('<a href="{}">{}</a>', reverse("admin:runs_run_change", args=[effect.run_id]), effect.run_id)

    @admin.display(description="preview")
    def pretty_preview(self, effect: ShadowEffect):
        return _pretty(effect.preview)


@admin.register(PiiSubject)
class PiiSubjectAdmin(ReadOnlyForOpsAndAdmins, admin.ModelAdmin):
    """The data subjects whose personal data the vault holds (docs/personal-data.md): never their keys or values.
    Admins erase a subject here (the same as `manage.py erase_subject`: runs.erasure)."""

    list_display = ["subject", "values_held", "created_at", "erased_at", "erased_by"]
    search_fields = ["=subject"]
    list_filter = [("erased_at", admin.EmptyFieldListFilter)]
    list_per_page = 50
    fields = ["subject", "key_id", "values_held", "created_at", "erased_at", "erased_by"]
    readonly_fields = fields
    actions = ["erase"]

    @admin.display(description="values")
    def values_held(self, subject: PiiSubject) -> int:
        return subject.values.count()

    def has_erase_permission(self, request) -> bool:
        return has_role(request.user, Role.ADMIN)

    @admin.action(
        description="Erase the selected subjects (their personal data becomes unreadable; runs cancelled)",
        permissions=["erase"],
    )
    def erase(self, request, queryset):
        for subject in queryset.order_by("subject"):
            try:
                done = erase_subject(subject.subject, by=request.user, reason="erased from admin")
            except UnknownSubject as exc:
                self.message_user(request, str(exc), messages.WARNING)
            else:
                self.message_user(request, done.describe(), messages.SUCCESS)
