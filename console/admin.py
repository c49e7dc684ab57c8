from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.db import transaction
from guardian.admin import GuardedModelAdmin

from console.models import ApiToken, AuditEntry, Channel, GlobalKillSwitch
from console.passwords import record_password_change


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
class AuditEntryAdmin(admin.ModelAdmin):
    """Read-only, like the table itself (the database refuses UPDATE and DELETE). The console's audit page
    (/audit/) has the filters, full-text search and CSV export."""

    list_display = ["id", "at", "actor", "actor_type", "action", "target", "channel"]
    list_display_links = ["id", "at"]
    show_full_result_count = False
    fields = AuditEntry.COLUMNS[1:]
    readonly_fields = fields

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(ApiToken)
class ApiTokenAdmin(AuditedDeletion, admin.ModelAdmin):
    """Tokens are issued by `manage.py create_api_token` (which shows the secret once) and revoked here with the
    "Revoke" action; both are audited. Nothing else about a token can be changed, and a revocation is final."""

    list_display = ["prefix", "user", "created_at", "last_used_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    readonly_fields = fields = ["user", "prefix", "digest", "created_at", "last_used_at", "revoked_at"]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_revoke_permission(self, request):
        return request.user.has_perm("console.change_apitoken")

    @admin.action(description="Revoke selected tokens", permissions=["revoke"])
    def revoke(self, request, queryset):
        revoked = sum(token.revoke(request.user) for token in queryset.select_related("user"))
        self.message_user(request, f"Revoked {revoked} token(s).")

    def _record_deletion(self, request, token) -> None:
        token.record_audit("api_token.delete", request.user)


@admin.register(GlobalKillSwitch)
class GlobalKillSwitchAdmin(admin.ModelAdmin):
    """Read-only here: the switch is engaged and released (with a reason, audited, resuming the runs it paused)
    on the console's channels page (/channels/) or through the API."""

    list_display = ["__str__", "kill_switch_reason", "kill_switch_by", "kill_switch_at"]
    readonly_fields = fields = ["kill_switch_engaged", "kill_switch_reason", "kill_switch_by", "kill_switch_at"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


def _access(user: User) -> dict:
    """What a user may do, as far as the user admin changes it: flags, roles (groups), global permissions."""
    return {
        "is_active": user.is_active,
        "is_staff": user.is_staff,
        "is_superuser": user.is_superuser,
        "groups": sorted(user.groups.values_list("name", flat=True)),
        "permissions": _permission_names(user.user_permissions),
    }


def _permission_names(permissions) -> list[str]:
    pairs = permissions.values_list("content_type__app_label", "codename")
    return sorted(f"{app}.{codename}" for app, codename in pairs)


def _changes(before: dict, after: dict) -> dict:
    """{field: {before, after}} for values, {field: {added, removed}} for lists; only what differs."""
    changes = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, list):
            added, removed = sorted(set(value) - set(old or [])), sorted(set(old or []) - set(value))
            if added or removed:
                changes[key] = {"added": added, "removed": removed}
        elif old != value:
            changes[key] = {"before": old, "after": value}
    return changes


admin.site.unregister(User)
admin.site.unregister(Group)


@admin.register(User)
class AuditedUserAdmin(AuditedDeletion, UserAdmin):
    """Django's user admin; every change to what a user may do (active, staff, superuser, roles, global
    permissions) is audited, in the transaction of the change form."""

    def user_change_password(self, request, id, form_url=""):
        # Django's view saves the form itself; whether it changed the password is read back in its transaction.
        with transaction.atomic():
            user = self.get_object(request, unquote(id))
            response = super().user_change_password(request, id, form_url)
            if user is not None:
                changed = User.objects.get(pk=user.pk)
                if changed.password != user.password:
                    record_password_change(changed, by=request.user)
        return response

    def save_model(self, request, obj, form, change):
        # Groups and permissions are saved after this, in save_related: take the "before" of both now.
        form.access_before = _access(User.objects.get(pk=obj.pk)) if change else {}
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        user = form.instance
        if changes := _changes(form.access_before, _access(user)):
            AuditEntry.record(
                "user.access.change" if change else "user.create",
                actor=request.user,
                target=f"user:{user.get_username()}",
                data={"user": user.get_username(), "changed": changes},
            )

    def _record_deletion(self, request, user) -> None:
        name = user.get_username()
        AuditEntry.record(
            "user.delete", actor=request.user, target=f"user:{name}", data={"user": name, "access": _access(user)}
        )


@admin.register(Group)
class AuditedGroupAdmin(AuditedDeletion, GroupAdmin):
    """Django's group (role) admin; changes to a group's global permissions are audited."""

    def save_model(self, request, obj, form, change):
        form.permissions_before = _permission_names(Group.objects.get(pk=obj.pk).permissions) if change else []
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        group = form.instance
        after = _permission_names(group.permissions)
        changes = _changes({"permissions": form.permissions_before}, {"permissions": after})
        if changes or not change:
            AuditEntry.record(
                "group.permissions.change" if change else "group.create",
                actor=request.user,
                target=f"group:{group.name}",
                data={"group": group.name, "changed": changes},
            )

    def _record_deletion(self, request, group) -> None:
        AuditEntry.record(
            "group.delete",
            actor=request.user,
            target=f"group:{group.name}",
            data={"group": group.name, "members": sorted(group.user_set.values_list("username", flat=True))},
        )
