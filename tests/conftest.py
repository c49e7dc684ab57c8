from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.hashers import PBKDF2PasswordHasher, make_password
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.db import connection, connections
from django.db.backends.postgresql.operations import DatabaseOperations
from guardian.shortcuts import assign_perm

from core.models import Channel, Role
from tests.openai_stub import openai_stub  # noqa: F401 - a fixture
from tests.worker import database_url, start_worker  # noqa: F401 - start_worker is a fixture

# Playwright's sync API runs an event loop in the test thread; Django refuses ORM calls there unless told.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "1")


def pytest_configure(config):
    # In process, WhiteNoise scans a STATIC_ROOT of this session's own, empty (the pages name static files as they
    # are: `_fast_tests`). The checkout's staticfiles/ is rewritten by any collectstatic that runs beside the tests
    # (for the servers system tests start, or `make bench-smoke` in CI): WhiteNoise scanning it while a file was
    # replaced failed a test (FileNotFoundError). It must exist: WhiteNoise warns, an error here, when it does not.
    static_root = Path(tempfile.mkdtemp(prefix="console-tests-static-"))
    django_settings.STATIC_ROOT = static_root
    config.add_cleanup(lambda: shutil.rmtree(static_root, ignore_errors=True))
    _allow_audit_truncate_in_flush()


TESTS = Path(__file__).resolve().parent
# tests/deploy builds images and runs compose.yaml's stack for minutes: `make test-deploy` only, which asks for it.
collect_ignore = [] if os.environ.get("DEPLOY_TESTS") == "1" else ["deploy"]
# Fixtures that give a test the database; a test under tests/unit takes none of them.
DATABASE_FIXTURES = {"db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback"}


def pytest_collection_modifyitems(config, items):
    """The markers follow the folders: tests/unit (no database), tests/integration (the database, in-process),
    tests/system (real processes: workers, the web server, PostgreSQL servers of their own) and tests/browser
    (Playwright). Everything under system and browser is `slow` (`make test-fast`, `-m 'not slow'`, skips it), and
    browser tests are `browser` too. A unit test that asks for the database is an error: it belongs in
    integration. The Python client's own tests (clients/python/tests) are unit tests of the client: no tier."""
    for item in items:
        path = item.path.resolve()
        if not path.is_relative_to(TESTS):
            continue
        tier = path.relative_to(TESTS).parts[0]
        if tier in ("system", "browser"):
            item.add_marker(pytest.mark.slow)
        if tier == "browser":
            item.add_marker(pytest.mark.browser)
        if tier == "unit" and (DATABASE_FIXTURES & set(item.fixturenames) or item.get_closest_marker("django_db")):
            raise pytest.UsageError(f"{item.nodeid} uses the database: move it to tests/integration")
    # The browser tests last: Playwright's sync API keeps an event loop running in the main thread from the
    # session's browser on, and a test after it that calls asyncio.run (the client's and its adapters' tests, the
    # MCP gateway's system test) would fail with "asyncio.run() cannot be called from a running event loop".
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)


def _allow_audit_truncate_in_flush() -> None:
    """The flush after a transactional test TRUNCATEs every table, which the audit log's trigger refuses
    (migration console.0009) unless the table's owner asks for it in the flush's transaction. Only the flush is
    let through: any other TRUNCATE of the log in a test is refused as in production."""
    flush = DatabaseOperations.execute_sql_flush

    def execute_sql_flush(self, sql_list):
        flush(self, ["SET LOCAL console.allow_audit_truncate = on", *sql_list])

    DatabaseOperations.execute_sql_flush = execute_sql_flush


@pytest.fixture(autouse=True)
def _empty_job_queue(request, django_db_blocker):
    """Procrastinate's tables are not Django models, so the flush after a transactional test leaves their
    rows behind, where the next test's worker would find jobs of runs that no longer exist."""
    yield
    if "transactional_db" in request.fixturenames:
        with django_db_blocker.unblock(), connection.cursor() as cursor:
            cursor.execute(
                "TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_periodic_defers,"
                " procrastinate_workers CASCADE"
            )


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
    user.groups.add(*(Group.objects.get_or_create(name=role)[0] for role in roles))
    return user


def approves_every_channel(user: User) -> User:
    """`user` may decide the cards of every channel there is now (`approve_channel` on each, a guardian object
    permission: Approval.decide checks it, as the card page and the API do)."""
    for channel in Channel.objects.all():
        assign_perm("core.approve_channel", user, channel)
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
def admin_client(client, alice):
    """A client logged in as Alice (in place of pytest-django's, whose `admin` the demo's would clash with)."""
    client.force_login(alice)
    return client


@pytest.fixture
def demo(db):
    """The demo (`manage.py demo_setup`): channels payments, email and crm; users admin, reviewer (approves on
    every channel), ops (operates every channel), outsider and agent, by username."""
    call_command("demo_setup", verbosity=0)
    return {user.username: user for user in User.objects.all()}


@pytest.fixture
def rita(demo):
    """A second reviewer of every demo channel, to race or follow the demo's `reviewer` (two-person rule)."""
    user = User.objects.create_user("rita")
    for channel in Channel.objects.all():
        assign_perm("core.approve_channel", user, channel)
    return user


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


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium driven by Playwright (Playwright's own browser download cannot work here). One per module:
    Playwright's sync API keeps an event loop running in the thread while it is open, so a later test of the
    same process that calls asyncio.run (the MCP adapter's, when CI spreads the files over two processes) would
    find it running."""
    from playwright.sync_api import sync_playwright  # noqa: PLC0415 - only browser tests pay for it

    # Django keeps a connection per context, and Playwright's sync API switches contexts (greenlets) on
    # entry and exit: close the connections of each side, or one stays open and the test database cannot be
    # dropped.
    connections.close_all()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
        connections.close_all()


def set_production_password(user, password: str = "password") -> None:
    """Tests hash with MD5 for speed; the console server runs with the production hashers, so a user who logs
    in through its login page needs a password hashed the production way."""
    user.password = make_password(password, hasher=PBKDF2PasswordHasher())
    user.save(update_fields=["password"])


def log_in(page, server, username: str = "reviewer") -> None:
    """Log in through the console server's login page (a user with set_production_password)."""
    page.goto(server.url + "/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", "password")
    page.click("button[type=submit]")
    page.wait_for_url(server.url + "/")


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(10_000)
    yield page
    context.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ConsoleServer:
    """The production web server (uvicorn, `python -m console.webserver`) in its own process, on the test
    database. Tests that use it see each other's writes only when committed: they use `transactional_db`."""

    def __init__(self, env: dict):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "console.webserver", "--port", str(self.port)],
            cwd=django_settings.BASE_DIR,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1):
                    return
            except OSError:
                assert self.proc.poll() is None, "the console server exited at start-up"
                assert time.monotonic() < deadline, "the console server did not answer within 30 s"
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="session")
def _console_env(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock():
        env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict)}
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "-v0"],
        cwd=django_settings.BASE_DIR,
        env=env,
        check=True,
    )
    return env


@pytest.fixture
def console_server(_console_env, transactional_db):
    """A server per test: the flush after each transactional test recreates content types under new ids,
    which a longer-lived server process would still have cached (and permission checks would fail)."""
    server = ConsoleServer(_console_env)
    yield server
    server.stop()


@pytest.fixture
def reviewer(console_server):
    """The demo's reviewer, able to log in to the console server (browser tests)."""
    call_command("demo_setup", verbosity=0)
    user = User.objects.get(username="reviewer")
    set_production_password(user)
    return user
