"""`make run`: prepare the database, then serve the console with a production server and a worker.

The web server (uvicorn) and the Procrastinate worker run as child processes in their own process group, so
Ctrl-C reaches only this process, which stops them once, gracefully, and then stops the embedded PostgreSQL
(it exits last, through its exit handler). Children also get SIGTERM from the kernel if this process is
killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand

from console.env import env_bool, env_int
from runs.models import Run

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_SECONDS = 30


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Command(BaseCommand):
    help = "Migrate, seed the demo, and serve the console with an embedded worker (what `make run` does)."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=env_int("PORT", 8000))
        parser.add_argument("--no-worker", action="store_true", help="The same as RUN_WORKER=0.")

    def handle(self, *args, host, port, no_worker, **options):
        run_worker = env_bool("RUN_WORKER", True) and not no_worker
        call_command("migrate", interactive=False, verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        if settings.DEVELOPMENT:
            call_command("demo_setup", verbosity=0)
            if env_bool("DEMO_TRAFFIC", True) and not Run.objects.exists():  # a new database: show some cards
                call_command("demo_traffic", runs=6, seed=1, verbosity=0)

        env = {**os.environ, "DATABASE_URL": settings.DATABASE_URL}
        children = {
            "web": self._spawn(
                [
                    sys.executable,
                    "-m",
                    "console.webserver",
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--workers",
                    str(env_int("WEB_CONCURRENCY", os.cpu_count() or 1)),
                ],
                env,
            )
        }
        if run_worker:
            worker_env = {"DATABASE_CONN_MAX_AGE": "300", **env}  # unless the caller chose otherwise
            children["worker"] = self._spawn([sys.executable, "manage.py", "procrastinate", "worker"], worker_env)

        url = f"http://{host}:{port}/"
        self.stdout.write(self.style.SUCCESS(f"Console: {url}"))
        if settings.DEVELOPMENT:
            self.stdout.write(f"Demo logins: admin, reviewer, ops, outsider / password {settings.DEMO_PASSWORD!r}")
        self.stdout.write(
            "Worker: " + ("embedded" if run_worker else "not started (RUN_WORKER=0)") + ". Ctrl-C stops everything."
        )
        return self._supervise(children)

    def _spawn(self, argv: list[str], env: dict) -> subprocess.Popen:
        return subprocess.Popen(
            argv, env=env, cwd=settings.BASE_DIR, start_new_session=True, preexec_fn=_die_with_parent
        )

    def _supervise(self, children: dict[str, subprocess.Popen]) -> None:
        stopping = False

        def _stop(signum, frame):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGHUP, _stop)
        while not stopping and all(child.poll() is None for child in children.values()):
            time.sleep(0.2)
        died = [name for name, child in children.items() if child.poll() is not None]

        for child in children.values():
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        for child in children.values():
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if died and not stopping:
            self.stderr.write(f"Stopped because {', '.join(died)} exited unexpectedly.")
            sys.exit(1)
        self.stdout.write("Stopped.")
