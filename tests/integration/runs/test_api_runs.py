"""The runs API: POST /api/runs, GET /api/runs/{id}, POST /api/runs/{id}/cancel. On the production server:
tests/system/test_api_runs_server.py."""

from __future__ import annotations

import json
import threading
import uuid
from io import StringIO

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import Max
from django.test import Client
from django.test.utils import CaptureQueriesContext
from procrastinate.contrib.django.models import ProcrastinateJob

from approvals.models import Approval
from core.models import ApiToken
from demo.models import SandboxCall
from runs import submission
from runs.models import Run, Step
from tests.engine_helpers import REFUND, drive, queued_jobs

DESIGN_RUN_FIELDS = {
    "id",
    "workflow",
    "status",
    "current_step",
    "steps_done",
    "steps",
    "result",
    "error",
    "approval_id",
    "trace_id",
    "cost",
    "created_at",
    "updated_at",
}


def bearer(user) -> dict:
    _, raw = ApiToken.issue(user)
    return {"Authorization": f"Bearer {raw}"}


@pytest.fixture
def new_jobs(db):
    """The jobs deferred since the test began. (Procrastinate's tables are not Django's: they are not flushed
    after a transactional test, so an earlier test's jobs may still be in the queue.)"""
    mark = ProcrastinateJob.objects.aggregate(last=Max("id"))["last"] or 0
    return lambda: ProcrastinateJob.objects.filter(id__gt=mark)


@pytest.fixture
def agent(demo):
    return bearer(demo["agent"])


def post_run(client, headers: dict, body) -> object:
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return client.post("/api/runs", data=data, content_type="application/json", headers=headers)


def start_parked_run(client, headers: dict) -> Run:
    """A refund started through the API and advanced (as its job would) to the approval gate."""
    response = post_run(client, headers, {"workflow": "refund", "input": REFUND})
    assert response.status_code == 202, response.content
    run = drive(Run.objects.get(pk=response.json()["id"]))
    assert run.status == Run.Status.WAITING_HUMAN
    return run


def assert_nothing_created(new_jobs) -> None:
    assert not Run.objects.exists()
    assert not new_jobs().exists()
    assert not Step.objects.exists()
    assert not SandboxCall.objects.exists()


# POST /api/runs


def test_it_accepts_a_run_with_202_and_does_no_agent_work(client, demo, agent, new_jobs):
    response = post_run(client, agent, {"workflow": "refund", "input": REFUND, "idempotency_key": "order-1"})

    assert response.status_code == 202
    body = response.json()
    assert set(body) == {"id", "status", "url"}
    assert body["status"] == "queued"
    assert body["url"] == f"/api/runs/{body['id']}"

    run = Run.objects.get()
    assert str(run.id) == body["id"]
    assert run.status == Run.Status.QUEUED
    assert run.input == REFUND
    assert run.idempotency_key == "order-1"
    assert run.created_by == demo["agent"]
    # The work is a job for the worker: nothing of the agent ran in the request.
    job = new_jobs().get()
    assert job.task_name.endswith("advance_run")
    assert job.args == {"run_id": body["id"]}
    assert job.status == "todo" and job.lock == f"run:{run.id}"
    assert not Step.objects.exists()
    assert not SandboxCall.objects.exists()


def test_it_takes_tenant_and_priority(client, demo, new_jobs):
    _, raw = ApiToken.issue(demo["agent"], tenants=["acme"])
    body = {"workflow": "refund", "input": REFUND, "tenant": "acme", "priority": 7}
    response = post_run(client, {"Authorization": f"Bearer {raw}"}, body)
    assert response.status_code == 202
    run = Run.objects.get()
    assert (run.tenant, run.priority) == ("acme", 7)
    assert new_jobs().get().priority == 7


@pytest.mark.parametrize(
    ("tenants", "tenant", "status"),
    [
        (None, "default", 202),  # a new token's tenant
        (None, "acme", 403),
        (["acme", "globex"], "globex", 202),
        (["acme"], "default", 403),
        (["*"], "anyone", 202),
    ],
)
def test_a_token_starts_runs_for_its_own_tenants_only(client, demo, tenants, tenant, status):
    _, raw = ApiToken.issue(demo["agent"], tenants=tenants)
    body = {"workflow": "refund", "input": REFUND, "tenant": tenant}
    response = post_run(client, {"Authorization": f"Bearer {raw}"}, body)
    assert response.status_code == status, response.content
    assert Run.objects.count() == (1 if status == 202 else 0)
    if status == 403:
        assert response.json()["error"] == "forbidden"


def test_create_api_token_takes_tenants(demo):
    out = StringIO()
    call_command("create_api_token", "agent", "--tenant", "acme", "--tenant", "globex", stdout=out)
    assert ApiToken.objects.get(prefix=out.getvalue().strip()[5:13]).tenants == ["acme", "globex"]


def test_it_returns_the_same_run_for_the_same_idempotency_key(client, demo, agent, new_jobs):
    body = {"workflow": "refund", "input": REFUND, "idempotency_key": "order-42"}
    answers = [post_run(client, agent, body) for _ in range(3)]

    assert [a.status_code for a in answers] == [202, 200, 200]
    assert len({a.json()["id"] for a in answers}) == 1
    run = Run.objects.get()
    assert str(run.id) == answers[0].json()["id"]
    assert queued_jobs(run) == 1 and new_jobs().count() == 1


def test_it_answers_409_for_the_same_key_with_a_different_input(client, demo, agent, new_jobs):
    first = post_run(client, agent, {"workflow": "refund", "input": REFUND, "idempotency_key": "order-7"})
    assert first.status_code == 202

    other_input = {**REFUND, "amount_cents": 99_999}
    response = post_run(client, agent, {"workflow": "refund", "input": other_input, "idempotency_key": "order-7"})

    assert response.status_code == 409
    assert response.json()["error"] == "conflict"
    assert "order-7" in response.json()["detail"]
    run = Run.objects.get()
    assert run.input == REFUND
    assert new_jobs().count() == 1


def test_it_answers_422_for_an_unknown_workflow(client, demo, agent, new_jobs):
    response = post_run(client, agent, {"workflow": "launch-missiles", "input": {}})
    assert response.status_code == 422
    assert response.json()["error"] == "invalid"
    assert "launch-missiles" in str(response.json()["detail"])
    assert_nothing_created(new_jobs)


BAD_BODIES = {
    "malformed json": '{"workflow": "refund", "input": ',
    "not json at all": "workflow=refund",
    "empty body": "",
    "body is a list": [{"workflow": "refund", "input": REFUND}],
    "body is null": "null",
    "input is a list": {"workflow": "refund", "input": [1, 2]},
    "input is a string": {"workflow": "refund", "input": "refund me"},
    "input is missing": {"workflow": "refund"},
    "workflow is missing": {"input": REFUND},
    "workflow is not a string": {"workflow": {"name": "refund"}, "input": REFUND},
    "priority too high": {"workflow": "refund", "input": REFUND, "priority": 101},
    "priority too low": {"workflow": "refund", "input": REFUND, "priority": -101},
    "priority not a number": {"workflow": "refund", "input": REFUND, "priority": "urgent"},
    "idempotency key too long": {"workflow": "refund", "input": REFUND, "idempotency_key": "k" * 201},
    "idempotency key empty": {"workflow": "refund", "input": REFUND, "idempotency_key": ""},
    "tenant empty": {"workflow": "refund", "input": REFUND, "tenant": ""},
    "negative cost limit": {"workflow": "refund", "input": REFUND, "cost_limit": "-1"},
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_it_answers_a_bad_body_with_a_json_4xx_and_creates_nothing(client, demo, agent, body, new_jobs):
    response = post_run(client, agent, body)

    assert 400 <= response.status_code < 500, response.content
    assert response["Content-Type"].startswith("application/json")
    assert set(response.json()) == {"error", "detail"}
    assert_nothing_created(new_jobs)


def test_it_answers_413_for_a_body_over_the_limit(client, demo, agent, settings, new_jobs):
    settings.API_MAX_BODY_BYTES = 1_000
    body = {"workflow": "refund", "input": {**REFUND, "reason": "x" * 2_000}}

    response = post_run(client, agent, body)

    assert response.status_code == 413
    assert response.json() == {"error": "too_large", "detail": "The body is larger than 1000 bytes."}
    assert_nothing_created(new_jobs)


def test_it_accepts_a_body_just_under_the_limit(client, demo, agent, settings):
    settings.API_MAX_BODY_BYTES = 1_000
    body = json.dumps({"workflow": "refund", "input": {**REFUND, "reason": ""}})
    body = body.replace('"reason": ""', '"reason": "' + "x" * (1_000 - len(body)) + '"')
    assert len(body.encode()) == 1_000

    assert post_run(client, agent, body).status_code == 202


@pytest.mark.parametrize("header", [None, "Bearer nope"])
def test_it_answers_401_without_a_valid_token(client, demo, header, new_jobs):
    headers = {"Authorization": header} if header else {}
    response = post_run(client, headers, {"workflow": "refund", "input": REFUND})
    assert response.status_code == 401
    assert response.json()["error"] == "unauthorized"
    assert_nothing_created(new_jobs)


def test_it_creates_one_run_when_requests_race_in_separate_transactions(transactional_db):
    """The same race as above, but each request runs in its own thread with its own database connection
    (one uvicorn worker runs Django's sync views on a single thread, so the server alone may serialize them)."""
    call_command("demo_setup", verbosity=0)
    headers = bearer(User.objects.get(username="agent"))
    body = {"workflow": "refund", "input": REFUND, "idempotency_key": "burst-2"}
    start = threading.Barrier(8)
    answers: list[tuple[int, dict]] = []

    def post() -> None:
        try:
            start.wait()
            response = post_run(Client(), headers, body)
            answers.append((response.status_code, response.json()))
        finally:
            connection.close()

    threads = [threading.Thread(target=post) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert sorted(status for status, _ in answers) == [200] * 7 + [202]
    assert len({answer["id"] for _, answer in answers}) == 1
    assert queued_jobs(Run.objects.get()) == 1


def test_post_runs_costs_two_queries_in_autocommit(transactional_db):
    """The enqueue path's round trips (issue 11): the token's lookup, then the run's INSERT and its job's defer as
    one statement in autocommit (runs/submission.py; a group commit's, with whatever other requests came at the same
    time: runs/group_commit.py): no BEGIN, savepoint or COMMIT of its own. Fails if it grows."""
    call_command("demo_setup", verbosity=0)
    headers = bearer(User.objects.get(username="agent"))
    client = Client()
    post_run(client, headers, {"workflow": "refund", "input": REFUND})  # the token's last_used_at is written once
    with CaptureQueriesContext(connection) as queries:
        response = post_run(client, headers, {"workflow": "refund", "input": REFUND, "idempotency_key": "count-1"})
    assert response.status_code == 202, response.content
    statements = [q["sql"] for q in queries.captured_queries]
    assert len(statements) == 2, statements
    assert statements[0].startswith('SELECT "console_apitoken"')
    assert statements[1].startswith('/* runs.group_commit */ WITH inserted AS (INSERT INTO "runs_run"')
    assert "procrastinate_defer_jobs_v1" in statements[1]
    run = Run.objects.get(idempotency_key="count-1")
    assert queued_jobs(run) == 1


def test_submit_defers_the_job_that_enqueue_defers(db, new_jobs):
    """runs/submission.py writes the job itself: the same task, queue, locks, priority and arguments as Run.enqueue
    (procrastinate's .defer()) would."""
    run, created = submission.submit(workflow="refund", input=REFUND, priority=5)
    assert created
    ours = new_jobs().get()
    with connection.cursor() as cursor:  # out of the queue, so that its queueing lock is free again
        cursor.execute("UPDATE procrastinate_jobs SET status = 'succeeded' WHERE id = %s", [ours.id])
    with transaction.atomic():
        assert run.enqueue()
    theirs = new_jobs().exclude(id=ours.id).get()

    def fields(job):
        return [getattr(job, f) for f in ("queue_name", "task_name", "priority", "lock", "queueing_lock", "args")]

    assert fields(ours) == fields(theirs)
    assert (ours.status, ours.scheduled_at, ours.attempts) == (theirs.status, theirs.scheduled_at, theirs.attempts)
    # The one-statement INSERT sets what save() would: the timestamps and the defaults.
    stored = Run.objects.get(pk=run.pk)
    assert stored.created_at == run.created_at and stored.updated_at == run.updated_at
    assert (stored.status, stored.trace_id, stored.tenant) == (Run.Status.QUEUED, run.trace_id, "default")
    assert stored.max_attempts == settings.RUN_MAX_ATTEMPTS
    assert not run._state.adding


def test_a_repeated_key_inside_a_callers_transaction_keeps_it_usable(db, demo, new_jobs):
    """Inside a caller's transaction the statement runs under a savepoint: a duplicate idempotency key gives back
    the first run, writes no second job, and the caller's transaction goes on."""
    agent = demo["agent"]
    with transaction.atomic():
        first, created = submission.submit(workflow="refund", input=REFUND, idempotency_key="k", created_by=agent)
        again, created_again = submission.submit(workflow="refund", input=REFUND, idempotency_key="k", created_by=agent)
        assert (created, created_again, again.pk) == (True, False, first.pk)
        assert Run.objects.count() == 1  # the transaction is not aborted
    assert new_jobs().count() == 1


# GET /api/runs/{id}


def test_it_shows_a_queued_run(client, demo, agent):
    run_id = post_run(client, agent, {"workflow": "refund", "input": REFUND}).json()["id"]

    response = client.get(f"/api/runs/{run_id}", headers=agent)

    assert response.status_code == 200
    body = response.json()
    assert set(body) >= DESIGN_RUN_FIELDS
    run = Run.objects.get()
    assert body["id"] == run_id
    assert body["workflow"] == "refund"
    assert body["status"] == "queued"
    assert body["current_step"] == "classify"
    assert (body["steps_done"], body["steps"]) == (0, [])
    assert (body["result"], body["error"], body["approval_id"]) == (None, "", None)
    assert body["trace_id"] == run.trace_id and len(body["trace_id"]) == 32
    assert float(body["cost"]) == 0


def test_it_shows_a_run_waiting_for_a_person(client, demo, agent):
    run = start_parked_run(client, agent)
    card = Approval.objects.get(run=run)

    body = client.get(f"/api/runs/{run.id}", headers=agent).json()

    assert body["status"] == "waiting_human"
    assert body["approval_id"] == card.pk
    assert body["current_step"] == "approve_refund"
    assert body["steps_done"] == 3
    assert [(s["seq"], s["name"], s["status"]) for s in body["steps"][:3]] == [
        (0, "classify", "done"),
        (1, "lookup_customer", "done"),
        (2, "draft_refund", "done"),
    ]
    assert float(body["cost"]) == float(run.cost)


def test_it_shows_a_finished_run_with_its_result(client, demo, agent):
    run = start_parked_run(client, agent)
    Approval.objects.get(run=run).decide(demo["reviewer"], "approve")
    drive(run)

    body = client.get(f"/api/runs/{run.id}", headers=agent).json()

    assert body["status"] == "succeeded"
    assert body["current_step"] is None and body["approval_id"] is None
    assert body["steps_done"] == 6 == len(body["steps"])
    assert body["result"] is not None


def test_it_lets_a_reviewer_of_the_cards_channel_see_the_run(client, demo, agent):
    run = start_parked_run(client, agent)
    response = client.get(f"/api/runs/{run.id}", headers=bearer(demo["reviewer"]))
    assert response.status_code == 200


def test_it_answers_404_to_an_outsider(client, demo, agent):
    run = start_parked_run(client, agent)
    response = client.get(f"/api/runs/{run.id}", headers=bearer(demo["outsider"]))
    assert response.status_code == 404
    assert response.json()["error"] == "not_found"


def test_it_answers_404_for_a_run_that_does_not_exist(client, demo, agent):
    response = client.get(f"/api/runs/{uuid.uuid4()}", headers=agent)
    assert response.status_code == 404
    assert response.json() == {"error": "not_found", "detail": "Not found."}


@pytest.mark.parametrize("run_id", ["not-a-uuid", "123", "00000000-0000-0000-0000-00000000000z"])
def test_it_answers_a_malformed_id_with_json(client, demo, agent, run_id):
    response = client.get(f"/api/runs/{run_id}", headers=agent)
    assert response.status_code in (404, 422)
    assert response["Content-Type"].startswith("application/json")
    assert set(response.json()) == {"error", "detail"}


# POST /api/runs/{id}/cancel


def test_it_cancels_a_parked_run_and_its_card(client, demo, agent):
    run = start_parked_run(client, agent)

    response = client.post(f"/api/runs/{run.id}/cancel", headers=bearer(demo["ops"]))

    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"
    assert response.json()["approval_id"] is None
    run.refresh_from_db()
    assert run.status == Run.Status.CANCELLED and run.finished_at is not None
    assert Approval.objects.get(run=run).status == Approval.Status.CANCELLED
    assert drive(run).status == Run.Status.CANCELLED
    assert not SandboxCall.objects.filter(system__in=["payments", "email"]).exists()


def test_the_creator_may_cancel_their_own_run(client, demo, agent):
    run = start_parked_run(client, agent)
    response = client.post(f"/api/runs/{run.id}/cancel", headers=agent)
    assert response.status_code == 200
    assert Run.objects.get(pk=run.pk).status == Run.Status.CANCELLED


def test_it_cancels_a_queued_run_before_any_work(client, demo, agent):
    run_id = post_run(client, agent, {"workflow": "refund", "input": REFUND}).json()["id"]

    assert client.post(f"/api/runs/{run_id}/cancel", headers=agent).status_code == 200

    run = drive(Run.objects.get(pk=run_id))
    assert run.status == Run.Status.CANCELLED
    assert not Step.objects.exists()


def test_cancelling_a_finished_run_changes_nothing(client, demo, agent):
    run = start_parked_run(client, agent)
    Approval.objects.get(run=run).decide(demo["reviewer"], "approve")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED

    response = client.post(f"/api/runs/{run.id}/cancel", headers=agent)

    assert response.status_code == 200
    assert response.json()["status"] == "succeeded"
    assert Run.objects.get(pk=run.pk).status == Run.Status.SUCCEEDED


def test_it_answers_404_to_an_outsider_who_cancels(client, demo, agent):
    run = start_parked_run(client, agent)

    response = client.post(f"/api/runs/{run.id}/cancel", headers=bearer(demo["outsider"]))

    assert response.status_code == 404
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_HUMAN and not run.cancel_requested
    assert Approval.objects.get(run=run).status == Approval.Status.PENDING


def test_it_answers_403_to_a_reviewer_who_cancels(client, demo, agent):
    run = start_parked_run(client, agent)
    reviewer = bearer(demo["reviewer"])
    assert client.get(f"/api/runs/{run.id}", headers=reviewer).status_code == 200

    response = client.post(f"/api/runs/{run.id}/cancel", headers=reviewer)

    assert response.status_code == 403
    assert response.json()["error"] == "forbidden"
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_HUMAN and not run.cancel_requested
    assert Approval.objects.get(run=run).status == Approval.Status.PENDING


def test_cancel_answers_404_for_a_run_that_does_not_exist(client, demo):
    response = client.post(f"/api/runs/{uuid.uuid4()}/cancel", headers=bearer(demo["ops"]))
    assert response.status_code == 404
    assert response.json()["error"] == "not_found"
