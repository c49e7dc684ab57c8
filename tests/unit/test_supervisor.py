"""`manage.py serve` keeps the console up: a worker, web server or embedded PostgreSQL that dies is logged and
started again with backoff; only a signal to serve itself stops everything. Here its backoff and children; the
real thing: tests/system/test_supervisor_serve.py."""

from __future__ import annotations

from django.conf import settings

from console.management.commands import serve


def test_backoff_doubles_up_to_a_cap_and_resets_after_a_stable_run():
    backoff = serve.Backoff()
    assert [backoff.next(stayed_up=2) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.next(stayed_up=serve.STABLE_AFTER_SECONDS) == 1
    assert backoff.next(stayed_up=0.5) == 2


def test_the_worker_child_is_the_worker_command_once_it_exists():
    argv = serve.worker_argv()
    if (settings.BASE_DIR / "jobs/management/commands/worker.py").exists():
        assert argv[1:] == ["manage.py", "worker"]
    else:
        assert argv[1:] == ["manage.py", "procrastinate", "worker"]
