"""Login throttling (django-axes): after LOGIN_FAILURE_LIMIT failed logins from one IP address, or for one
username, further attempts get 429 without their password being checked; a successful login resets the count."""

from __future__ import annotations

from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.utils import timezone

LOGIN = "/accounts/login/"
LIMIT = 5  # LOGIN_FAILURE_LIMIT's default


def log_in(client, username: str, password: str, ip: str = "10.0.0.1"):
    return client.post(LOGIN, {"username": username, "password": password}, REMOTE_ADDR=ip)


def fail(client, username: str, times: int, ips: list[str] | None = None) -> None:
    """`times` failed logins. The one that reaches the limit is itself answered 429 (django-axes locks out
    as the limit is reached), the ones before it show the login form's error."""
    for attempt in range(1, times + 1):
        ip = ips[attempt - 1] if ips else "10.0.0.1"
        response = log_in(client, username, "wrong", ip)
        expected = 429 if attempt >= LIMIT else 200
        assert response.status_code == expected, f"attempt {attempt} was {response.status_code}"
        if expected == 200:
            assert "match" in response.content.decode()


@pytest.fixture
def password_checks(monkeypatch) -> list[str]:
    """The usernames whose password was checked, in order."""
    checked: list[str] = []
    original = User.check_password

    def spy(user, raw):
        checked.append(user.username)
        return original(user, raw)

    monkeypatch.setattr(User, "check_password", spy)
    return checked


def test_the_limit_is_the_documented_default():
    assert django_settings.AXES_FAILURE_LIMIT == LIMIT
    assert django_settings.AXES_COOLOFF_TIME.total_seconds() == 15 * 60


def test_after_the_limit_even_the_right_password_gets_429_and_is_not_checked(client, bob, password_checks):
    fail(client, "bob", LIMIT)
    assert password_checks == ["bob"] * LIMIT

    response = log_in(client, "bob", "password")

    assert response.status_code == 429
    assert "Too many failed logins" in response.content.decode()
    assert password_checks == ["bob"] * LIMIT  # refused before any backend looked at the password
    assert "_auth_user_id" not in client.session


def test_one_failure_fewer_than_the_limit_still_lets_you_in(client, bob):
    fail(client, "bob", LIMIT - 1)

    response = log_in(client, "bob", "password")

    assert response.status_code == 302
    assert client.session["_auth_user_id"] == str(bob.pk)


def test_the_limit_counts_per_ip_address_across_usernames(client, bob, carol):
    statuses = [log_in(client, name, "wrong", ip="10.0.0.9").status_code for name in ["x", "bob", "y", "carol", "z"]]
    assert statuses == [200] * (LIMIT - 1) + [429]

    assert log_in(client, "carol", "password", ip="10.0.0.9").status_code == 429
    # The same user from elsewhere is not locked out: it was the address that failed.
    assert log_in(client, "carol", "password", ip="10.0.0.10").status_code == 302


def test_the_limit_counts_per_username_across_addresses(client, bob, carol):
    fail(client, "bob", LIMIT, ips=[f"10.1.0.{n}" for n in range(LIMIT)])

    assert log_in(client, "bob", "password", ip="10.2.0.1").status_code == 429
    # Another user from that fresh address logs in: it was the username that failed.
    assert log_in(client, "carol", "password", ip="10.2.0.1").status_code == 302


def test_a_successful_login_resets_the_count(client, bob):
    fail(client, "bob", LIMIT - 1)
    assert log_in(client, "bob", "password").status_code == 302
    client.post("/accounts/logout/")

    fail(client, "bob", LIMIT - 1)

    assert log_in(client, "bob", "password").status_code == 302


def test_the_lockout_ends_after_the_cool_off(client, bob):
    fail(client, "bob", LIMIT)
    assert log_in(client, "bob", "password").status_code == 429

    AccessAttempt.objects.update(attempt_time=timezone.now() - timedelta(minutes=16))

    assert log_in(client, "bob", "password").status_code == 302


def test_the_admin_login_is_throttled_too(client, alice):
    for _ in range(LIMIT):
        client.post("/admin/login/", {"username": "alice", "password": "wrong"}, REMOTE_ADDR="10.0.0.3")

    response = client.post("/admin/login/", {"username": "alice", "password": "password"}, REMOTE_ADDR="10.0.0.3")

    assert response.status_code == 429
