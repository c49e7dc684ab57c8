"""The production web server SIGKILLed in the middle of a group commit (runs.group_commit), under load from 16
clients: every 202 has its run, no run lacks its job, and each request sent again with its idempotency key is
settled to the one run it made or makes now, never two.

The kill lands mid-batch for certain: a SHARE lock on runs_run, held from the test's own session, stops the batch
statement in flight (seen waiting in pg_stat_activity) while the other requests queue in the process; then the
process is killed, and the lock released. PostgreSQL does not notice the client is gone while the statement waits,
so that batch commits with nobody to answer: its runs exist, their requests had no answer, and sending them again
with the same key must find them (200) rather than make them twice."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import uuid
from collections import Counter

import psycopg
import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection

from runs.models import Run
from tests.engine_helpers import REFUND
from tests.integration.runs.test_api_runs import bearer
from tests.system.conftest import WebServer
from tests.worker import database_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CLIENTS = 16


def post(server: WebServer, headers: dict, key: str) -> tuple[int, dict] | None:
    """POST /api/runs with `key`; None when no answer came (the server died)."""
    body = json.dumps({"workflow": "refund", "input": REFUND, "idempotency_key": key})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    try:
        conn.request("POST", "/api/runs", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


def grouped_waiting(session) -> list[int]:
    session.execute("SELECT pg_stat_clear_snapshot()")
    rows = session.execute(
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database() "
        "AND query LIKE '/* runs.group_commit */%'"
    ).fetchall()
    return [pid for (pid,) in rows]


def jobs_per_run() -> Counter:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT r.id::text, count(j.id) FROM runs_run r "
            "LEFT JOIN procrastinate_jobs j ON j.lock = 'run:' || r.id::text GROUP BY r.id"
        )
        return Counter(dict(cursor.fetchall()))


def test_a_web_process_killed_mid_batch_answered_202_only_for_runs_that_committed_with_their_jobs(
    _console_env, tmp_path
):
    call_command("demo_setup", verbosity=0)
    headers = {**bearer(User.objects.get(username="agent")), "Content-Type": "application/json"}
    env = {**_console_env, "DATABASE_URL": database_url(connection.settings_dict)}
    server = WebServer(env, tmp_path / "web.log")
    sent: dict[str, tuple[int, dict] | None] = {}
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            key = str(uuid.uuid4())
            sent[key] = None  # sent; its answer, if one comes
            sent[key] = post(server, headers, key)

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while sum(1 for answer in list(sent.values()) if answer) < 200:
            assert time.monotonic() < deadline, f"too few answers under load\n{server.errors()}"
            time.sleep(0.05)

        with psycopg.connect(database_url(connection.settings_dict)) as session:
            session.execute("LOCK TABLE runs_run IN SHARE MODE")
            deadline = time.monotonic() + 10
            while not grouped_waiting(session):
                assert time.monotonic() < deadline, "no batch statement came to wait on the lock"
                time.sleep(0.01)
            time.sleep(0.3)  # the other requests queue behind it in the process
            stop.set()  # the clients send nothing more; the requests in flight are cut by the kill
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(10)
            session.rollback()  # the lock goes; the killed process's statement goes on
        for thread in threads:
            thread.join(30)
    finally:
        stop.set()
        server.stop()

    log = server.log()
    batches = [json.loads(line).get("batch", 0) for line in log.splitlines() if '"event": "run submitted"' in line]
    assert max(batches) > 1, "the load made no group commit"
    accepted = {key: answer[1]["id"] for key, answer in sent.items() if answer and answer[0] == 202}
    unanswered = [key for key, answer in sent.items() if answer is None]
    assert all(answer is None or answer[0] == 202 for answer in sent.values()), Counter(
        answer[0] for answer in sent.values() if answer
    )

    jobs = jobs_per_run()
    # Every 202 has its run, and every run its one job: none without (nothing lost), none with two.
    assert set(accepted.values()) <= set(jobs)
    assert set(jobs.values()) == {1}
    # The batch stopped in flight committed after the kill: runs no request was answered for (whose fate the
    # clients do not know), which sending again with the same key must find, not make twice.
    orphans = set(Run.objects.filter(idempotency_key__in=unanswered).values_list("idempotency_key", flat=True))
    assert orphans, "the batch stopped by the lock did not commit after the kill"

    again = WebServer(env, tmp_path / "web-again.log")
    try:
        answers = {key: post(again, headers, key) for key in unanswered}
    finally:
        again.stop()
    assert all(answer is not None for answer in answers.values()), again.errors()
    assert {key for key, (status, _) in answers.items() if status == 200} == orphans
    assert {status for status, _ in answers.values()} <= {200, 202}
    # One run per key sent, whatever happened: the keys answered before the kill and those sent again.
    runs = dict(Run.objects.values_list("idempotency_key", "id"))
    assert set(runs) == set(accepted) | set(unanswered)
    assert all(str(runs[key]) == run_id for key, run_id in accepted.items())
    assert all(str(runs[key]) == answer[1]["id"] for key, answer in answers.items())
    assert set(jobs_per_run().values()) == {1}
