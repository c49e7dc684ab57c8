from __future__ import annotations

import os

import pytest
from django.contrib.auth.models import Group, User

from console.models import Channel, Role

# Playwright's sync API runs an event loop in the test thread; Django refuses ORM calls there unless told.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "1")


@pytest.fixture(autouse=True)
def _fast_tests(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    # Tests render templates without running collectstatic first.
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }


def _user(username: str, *roles: Role, superuser: bool = False) -> User:
    user = User.objects.create_user(username, password="password", is_superuser=superuser, is_staff=superuser)
    user.groups.add(*Group.objects.filter(name__in=roles))
    return user


@pytest.fixture
def alice(db):
    """Admin."""
    return _user("alice", Role.ADMIN, superuser=True)


@pytest.fixture
def bob(db):
    """Reviewer."""
    return _user("bob", Role.REVIEWER)


@pytest.fixture
def carol(db):
    """Ops."""
    return _user("carol", Role.OPS)


@pytest.fixture
def dave(db):
    """Outsider: no role."""
    return _user("dave")


@pytest.fixture
def payments(db):
    return Channel.objects.create(name="payments")


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def browser():
    """Debian's Chromium driven by Playwright (Playwright's own browser download cannot work here)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(10_000)
    yield page
    context.close()
