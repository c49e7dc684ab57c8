"""Notifications in Django admin: one that kept failing stays visible here with its last error, and can be sent
again. The Approve and Reject links their emails carried (approvals.links), read-only: who got which, until when,
and whether it was used."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db import transaction
from django.utils.html import format_html
from procrastinate.contrib.django import app

from approvals.models import DecisionLink, Notification


@admin.register(Notification)
class NotificationAdmin(admin.ModelAdmin):
    list_display = ["created_at", "event", "backend", "card", "group", "status", "attempts", "short_error", "sent_at"]
    list_filter = ["status", "backend", "event"]
    search_fields = ["last_error", "approval__id"]
    date_hierarchy = "created_at"
    list_select_related = ["group"]
    readonly_fields = [
        "approval",
        "event",
        "backend",
        "group",
        "payload",
        "status",
        "attempts",
        "last_error",
        "created_at",
        "sent_at",
    ]
    actions = ["send_again"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="card", ordering="approval_id")
    def card(self, obj: Notification):
        return format_html('<a href="/approvals/{}/">card {}</a>', obj.approval_id, obj.approval_id)

    @admin.display(description="last error")
    def short_error(self, obj: Notification) -> str:
        return obj.last_error[:120]

    @admin.action(description="Send the selected failed notifications again")
    def send_again(self, request, queryset) -> None:
        count = 0
        with transaction.atomic():
            for notification in (
                queryset.select_related(None).select_for_update(of=("self",)).filter(status=Notification.Status.FAILED)
            ):
                Notification.objects.filter(pk=notification.pk).update(status=Notification.Status.PENDING, attempts=0)
                # By its name, as the SLA policy defers it (approvals.policy): tasks are deferred by name.
                app.configure_task("approvals.tasks.send_notification", allow_unknown=False).defer(
                    notification_id=notification.pk
                )
                count += 1
        self.message_user(request, f"{count} notification(s) queued again.", messages.SUCCESS)


@admin.register(DecisionLink)
class DecisionLinkAdmin(admin.ModelAdmin):
    """Read-only: a link is made by the email backend and used by a decision, never edited by hand (the token
    itself is never shown: it is the id signed, and would let its recipient's session decide)."""

    list_display = ["created_at", "card", "recipient", "decision", "expires_at", "emailed_at", "used_at"]
    list_filter = ["decision"]
    search_fields = ["recipient__username", "approval__id"]
    date_hierarchy = "created_at"
    list_select_related = ["recipient"]
    fields = ["approval", "notification", "recipient", "decision", "expires_at", "created_at", "emailed_at", "used_at"]
    readonly_fields = fields

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="card", ordering="approval_id")
    def card(self, obj: DecisionLink):
        return format_html('<a href="/approvals/{}/">card {}</a>', obj.approval_id, obj.approval_id)
