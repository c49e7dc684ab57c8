"""`manage.py worker`: this app's worker (jobs/worker.py), with the options of `manage.py procrastinate worker`.

Unlike procrastinate's command, it does not swap the app's Django connector for a plain psycopg one: the worker
loop runs on a pool, but a task's sync `.defer()` stays on the task thread's Django connection, inside its
transaction (WorkerConnector)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db.backends.signals import connection_created
from procrastinate import cli
from procrastinate.contrib.django import app
from procrastinate.contrib.django.django_connector import DjangoConnector

from core import tracing
from jobs import session_life
from jobs.internals import InternalsMismatch
from jobs.session_life import IdleTimeoutsOn, LocksOutliveSessions
from jobs.sessions import SessionPoolingRequired
from jobs.worker import Worker, WorkerConnector, log


class _Into:
    """Stands in for argparse subparsers, so procrastinate's own `worker` options land on our parser."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return self.parser


class Command(BaseCommand):
    help = "Run a worker: jobs of the given queues (default: all), until SIGTERM or SIGINT."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        self._django_options = {action.dest for action in parser._actions}
        # Options left unset fall back to PROCRASTINATE_WORKER_DEFAULTS, as with `manage.py procrastinate worker`.
        parser.argument_default = argparse.SUPPRESS
        try:
            cli.configure_worker_parser(_Into(parser))  # type: ignore[arg-type]
        finally:
            parser.argument_default = None

    def handle(self, *args: Any, **options: Any) -> None:
        # psycopg_pool warns on every failed reconnection attempt; the worker logs an outage once when it starts
        # and once when it ends (jobs.worker), and that is what an operator should read.
        logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
        # A job thread's Django connection holds its run's lock: no idle timeout may end its session.
        connection_created.connect(session_life.configure_django, dispatch_uid="jobs.session_life")
        options = {k: v for k, v in options.items() if k not in self._django_options and k != "func"}
        connector = app.connector
        if not isinstance(connector, DjangoConnector):
            raise CommandError(f"the procrastinate app has a {type(connector).__name__}, not a DjangoConnector")
        worker_connector = WorkerConnector.for_django(
            connector, pool_size=settings.WORKER_POOL_SIZE, application_names=settings.WORKER_APPLICATION_NAMES
        )
        with app.replace_connector(worker_connector):
            try:
                asyncio.run(self._run(options))
            # The database's procrastinate is not the one we expect, or the worker is behind a transaction pool, or
            # its sessions would end before their connections (idle timeouts) or outlive them (a session pool's
            # reset that keeps advisory locks).
            except (InternalsMismatch, SessionPoolingRequired, IdleTimeoutsOn, LocksOutliveSessions) as exc:
                raise CommandError(str(exc)) from exc

    async def _run(self, options: dict[str, Any]) -> None:
        async with app.open_async():
            app.perform_import_paths()
            worker = app._worker(**options)
            if not isinstance(worker, Worker):
                # PROCRASTINATE_ON_APP_READY is off (WORKER_KEEP_NOTIFICATIONS=0, to measure without the latch):
                # still our worker, with procrastinate's plain new-job event.
                worker = Worker(app=app, keep_notifications=False, **{**app.worker_defaults, **options})
            await worker.run()
        tracing.flush()  # the spans its last jobs made, before an exit that may skip the SDK's atexit hook
        _exit_now_if_jobs_outlived_the_timeout(worker)


def _exit_now_if_jobs_outlived_the_timeout(worker: Worker) -> None:
    """A step still running on a job thread when the graceful timeout ended was left `doing`, for another worker's
    stalled-job sweep (jobs.worker). Python would wait for that thread at exit (asyncio.run, then the interpreter,
    join an executor's threads), and the worker would outlive its own timeout until its supervisor's SIGKILL (a
    container's stop grace period, systemd's TimeoutStopSec). So it exits now, as that SIGKILL would end it: the
    step's transaction rolls back with its connection, its run's lock goes with its session."""
    if worker.job_threads is None or not (running := worker.job_threads.running()):
        return
    log.warning(
        "exiting with jobs still running past the graceful timeout: another worker's stalled-job sweep takes them back",
        jobs=running,
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
