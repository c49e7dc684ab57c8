from __future__ import annotations

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

# Views that answer without a session, on purpose.
PUBLIC = {
    "healthz",
    "readyz",
    "metrics",
    "login",
    "password_reset",
    "password_reset_done",
    "password_reset_confirm",
    "password_reset_complete",
    "logout",
    "admin:login",
    "slack-interactions",  # authenticated by Slack's signature (slackapp.interactions), not by a session
}


def _named_views(resolver: URLResolver, namespace: str = ""):
    for pattern in resolver.url_patterns:
        if isinstance(pattern, URLResolver):
            inner = f"{namespace}{pattern.namespace}:" if pattern.namespace else namespace
            yield from _named_views(pattern, inner)
        elif isinstance(pattern, URLPattern):
            yield f"{namespace}{pattern.name}", pattern


def test_every_console_view_requires_login():
    """The middleware makes login the default; only the views listed above (and the API, which answers 401
    itself) may opt out."""
    opted_out = {
        name
        for name, pattern in _named_views(get_resolver())
        if getattr(pattern.callback, "login_required", True) is False and not name.startswith("api:")
    }
    assert opted_out <= PUBLIC


@pytest.mark.parametrize("url", ["/", "/accounts/password_change/"])
def test_anonymous_is_sent_to_login(client, db, url):
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"] == f"/accounts/login/?next={url}"


def test_admin_sends_anonymous_to_its_login(client, db):
    response = client.get("/admin/")
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_it_logs_in_and_out(client, bob):
    response = client.post("/accounts/login/", {"username": "bob", "password": "password"})
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200
    response = client.post("/accounts/logout/")
    assert response.status_code == 302
    assert client.get("/").status_code == 302


def test_a_wrong_password_is_refused(client, bob):
    response = client.post("/accounts/login/", {"username": "bob", "password": "nope"})
    assert response.status_code == 200
    assert b"didn't match" in response.content
    assert client.get("/").status_code == 302


@pytest.mark.parametrize(
    ("user", "role"), [("alice", "admin"), ("bob", "reviewer"), ("carol", "ops"), ("dave", "none")]
)
def test_home_shows_an_empty_state_for_each_role(client, request, user, role):
    client.force_login(request.getfixturevalue(user))
    response = client.get("/")
    assert response.status_code == 200
    assert f'data-role="{role}"'.encode() in response.content
