"""Admin changes to channels and their object permissions are audited; the audit log is read-only in admin."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth.models import Group, Permission
from django.core.management import call_command
from django.db import transaction
from guardian.shortcuts import assign_perm, get_group_perms, get_user_perms

from core.models import AuditEntry, Channel


def _form(channel: Channel, **changes) -> dict:
    return {
        "name": channel.name,
        "description": channel.description,
        "sla": "01:00:00",
        "escalation_policy": channel.escalation_policy,
        "required_approvals": channel.required_approvals,
        "escalation_group": "",
        **changes,
    }


def test_creating_a_channel_is_audited(admin_client):
    response = admin_client.post("/admin/core/channel/add/", _form(Channel(name="crm"), description="CRM"))
    assert response.status_code == 302
    entry = AuditEntry.objects.get(action="channel.create")
    assert (entry.actor, entry.actor_type, entry.target, entry.channel) == ("alice", "human", "channel:crm", "crm")
    assert entry.data["changed"]["description"] == {"before": None, "after": "CRM"}


def test_changing_a_channel_is_audited_with_the_changed_fields(admin_client, payments):
    ops = Group.objects.create(name="payments-oncall")
    response = admin_client.post(
        f"/admin/core/channel/{payments.pk}/change/",
        _form(payments, required_approvals=2, sla="02:00:00", escalation_group=ops.pk),
    )
    assert response.status_code == 302
    entry = AuditEntry.objects.get(action="channel.change")
    assert (entry.actor, entry.channel) == ("alice", "payments")
    assert entry.data["changed"] == {
        "required_approvals": {"before": 1, "after": 2},
        "sla": {"before": "P0DT01H00M00S", "after": "P0DT02H00M00S"},
        "escalation_group": {"before": None, "after": "payments-oncall"},
    }
    call_command("audit_verify", verbosity=0)


def test_saving_a_channel_unchanged_writes_nothing(admin_client, payments):
    admin_client.post(f"/admin/core/channel/{payments.pk}/change/", _form(payments))
    assert not AuditEntry.objects.exists()


def test_deleting_a_channel_is_audited(admin_client, payments):
    response = admin_client.post(f"/admin/core/channel/{payments.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302 and not Channel.objects.exists()
    entry = AuditEntry.objects.get(action="channel.delete")
    assert (entry.actor, entry.target, entry.data["deleted"]["name"]) == ("alice", "channel:payments", "payments")


def test_deleting_channels_from_the_list_is_audited(admin_client, payments):
    email = Channel.objects.create(name="email")
    response = admin_client.post(
        "/admin/core/channel/",
        {"action": "delete_selected", "_selected_action": [payments.pk, email.pk], "post": "yes"},
    )
    assert response.status_code == 302 and not Channel.objects.exists()
    assert sorted(AuditEntry.objects.filter(action="channel.delete").values_list("channel", flat=True)) == [
        "email",
        "payments",
    ]


def test_granting_and_revoking_a_users_channel_permissions_is_audited(admin_client, payments, bob):
    url = f"/admin/core/channel/{payments.pk}/permissions/user-manage/{bob.pk}/"
    response = admin_client.post(url, {"permissions": ["approve_channel", "operate_channel"]})
    assert response.status_code == 302
    assert set(get_user_perms(bob, payments)) == {"approve_channel", "operate_channel"}
    admin_client.post(url, {"permissions": ["operate_channel"]})
    assert set(get_user_perms(bob, payments)) == {"operate_channel"}

    entries = [(e.action, e.data["permission"], e.actor) for e in AuditEntry.objects.order_by("id")]
    assert entries == [
        ("permission.grant", "approve_channel", "alice"),
        ("permission.grant", "operate_channel", "alice"),
        ("permission.revoke", "approve_channel", "alice"),
    ]
    assert all(e.data["user"] == "bob" and e.channel == "payments" for e in AuditEntry.objects.all())


def test_granting_and_revoking_a_groups_channel_permissions_is_audited(admin_client, payments):
    reviewers = Group.objects.create(name="payments-reviewers")
    url = f"/admin/core/channel/{payments.pk}/permissions/group-manage/{reviewers.pk}/"
    admin_client.post(url, {"permissions": ["approve_channel"]})
    admin_client.post(url, {"csrfmiddlewaretoken": "x"})  # nothing selected (a browser sends its CSRF token)
    assert not get_group_perms(reviewers, payments).exists()
    entries = [(e.action, e.data["permission"], e.data["group"]) for e in AuditEntry.objects.order_by("id")]
    assert entries == [
        ("permission.grant", "approve_channel", "payments-reviewers"),
        ("permission.revoke", "approve_channel", "payments-reviewers"),
    ]


def test_saving_unchanged_permissions_writes_nothing(admin_client, payments, bob):
    assign_perm("approve_channel", bob, payments)
    url = f"/admin/core/channel/{payments.pk}/permissions/user-manage/{bob.pk}/"
    assert admin_client.post(url, {"permissions": ["approve_channel"]}).status_code == 302
    assert not AuditEntry.objects.exists()


def test_the_audit_log_is_read_only_in_admin(admin_client, bob):
    with transaction.atomic():
        entry = AuditEntry.record("test.action", actor=bob, data={"comment": "hello"})
    assert admin_client.get("/admin/core/auditentry/").status_code == 200
    detail = admin_client.get(f"/admin/core/auditentry/{entry.pk}/change/")
    assert detail.status_code == 200
    assert entry.hash in detail.content.decode() and 'name="_save"' not in detail.content.decode()
    assert admin_client.get("/admin/core/auditentry/add/").status_code == 403
    assert admin_client.get(f"/admin/core/auditentry/{entry.pk}/delete/").status_code == 403
    response = admin_client.post(
        "/admin/core/auditentry/", {"action": "delete_selected", "_selected_action": [entry.pk], "post": "yes"}
    )
    assert AuditEntry.objects.filter(pk=entry.pk).exists()
    assert response.status_code in (200, 302)


# Users and roles (groups) in Django admin


def _user_form(user, **changes) -> dict:
    return {
        "username": user.username,
        "first_name": "",
        "last_name": "",
        "email": "",
        "is_active": "on",
        "groups": list(user.groups.values_list("pk", flat=True)),
        "user_permissions": [],
        "last_login_0": "",
        "last_login_1": "",
        "date_joined_0": "2026-11-29",
        "date_joined_1": "10:00:00",
        **changes,
    }


def test_giving_a_user_a_role_and_superuser_is_audited(admin_client, dave):
    admins = Group.objects.get(name="admin")
    view_audit = Permission.objects.get(codename="view_auditentry")
    response = admin_client.post(
        f"/admin/auth/user/{dave.pk}/change/",
        _user_form(dave, groups=[admins.pk], is_superuser="on", user_permissions=[view_audit.pk]),
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    dave.refresh_from_db()
    assert dave.is_superuser and dave.groups.filter(name="admin").exists()
    entry = AuditEntry.objects.get(action="user.access.change")
    assert (entry.actor, entry.target) == ("alice", "user:dave")
    assert entry.data["changed"] == {
        "is_superuser": {"before": False, "after": True},
        "groups": {"added": ["admin"], "removed": []},
        "permissions": {"added": ["core.view_auditentry"], "removed": []},
    }


def test_taking_a_role_away_is_audited(admin_client, bob):
    response = admin_client.post(f"/admin/auth/user/{bob.pk}/change/", _user_form(bob, groups=[]))
    assert response.status_code == 302
    entry = AuditEntry.objects.get(action="user.access.change")
    assert entry.data["changed"] == {"groups": {"added": [], "removed": ["reviewer"]}}


def test_changing_only_a_users_name_writes_nothing(admin_client, bob):
    admin_client.post(f"/admin/auth/user/{bob.pk}/change/", _user_form(bob, first_name="Bob"))
    assert not AuditEntry.objects.exists()


def test_creating_and_deleting_users_and_groups_is_audited(admin_client, carol):
    response = admin_client.post(
        "/admin/auth/user/add/", {"username": "erin", "password1": "x-Very-long-1", "password2": "x-Very-long-1"}
    )
    assert response.status_code == 302
    created = AuditEntry.objects.get(action="user.create")
    assert created.data["user"] == "erin"
    assert created.data["changed"]["is_superuser"] == {"before": None, "after": False}
    admin_client.post(f"/admin/auth/user/{carol.pk}/delete/", {"post": "yes"})
    deleted = AuditEntry.objects.get(action="user.delete")
    assert deleted.data == {
        "user": "carol",
        "access": {"is_active": True, "is_staff": False, "is_superuser": False, "groups": ["ops"], "permissions": []},
    }

    response = admin_client.post("/admin/auth/group/add/", {"name": "auditors", "permissions": []})
    assert response.status_code == 302
    group = Group.objects.get(name="auditors")
    view_audit = Permission.objects.get(codename="view_auditentry")
    admin_client.post(f"/admin/auth/group/{group.pk}/change/", {"name": "auditors", "permissions": [view_audit.pk]})
    admin_client.post(f"/admin/auth/group/{group.pk}/delete/", {"post": "yes"})
    actions = list(AuditEntry.objects.filter(target="group:auditors").order_by("id").values_list("action", "data"))
    assert actions == [
        ("group.create", {"group": "auditors", "changed": {}}),
        (
            "group.permissions.change",
            {"group": "auditors", "changed": {"permissions": {"added": ["core.view_auditentry"], "removed": []}}},
        ),
        ("group.delete", {"group": "auditors", "members": []}),
    ]
    call_command("audit_verify", verbosity=0)


def test_editing_a_channel_does_not_undo_a_kill_switch_flipped_meanwhile(rf, alice, carol, payments):
    stale = Channel.objects.get(pk=payments.pk)  # what the change form loaded: switch released
    Channel.objects.get(pk=payments.pk).engage_kill_switch(carol, "refunds look wrong")
    model_admin = admin.site._registry[Channel]
    request = rf.post("/")
    request.user = alice
    form = model_admin.get_form(request, stale)(instance=stale, data=_form(stale, description="Refunds"))
    assert form.is_valid(), form.errors
    model_admin.save_model(request, form.save(commit=False), form, change=True)
    payments.refresh_from_db()
    assert payments.description == "Refunds"
    assert payments.kill_switch_engaged and payments.kill_switch_reason == "refunds look wrong"


def test_the_old_admin_addresses_of_the_moved_models_lead_to_the_new_ones(admin_client, payments):
    """Channels, tokens, the audit log and the global switch moved from the console app to core (issue 18)."""
    response = admin_client.get(f"/admin/console/channel/{payments.pk}/change/?_changelist_filters=q%3Dpay")
    assert response.status_code == 302
    assert response["Location"] == f"/admin/core/channel/{payments.pk}/change/?_changelist_filters=q%3Dpay"
    assert admin_client.get("/admin/console/auditentry/", follow=True).status_code == 200
    assert admin_client.get("/admin/console/nothing/").status_code == 404
