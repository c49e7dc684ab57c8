"""Django admin for users and groups (roles): Django's own, with every change to what a user may do audited. The
base models' admin (channels, audit log, API tokens) is core.admin."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.db import transaction

from console.passwords import record_password_change
from core.admin import AuditedDeletion
from core.models import AuditEntry


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
