"""Django admin for the base models: channels and their object permissions, the audit log (read-only), API
tokens, the global kill switch. Every change made here is audited. The user and group admins are the project's
(console.admin)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db import transaction
from django.template.response import TemplateResponse
from guardian.admin import GuardedModelAdmin

from core.models import ApiToken, AuditEntry, Channel, GlobalKillSwitch


def _channel_state(channel: Channel) -> dict:
    """The stored fields of a channel, for its audit entries (a related group or user by its name)."""
    state = {}
    for field in Channel._meta.concrete_fields:
        if field.primary_key:
            continue
        value = getattr(channel, field.name)
        state[field.name] = str(value) if field.is_relation and value is not None else value
    return state


def _audited_permissions_form(form_class, actor, holder_kind: str):
    """`form_class` (guardian's user or group object-permission form) whose save writes one audit entry per
    permission granted or revoked, in the transaction that changes it."""

    class AuditedPermissionsForm(form_class):
        def save_obj_perms(self) -> None:
            holder = getattr(self, holder_kind)
            with transaction.atomic():
                before = set(self.get_obj_perms_field_initial())
                super().save_obj_perms()
                after = set(self.get_obj_perms_field_initial())
                for action, perms in (("permission.grant", after - before), ("permission.revoke", before - after)):
                    for perm in sorted(perms):
                        AuditEntry.record(
                            action,
                            actor=actor,
                            target=f"channel:{self.obj}",
                            channel=str(self.obj),
                            data={"permission": perm, holder_kind: str(holder)},
                        )

    return AuditedPermissionsForm


class ReadOnly:
    """A Django admin that shows and never adds, changes or deletes: what the code (or the database) writes."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class AuditedDeletion:
    """Deleting from Django admin, one object or a selection, writes one audit entry per object
    (`_record_deletion`) in the deletion's transaction."""

    def delete_model(self, request, obj):
        with transaction.atomic():
            self._record_deletion(request, obj)
            super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        with transaction.atomic():
            for obj in queryset:
                self._record_deletion(request, obj)
            super().delete_queryset(request, queryset)


@admin.register(Channel)
class ChannelAdmin(AuditedDeletion, GuardedModelAdmin):
    """Object permissions (approve_channel, operate_channel) are assigned from each channel's
    "Object permissions" page. Every change made here, to a channel or to its permissions, is audited."""

    list_display = ["name", "required_approvals", "sla", "escalation_policy", "shadow", "kill_switch_engaged"]
    readonly_fields = ["kill_switch_engaged", "kill_switch_reason", "kill_switch_by", "kill_switch_at"]

    def save_model(self, request, obj, form, change):
        # Django admin runs this inside the change form's transaction; the lock keeps "before" true.
        before = _channel_state(Channel.objects.select_for_update().get(pk=obj.pk)) if change else {}
        if change:
            # Only what the form edited: the kill switch columns of `obj` were read before the lock, and writing
            # them back would undo a switch flipped in between.
            obj.save(update_fields=form.changed_data)
        else:
            super().save_model(request, obj, form, change)
        after = _channel_state(obj)
        changed = {
            name: {"before": before.get(name), "after": value}
            for name, value in after.items()
            if not change or before.get(name) != value
        }
        if changed:
            AuditEntry.record(
                "channel.change" if change else "channel.create",
                actor=request.user,
                target=f"channel:{obj.name}",
                channel=obj.name,
                data={"changed": changed},
            )

    def _record_deletion(self, request, channel) -> None:
        AuditEntry.record(
            "channel.delete",
            actor=request.user,
            target=f"channel:{channel.name}",
            channel=channel.name,
            data={"deleted": _channel_state(channel)},
        )

    def get_obj_perms_manage_user_form(self, request):
        return _audited_permissions_form(super().get_obj_perms_manage_user_form(request), request.user, "user")

    def get_obj_perms_manage_group_form(self, request):
        return _audited_permissions_form(super().get_obj_perms_manage_group_form(request), request.user, "group")


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnly, admin.ModelAdmin):
    """Read-only, like the table itself (the database refuses UPDATE and DELETE). The console's audit page
    (/audit/) has the filters, full-text search and CSV export."""

    list_display = ["id", "at", "actor", "actor_type", "action", "target", "channel"]
    list_display_links = ["id", "at"]
    show_full_result_count = False
    fields = AuditEntry.COLUMNS[1:]
    readonly_fields = fields


@admin.register(ApiToken)
class ApiTokenAdmin(AuditedDeletion, admin.ModelAdmin):
    """Tokens are issued by `manage.py create_api_token` (which shows the secret once) and revoked here with the
    "Revoke" action; both are audited. Nothing else about a token can be changed, and a revocation is final.
    A token's callback signing secret is never shown here, except once: on the page that a rotation (the action
    "Rotate callback signing secret", one token at a time, audited) answers with."""

    list_display = ["prefix", "user", "created_at", "last_used_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    readonly_fields = fields = ["user", "prefix", "digest", "created_at", "last_used_at", "revoked_at"]
    actions = ["revoke", "rotate_callback_secret"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_revoke_permission(self, request):
        return request.user.has_perm("core.change_apitoken")

    @admin.action(description="Revoke selected tokens", permissions=["revoke"])
    def revoke(self, request, queryset):
        revoked = sum(token.revoke(request.user) for token in queryset.select_related("user"))
        self.message_user(request, f"Revoked {revoked} token(s).")

    @admin.action(description="Rotate callback signing secret (one token)", permissions=["revoke"])
    def rotate_callback_secret(self, request, queryset):
        tokens = list(queryset.select_related("user")[:2])
        if len(tokens) != 1 or tokens[0].revoked_at is not None:
            self.message_user(request, "Select one live token to rotate its callback secret.", messages.WARNING)
            return None
        token = tokens[0]
        secret = token.rotate_callback_secret(request.user)
        context = {**self.admin_site.each_context(request), "title": "New callback signing secret", "token": token}
        # The secret is in this page alone (not in a message that would travel in a cookie); admin's views are
        # never cached.
        return TemplateResponse(request, "admin/core/apitoken/callback_secret.html", {**context, "secret": secret})

    def _record_deletion(self, request, token) -> None:
        token.record_audit("api_token.delete", request.user)


@admin.register(GlobalKillSwitch)
class GlobalKillSwitchAdmin(ReadOnly, admin.ModelAdmin):
    """Read-only here: the switch is engaged and released (with a reason, audited, resuming the runs it paused)
    on the console's channels page (/channels/) or through the API."""

    list_display = ["__str__", "kill_switch_reason", "kill_switch_by", "kill_switch_at"]
    readonly_fields = fields = ["kill_switch_engaged", "kill_switch_reason", "kill_switch_by", "kill_switch_at"]
