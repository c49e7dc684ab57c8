"""Linking Slack accounts to users, and routing channels to Slack, in Django admin: every change audited."""

from __future__ import annotations

from django.contrib import admin
from django.db import transaction

from core.admin import AuditedDeletion, ReadOnly
from core.models import AuditEntry
from slackapp.models import SlackIdentity, SlackMessage, SlackRoute


def _identity(identity: SlackIdentity) -> dict:
    return {"user": identity.user.get_username(), "team_id": identity.team_id, "slack_user_id": identity.slack_user_id}


@admin.register(SlackIdentity)
class SlackIdentityAdmin(AuditedDeletion, admin.ModelAdmin):
    """Who a Slack account decides as. Link only an account you know is theirs (check it in Slack's profile:
    "Copy member ID"); the click of a linked account decides with all of that user's rights."""

    list_display = ["user", "team_id", "slack_user_id", "created_at"]
    search_fields = ["user__username", "slack_user_id", "team_id"]
    list_select_related = ["user"]
    autocomplete_fields = ["user"]

    def save_model(self, request, obj, form, change):
        with transaction.atomic():
            before = _identity(SlackIdentity.objects.select_for_update().get(pk=obj.pk)) if change else None
            super().save_model(request, obj, form, change)
            AuditEntry.record(
                "slack_identity.change" if change else "slack_identity.link",
                actor=request.user,
                target=f"user:{obj.user.get_username()}",
                data={**_identity(obj), **({"before": before} if before else {})},
            )

    def _record_deletion(self, request, obj) -> None:
        AuditEntry.record(
            "slack_identity.unlink", actor=request.user, target=f"user:{obj.user.get_username()}", data=_identity(obj)
        )


@admin.register(SlackRoute)
class SlackRouteAdmin(AuditedDeletion, admin.ModelAdmin):
    """Where a channel's new cards are posted in Slack (without one: SLACK_DEFAULT_CHANNEL, if set)."""

    list_display = ["channel", "slack_channel"]
    list_select_related = ["channel"]

    def save_model(self, request, obj, form, change):
        with transaction.atomic():
            before = SlackRoute.objects.select_for_update().get(pk=obj.pk).slack_channel if change else None
            super().save_model(request, obj, form, change)
            AuditEntry.record(
                "slack_route.set",
                actor=request.user,
                target=f"channel:{obj.channel}",
                channel=str(obj.channel),
                data={"slack_channel": obj.slack_channel, "before": before},
            )

    def _record_deletion(self, request, obj) -> None:
        AuditEntry.record(
            "slack_route.delete",
            actor=request.user,
            target=f"channel:{obj.channel}",
            channel=str(obj.channel),
            data={"slack_channel": obj.slack_channel},
        )


@admin.register(SlackMessage)
class SlackMessageAdmin(ReadOnly, admin.ModelAdmin):
    """The cards posted to Slack, where (read-only: the notifications that post and update them are under
    Approvals)."""

    list_display = ["approval", "slack_channel", "ts", "created_at"]
    readonly_fields = ["approval", "notification", "slack_channel", "ts", "created_at"]
