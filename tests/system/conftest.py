"""System tests: real processes (workers, the production web server, `manage.py serve`, PostgreSQL servers of a
test's own), all `slow` (tests/conftest.py marks this folder). Most start what they need through the fixtures of
tests/conftest.py and tests/worker.py; the scenarios below run the whole product as it is deployed, on a fresh
database (the `system` fixture).

The production web server (`python -m console.webserver`) and standalone worker processes run against the
test database; the tests drive them only as agents, reviewers and operators do: over HTTP with API tokens,
and with signals to the worker processes (SIGKILL for a crash, SIGTERM for a deploy). The database is read
directly only to check the outcome: runs, steps, jobs, dead letters and what the demo's deliberately
non-idempotent fake systems received (`manage.py sandbox_stats`).

Sizes can be made smaller while developing with environment variables (see each test module).
"""

from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.db import connection, connections
from django.db.models import Q
from django.utils import timezone
from guardian.shortcuts import assign_perm
from procrastinate.contrib.django.models import ProcrastinateJob

from core.models import Channel, Role
from demo.models import SandboxCall
from runs.models import Run, Step
from tests.conftest import ConsoleServer, _free_port
from tests.worker import FAST_WORKER_ENV, Worker, database_url

# `manage.py worker` is the product's own worker command; before it existed, procrastinate's was the one.
WORKER_COMMAND = (
    ["manage.py", "worker"]
    if (settings.BASE_DIR / "jobs" / "management" / "commands" / "worker.py").exists()
    else ["manage.py", "procrastinate", "worker"]
)

# The stalled-job sweep, every second: as a period where the settings read one, else as a cron (older
# settings; the newer ones refuse STALLED_SWEEP_CRON).
STALLED_SWEEP = (
    {"STALLED_SWEEP_SECONDS": "1"}
    if hasattr(settings, "STALLED_SWEEP_SECONDS")
    else {"STALLED_SWEEP_CRON": "* * * * * *"}
)
SYSTEM_ENV = {
    **{k: v for k, v in FAST_WORKER_ENV.items() if not k.startswith("STALLED_SWEEP_")},
    **STALLED_SWEEP,
    # As production workers are configured (docs/deploy.md): keep connections between jobs.
    "DATABASE_CONN_MAX_AGE": "300",
    "LOG_LEVEL": "INFO",
    # A SIGKILLed worker's last log lines are what explain a failure: do not let them die in a buffer.
    "PYTHONUNBUFFERED": "1",
}

GRACEFUL_TIMEOUT = float(SYSTEM_ENV["WORKER_SHUTDOWN_GRACEFUL_TIMEOUT"])
STALLED_AFTER = float(SYSTEM_ENV["STALLED_AFTER_SECONDS"])


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# HTTP


@dataclass
class Response:
    status: int
    body: Any


class Api:
    """A JSON API client with one user's token (urllib: no dependency the product does not have)."""

    def __init__(self, url: str, token: str | None = None, who: str = ""):
        self.url = url
        self.token = token
        self.who = who

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 30) -> Response:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return Response(response.status, _json(response.read()))
        except urllib.error.HTTPError as exc:
            return Response(exc.code, _json(exc.read()))

    def get(self, path: str) -> Response:
        return self.call("GET", path)

    def post(self, path: str, body: dict) -> Response:
        return self.call("POST", path, body)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode(errors="replace")


# Worker processes


class SystemWorker(Worker):
    """A standalone worker process (tests.worker.Worker, started with the product's worker command)."""

    def __init__(self, env: dict, log_path, number: int):
        self.number = number
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, *WORKER_COMMAND],
            cwd=settings.BASE_DIR,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.started_at = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def events(self) -> list[dict]:
        """The worker's JSON log lines, parsed (`at` is the line's timestamp as a datetime)."""
        events = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if "timestamp" in event:
                    event["at"] = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
                    events.append(event)
        return events

    def shutdown(self) -> tuple[datetime | None, datetime | None]:
        """When the worker handled its stop request and when it had stopped, by its own log: the graceful
        timeout runs from the first (a loaded machine may take seconds to deliver the signal)."""
        requested = stopped = None
        for event in self.events():
            if requested is None and event.get("event", "").startswith("Stop requested"):
                requested = event["at"]
            if event.get("event", "").startswith("Stopped worker"):
                stopped = event["at"]
        return requested, stopped

    @property
    def ready(self) -> bool:
        """Up and taking jobs: procrastinate has logged its start (a worker takes seconds to boot on a loaded
        machine; killing it then interrupts nothing)."""
        return self.alive and b"Starting worker" in self.log_path.read_bytes()


class Workers:
    """Every worker process a test started (alive or not), so that all of them are stopped at the end and
    their logs can be shown when something fails."""

    def __init__(self, env: dict, log_dir):
        self.env = env
        self.log_dir = log_dir
        self.all: list[SystemWorker] = []
        self._lock = threading.Lock()

    def start(self, **env) -> SystemWorker:
        with self._lock:
            number = len(self.all)
            worker = SystemWorker(
                {**self.env, **{k: str(v) for k, v in env.items()}}, self.log_dir / f"worker{number}.log", number
            )
            self.all.append(worker)
            return worker

    @property
    def alive(self) -> list[SystemWorker]:
        return [worker for worker in self.all if worker.alive]

    def stop_all(self) -> None:
        for worker in self.all:
            worker.stop()

    def logs(self, workers: Iterable[SystemWorker] | None = None, tail: int = 4000) -> str:
        chosen = list(self.all if workers is None else workers)
        return "\n".join(
            f"--- worker {w.number} (pid {w.pid}, exit {w.proc.poll()}) ---\n{w.log()[-tail:]}" for w in chosen
        )

    def grep(self, *needles: str, exclude: str | None = None, limit: int = 30) -> str:
        """Log lines of every worker that contain one of `needles` (the lines that explain a failure)."""
        lines = []
        for worker in self.all:
            for line in worker.log().splitlines():
                if any(needle in line for needle in needles) and not (exclude and exclude in line):
                    lines.append(f"[worker {worker.number}] {line[:600]}")
        return "\n".join(lines[-limit:])


class WebServer(ConsoleServer):
    """The production web server (tests.conftest.ConsoleServer), its log kept in a file: a 500 in a system
    test is explained by the server's traceback."""

    def __init__(self, env: dict, log_path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "console.webserver", "--port", str(self.port)],
            cwd=settings.BASE_DIR,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_until_up(timeout=30)
        except BaseException:
            self.stop()
            raise

    def _wait_until_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1):
                    return
            except OSError:
                assert self.proc.poll() is None, f"the web server exited at start-up:\n{self.log()[-3000:]}"
                assert time.monotonic() < deadline, f"the web server did not answer within {timeout} s"
                time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def errors(self, limit: int = 5) -> str:
        """The last tracebacks the server logged."""
        lines = [line for line in self.log().splitlines() if '"level": "error"' in line or "Traceback" in line]
        return "\n".join(line[-3000:] for line in lines[-limit:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            super().stop()
        self._log.close()


# The system


@dataclass
class System:
    url: str
    agent: Api
    reviewer: Api
    second_reviewer: Api
    ops: Api
    workers: Workers
    server: WebServer
    submitted: list[str] = field(default_factory=list)

    def submit(self, run_input: dict, **fields) -> str:
        """POST /api/runs as the agent; returns the run's id."""
        response = self.agent.post("/api/runs", {"workflow": "refund", "input": run_input, **fields})
        assert response.status == 202, f"{response}\n{self.server.errors()}"
        self.submitted.append(response.body["id"])
        return response.body["id"]

    def wait_for_runs(self, run_ids: list[str], timeout: float, until=Run.FINISHED) -> Counter:
        """Poll until every run's status is in `until` or `timeout` passes; returns the statuses then."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = Counter(Run.objects.filter(pk__in=run_ids).values_list("status", flat=True))
            if sum(n for status, n in statuses.items() if status in until) == len(run_ids):
                return statuses
            if time.monotonic() > deadline:
                return statuses
            time.sleep(0.25)


def sandbox_stats() -> dict:
    """`manage.py sandbox_stats`: what the fake external systems received."""
    out = io.StringIO()
    call_command("sandbox_stats", stdout=out)
    return json.loads(out.getvalue())


def effects_per_run(run_ids: list[str], system: str) -> Counter:
    """How many applied calls each run made to `system` (a run that made none counts 0)."""
    made = Counter(
        str(run_id)
        for run_id in SandboxCall.objects.filter(system=system, applied=True, run_id__in=run_ids).values_list(
            "run_id", flat=True
        )
    )
    return Counter({run_id: made.get(run_id, 0) for run_id in run_ids})


def jobs_doing(settle: float = STALLED_AFTER + 8) -> list[tuple]:
    """Jobs left `doing`: any run's job, and any job whose worker is gone or silent (a periodic sweep that
    a live worker is running right now is not left behind). A worker killed in the middle of a sweep leaves that
    sweep's job `doing` until the stalled-job sweep sees the worker silent (STALLED_AFTER) and requeues it: wait
    up to `settle` seconds for that, so only what the sweeps do not repair counts."""
    deadline = time.monotonic() + settle
    while True:
        silent = timezone.now() - timedelta(seconds=STALLED_AFTER)
        left = list(
            ProcrastinateJob.objects.filter(status="doing")
            .filter(Q(task_name="advance_run") | Q(worker__isnull=True) | Q(worker__last_heartbeat__lt=silent))
            .values_list("id", "task_name", "lock", "worker_id", "attempts")
        )
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def failed_maintenance_jobs() -> list[tuple]:
    """Sweeps (stalled jobs, ownerless runs, SLA) that ended in an error: a sweep that crashes half-way leaves
    the rest of what it found for the next one, or for nobody."""
    return list(
        ProcrastinateJob.objects.filter(queue_name="maintenance", status="failed").values_list("id", "task_name")
    )


def describe_runs(run_ids: Iterable[str], limit: int = 10) -> str:
    """What a person needs to see of runs that did not end as expected: status, cursor, error, steps, jobs."""
    lines = []
    for run in Run.objects.filter(pk__in=list(run_ids)).order_by("created_at")[:limit]:
        steps = ", ".join(
            f"{name}:{status}x{attempt}"
            for name, status, attempt in Step.objects.filter(run=run)
            .order_by("seq")
            .values_list("name", "status", "attempt")
        )
        jobs = list(
            ProcrastinateJob.objects.filter(lock=f"run:{run.id}")
            .order_by("id")
            .values_list("id", "status", "attempts", "worker_id", "scheduled_at")
        )
        calls = Counter(
            f"{system}.{operation}{'' if applied else '(refused)'}"
            for system, operation, applied in SandboxCall.objects.filter(run_id=run.id).values_list(
                "system", "operation", "applied"
            )
        )
        lines.append(
            f"run {run.id} status={run.status} cursor={run.cursor} attempt={run.attempt} "
            f"faults={run.input.get('faults')} amount={run.input.get('amount_cents')} error={run.error!r} "
            f"pause={run.pause_reason!r}\n    steps: {steps}\n    jobs (id, status, attempts, worker, scheduled):"
            f" {jobs}\n    sandbox: {dict(calls)}"
        )
    return "\n".join(lines)


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(p) - 1))]


def report(title: str, **figures) -> None:
    """The figures a system test prints (run pytest with -s to see them)."""
    width = max(len(name) for name in figures)
    print(f"\n== {title} ==")
    for name, value in figures.items():
        if isinstance(value, float):
            value = f"{value:.2f}"
        print(f"  {name.replace('_', ' '):<{width}}  {value}")


class Approver(threading.Thread):
    """A reviewer who decides every pending card through the API as cards appear: approves refunds; for a
    reconcile card (did an ambiguous write happen?) looks in the external system first, as a person would,
    and answers truthfully."""

    def __init__(self, api: Api, poll: float = 0.1):
        super().__init__(daemon=True, name=f"approver-{api.who}")
        self.api = api
        self.poll = poll
        self.stopping = threading.Event()
        self.decided: Counter = Counter()  # (kind, decision) -> n
        self.refused: Counter = Counter()  # status -> n
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                response = self.api.get("/api/approvals?status=pending")
                if response.status != 200:
                    self.errors.append(f"GET /api/approvals: {response}")
                    time.sleep(self.poll)
                    continue
                for card in response.body:
                    self._decide(card)
                if not response.body:
                    time.sleep(self.poll)
        except Exception as exc:  # noqa: BLE001 - reported by the test, not lost in a thread
            self.errors.append(f"{exc.__class__.__name__}: {exc}")
        finally:
            connections.close_all()  # this thread's own database connection (reconcile lookups)

    def _decide(self, card: dict) -> None:
        body = {"decision": "approve", "comment": "checked", "version": card["version"]}
        if card["kind"] == "reconcile":
            happened = SandboxCall.objects.filter(
                system=card["channel"], idempotency_key=card["proposed"]["receipt"], applied=True
            ).exists()
            if not happened:
                body = {**body, "decision": "reject", "comment": "not in the external system"}
        response = self.api.post(f"/api/approvals/{card['id']}/decision", body)
        if response.status == 200:
            self.decided[(card["kind"], body["decision"])] += 1
        else:
            self.refused[response.status] += 1
            if response.status != 409:  # 409: decided meanwhile (another poll, or the SLA): not an error
                self.errors.append(f"decision on card {card['id']}: {response}")

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)


def _token(username: str) -> str:
    out = io.StringIO()
    call_command("create_api_token", username, "--tenant", "*", stdout=out)  # the chaos test uses several tenants
    return out.getvalue().strip()


@pytest.fixture
def system_env() -> dict:
    """Environment variables for the system's web server and workers on top of SYSTEM_ENV: a test module
    overrides this fixture to deploy its own workflows (WORKFLOW_MODULES) or model (AGENT_MODEL), or to reach the
    test database through PgBouncer (DATABASE_URL, WORKER_DATABASE_URL)."""
    return {}


@pytest.fixture
def system(_console_env, system_env, transactional_db, tmp_path):
    """A fresh database seeded like `make run` seeds it (demo_setup), API tokens for the agent, the demo
    reviewer, a second reviewer (`rita`: approve_channel on payments) and ops, the production web server and
    SYSTEM_WORKERS (2) standalone workers (with `system_env`). Everything is stopped at the end."""
    # The roles' groups come from a migration, which the flush after an earlier transactional test undid
    # (demo_setup only adds users to existing groups).
    for role in Role:
        Group.objects.get_or_create(name=role)
    call_command("demo_setup", verbosity=0)
    rita = User.objects.create_user("rita")
    rita.groups.add(Group.objects.get(name=Role.REVIEWER))
    assign_perm("core.approve_channel", rita, Channel.objects.get(name="payments"))

    env = {
        **{k: v for k, v in _console_env.items() if not k.startswith("STALLED_SWEEP_")},
        **SYSTEM_ENV,
        "DATABASE_URL": database_url(connection.settings_dict),
        **system_env,  # may route the web tier (DATABASE_URL) or the workers (WORKER_DATABASE_URL) through a pooler
    }
    server = WebServer(env, tmp_path / "web.log")
    workers = Workers(env, tmp_path)
    try:
        for _ in range(env_int("SYSTEM_WORKERS", 2)):
            workers.start()
        yield System(
            url=server.url,
            agent=Api(server.url, _token("agent"), "agent"),
            reviewer=Api(server.url, _token("reviewer"), "reviewer"),
            second_reviewer=Api(server.url, _token("rita"), "rita"),
            ops=Api(server.url, _token("ops"), "ops"),
            workers=workers,
            server=server,
        )
    finally:
        workers.stop_all()
        server.stop()
