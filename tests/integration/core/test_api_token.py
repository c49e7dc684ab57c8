from __future__ import annotations

import hashlib
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from core.models import ApiToken


def _issue(username: str) -> str:
    out = StringIO()
    call_command("create_api_token", username, stdout=out)
    return out.getvalue()


def test_it_prints_the_token_alone(bob):
    printed = _issue("bob")
    assert printed.endswith("\n") and printed.count("\n") == 1
    token = printed.strip()
    assert token.startswith("hitl_") and len(token) > 40


def test_it_stores_only_a_hash(bob):
    token = _issue("bob").strip()
    stored = ApiToken.objects.get(user=bob)
    assert token not in (stored.digest, stored.prefix)
    assert len(stored.digest) == 64
    assert ApiToken.authenticate(token) == bob


def test_it_refuses_an_unknown_user(db):
    with pytest.raises(CommandError, match="No active user named 'nobody'"):
        call_command("create_api_token", "nobody")
    assert not ApiToken.objects.exists()


def test_the_api_accepts_a_bearer_token(client, bob):
    token = _issue("bob").strip()
    response = client.get("/api/me", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200
    assert response.json() == {"username": "bob", "groups": ["reviewer"]}
    assert ApiToken.objects.get(user=bob).last_used_at is not None


@pytest.mark.parametrize(
    "header", [None, "Bearer", "Bearer not-a-token", "Basic Ym9iOnBhc3N3b3Jk", "bearer hitl_wrong"]
)
def test_the_api_answers_401_json_without_a_valid_token(client, bob, header):
    headers = {"Authorization": header} if header else {}
    response = client.get("/api/me", headers=headers)
    assert response.status_code == 401
    assert response.json()["error"] == "unauthorized"
    assert response["WWW-Authenticate"] == "Bearer"


def test_a_revoked_token_is_refused(client, bob):
    token = _issue("bob").strip()
    ApiToken.objects.filter(user=bob).update(revoked_at=timezone.now())
    assert client.get("/api/me", headers={"Authorization": f"Bearer {token}"}).status_code == 401


def test_a_deactivated_users_token_is_refused(client, bob):
    token = _issue("bob").strip()
    bob.is_active = False
    bob.save()
    assert client.get("/api/me", headers={"Authorization": f"Bearer {token}"}).status_code == 401


def test_a_session_is_not_enough_for_the_api(client, bob):
    client.force_login(bob)
    assert client.get("/api/me").status_code == 401


def test_unknown_api_paths_answer_404(client, db):
    assert client.get("/api/nothing-here").status_code == 404


def test_find_gives_what_the_orm_gives_in_one_query(bob, django_assert_num_queries):
    """ApiToken.find runs the queryset's SQL compiled once per process (core.models._token_query): the token
    and its user as the ORM would load them, in one query, with no second one for the user."""
    _, raw = ApiToken.issue(bob, tenants=["acme", "default"])
    ApiToken.find(raw)  # notes its use (one UPDATE, at most once a minute)
    expected = ApiToken._active(hashlib.sha256(raw.encode()).hexdigest()).get()
    with django_assert_num_queries(1):
        found = ApiToken.find(raw)
        assert found.user == bob and found.user.username == "bob" and found.user.is_active
    fields = [f.attname for f in ApiToken._meta.concrete_fields]
    assert [getattr(found, f) for f in fields] == [getattr(expected, f) for f in fields]
    assert found.tenants == ["acme", "default"] and found.allows_tenant("acme")
    assert not found._state.adding and found._state.db == "default"
    assert ApiToken.find(raw + "x") is None
