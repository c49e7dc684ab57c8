"""Password changes and API tokens (issued, revoked, deleted) are audited, with who did it and whose they are,
never the password, the token or its digest."""

from __future__ import annotations

import json
from io import StringIO

from django.core.management import call_command

from core.models import ApiToken, AuditEntry


def _everything_in(entry: AuditEntry) -> str:
    return json.dumps([str(getattr(entry, column)) for column in AuditEntry.COLUMNS] + [entry.data])


def _token_id_and_prefix(entry: AuditEntry) -> tuple[int, str]:
    return entry.data["token_id"], entry.data["prefix"]


# API tokens


def test_issuing_a_token_from_the_command_line_is_audited(bob):
    out = StringIO()
    call_command("create_api_token", "bob", stdout=out)
    raw, token = out.getvalue().strip(), ApiToken.objects.get(user=bob)
    entry = AuditEntry.objects.get(action="api_token.create")
    assert (entry.actor, entry.actor_type, entry.target) == ("manage.py create_api_token", "system", "user:bob")
    assert entry.data == {"user": "bob", "token_id": token.pk, "prefix": token.prefix}
    assert raw not in _everything_in(entry) and raw[13:] not in _everything_in(entry)
    assert token.digest not in _everything_in(entry)
    call_command("audit_verify", verbosity=0)


def test_issuing_a_token_names_who_issued_it(alice, bob):
    token, _ = ApiToken.issue(bob, by=alice)
    entry = AuditEntry.objects.get(action="api_token.create")
    assert (entry.actor, entry.actor_type, entry.target, _token_id_and_prefix(entry)) == (
        "alice",
        "human",
        "user:bob",
        (token.pk, token.prefix),
    )


def test_revoking_tokens_in_admin_is_audited_once(admin_client, bob, carol):
    (bobs, bob_raw), (carols, _) = ApiToken.issue(bob), ApiToken.issue(carol)
    selection = {"action": "revoke", "_selected_action": [bobs.pk, carols.pk]}
    response = admin_client.post("/admin/core/apitoken/", selection)
    assert response.status_code == 302
    assert not ApiToken.objects.filter(revoked_at__isnull=True).exists()
    entries = AuditEntry.objects.filter(action="api_token.revoke").order_by("target")
    assert [(e.actor, e.target, _token_id_and_prefix(e)) for e in entries] == [
        ("alice", "user:bob", (bobs.pk, bobs.prefix)),
        ("alice", "user:carol", (carols.pk, carols.prefix)),
    ]
    admin_client.post("/admin/core/apitoken/", selection)  # already revoked: nothing more to record
    assert AuditEntry.objects.filter(action="api_token.revoke").count() == 2
    assert admin_client.get("/api/me", headers={"Authorization": f"Bearer {bob_raw}"}).status_code == 401


def test_revoke_returns_whether_it_changed_anything(alice, bob):
    token, _ = ApiToken.issue(bob)
    assert token.revoke(alice) is True and token.revoked_at is not None
    assert ApiToken.objects.get(pk=token.pk).revoke(alice) is False
    assert AuditEntry.objects.filter(action="api_token.revoke").count() == 1


def test_a_token_cannot_be_edited_or_unrevoked_in_admin(admin_client, alice, bob):
    token, _ = ApiToken.issue(bob)
    token.revoke(alice)
    url = f"/admin/core/apitoken/{token.pk}/change/"
    page = admin_client.get(url)
    assert page.status_code == 200 and 'name="_save"' not in page.content.decode()
    assert admin_client.post(url, {"revoked_at_0": "", "revoked_at_1": ""}).status_code == 403
    assert ApiToken.objects.get(pk=token.pk).revoked_at is not None


def test_deleting_a_token_in_admin_is_audited(admin_client, bob):
    token, _ = ApiToken.issue(bob)
    response = admin_client.post(f"/admin/core/apitoken/{token.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302 and not ApiToken.objects.exists()
    entry = AuditEntry.objects.get(action="api_token.delete")
    assert (entry.actor, entry.target, _token_id_and_prefix(entry)) == ("alice", "user:bob", (token.pk, token.prefix))


# Passwords


def test_an_admin_changing_a_users_password_is_audited(admin_client, bob):
    new = "a-New-password-42"
    response = admin_client.post(
        f"/admin/auth/user/{bob.pk}/password/", {"usable_password": "true", "password1": new, "password2": new}
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    bob.refresh_from_db()
    assert bob.check_password(new)
    entry = AuditEntry.objects.get(action="user.password.change")
    assert (entry.actor, entry.actor_type, entry.target, entry.data) == ("alice", "human", "user:bob", {"user": "bob"})
    assert new not in _everything_in(entry) and bob.password not in _everything_in(entry)


def test_an_admin_disabling_a_users_password_is_audited(admin_client, bob):
    response = admin_client.post(
        f"/admin/auth/user/{bob.pk}/password/", {"usable_password": "false", "unset-password": "1"}
    )
    assert response.status_code == 302
    bob.refresh_from_db()
    assert not bob.has_usable_password()
    entry = AuditEntry.objects.get(action="user.password.disable")
    assert (entry.actor, entry.target) == ("alice", "user:bob")


def test_a_refused_password_change_in_admin_writes_nothing(admin_client, bob):
    response = admin_client.post(
        f"/admin/auth/user/{bob.pk}/password/",
        {"usable_password": "true", "password1": "a-New-password-42", "password2": "something else"},
    )
    assert response.status_code == 200
    assert admin_client.get(f"/admin/auth/user/{bob.pk}/password/").status_code == 200
    assert not AuditEntry.objects.exists()


def test_changing_ones_own_password_is_audited(client, bob):
    client.force_login(bob)
    new = "a-New-password-42"
    response = client.post(
        "/accounts/password_change/", {"old_password": "password", "new_password1": new, "new_password2": new}
    )
    assert response.status_code == 302 and response["Location"] == "/accounts/password_change/done/"
    bob.refresh_from_db()
    assert bob.check_password(new)
    entry = AuditEntry.objects.get(action="user.password.change")
    assert (entry.actor, entry.actor_type, entry.target) == ("bob", "human", "user:bob")
    assert new not in _everything_in(entry) and "password" not in entry.data
    assert client.get("/").status_code == 200  # still logged in


def test_a_wrong_old_password_writes_nothing(client, bob):
    client.force_login(bob)
    response = client.post(
        "/accounts/password_change/",
        {"old_password": "wrong", "new_password1": "a-New-password-42", "new_password2": "a-New-password-42"},
    )
    assert response.status_code == 200
    assert not AuditEntry.objects.exists()
