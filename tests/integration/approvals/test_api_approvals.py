"""The approvals API: GET /api/approvals and POST /api/approvals/{id}/decision. On the production server:
tests/system/test_api_approvals_server.py."""

from __future__ import annotations

import copy
import json
import threading

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client

from approvals.models import Approval, Decision
from core.models import ApiToken, PiiValue
from demo import sandbox
from demo.models import SandboxCall
from runs.models import Run
from tests.engine_helpers import REFUND, drive, queued_jobs


def bearer(user) -> dict:
    _, raw = ApiToken.issue(user)
    return {"Authorization": f"Bearer {raw}"}


def work_the_runs_job(run: Run) -> Run:
    """What a worker does with the run's job: take it off the queue, advance the run, mark the job done.

    Takes this run's job by its lock, as `procrastinate_fetch_job` would: procrastinate's tables are not
    flushed between transactional tests, so other tests' jobs may still wait in the queue."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT worker_id FROM procrastinate_register_worker_v1()")
        (worker_id,) = cursor.fetchone()
        cursor.execute(
            "UPDATE procrastinate_jobs SET status = 'doing', worker_id = %s WHERE id = ("
            " SELECT id FROM procrastinate_jobs WHERE lock = %s AND status = 'todo' ORDER BY id LIMIT 1"
            ") RETURNING id",
            [worker_id, f"run:{run.id}"],
        )
        taken = cursor.fetchone()
    assert taken is not None, f"no job waits for run {run.id}"
    run = drive(run)
    with connection.cursor() as cursor:
        cursor.execute("SELECT procrastinate_finish_job_v1(%s, 'succeeded', false)", [taken[0]])
        cursor.execute("SELECT procrastinate_unregister_worker_v1(%s)", [worker_id])
    return run


def start_parked_run(client, creator, input: dict = REFUND) -> tuple[Run, Approval]:
    """A refund that `creator` started through the API, worked by its job up to the approval gate."""
    response = client.post(
        "/api/runs",
        data=json.dumps({"workflow": "refund", "input": input}),
        content_type="application/json",
        headers=bearer(creator),
    )
    assert response.status_code == 202, response.content
    run = work_the_runs_job(Run.objects.get(pk=response.json()["id"]))
    assert run.status == Run.Status.WAITING_HUMAN
    assert queued_jobs(run) == 0
    return run, Approval.objects.get(run=run)


@pytest.fixture
def parked(client, demo) -> tuple[Run, Approval]:
    return start_parked_run(client, demo["agent"])


def decide(client, user_or_headers, card: Approval, **body) -> object:
    headers = user_or_headers if isinstance(user_or_headers, dict) else bearer(user_or_headers)
    body.setdefault("version", card.version)
    return client.post(
        f"/api/approvals/{card.pk}/decision", data=json.dumps(body), content_type="application/json", headers=headers
    )


def snapshot(card: Approval) -> tuple:
    """Everything a refused decision must leave as it was."""
    card = Approval.objects.get(pk=card.pk)
    run = Run.objects.get(pk=card.run_id)
    return (
        card.status,
        card.version,
        card.decided_at,
        card.proposed,
        Decision.objects.filter(approval=card).count(),
        run.status,
        run.updated_at,
        queued_jobs(run),
    )


def side_effects(run: Run) -> dict:
    calls = SandboxCall.objects.filter(run_id=run.id, applied=True)
    return {system: calls.filter(system=system).count() for system in ("payments", "email")}


# GET /api/approvals


def test_it_lists_the_pending_cards_a_reviewer_may_decide(client, demo):
    _, first = start_parked_run(client, demo["agent"])
    _, second = start_parked_run(client, demo["agent"], {**REFUND, "customer_id": "cus_2001"})

    response = client.get("/api/approvals?status=pending", headers=bearer(demo["reviewer"]))

    assert response.status_code == 200
    cards = response.json()
    assert sorted(c["id"] for c in cards) == sorted([first.pk, second.pk])
    card = next(c for c in cards if c["id"] == first.pk)
    assert card["run_id"] == str(first.run_id)
    assert card["channel"] == "payments"
    assert card["status"] == "pending"
    assert card["version"] == first.version
    assert card["proposed"]["refund"]["amount_cents"] == REFUND["amount_cents"]
    assert card["current"]["refund"]["amount_cents"] == 0
    assert {"summary", "rule_id", "confidence", "citations", "risk", "due_at", "created_at"} <= set(card)


def test_pending_is_the_default_and_decided_cards_leave_the_list(client, demo, parked):
    _, card = parked
    reviewer = bearer(demo["reviewer"])
    assert [c["id"] for c in client.get("/api/approvals", headers=reviewer).json()] == [card.pk]

    assert decide(client, reviewer, card, decision="approve").status_code == 200

    assert client.get("/api/approvals", headers=reviewer).json() == []
    assert client.get("/api/approvals?status=pending", headers=reviewer).json() == []
    decided = client.get("/api/approvals?status=approved", headers=reviewer).json()
    assert [(c["id"], c["status"]) for c in decided] == [(card.pk, "approved")]
    assert [c["id"] for c in client.get("/api/approvals?status=all", headers=reviewer).json()] == [card.pk]


def test_an_outsider_sees_no_cards(client, demo, parked):
    response = client.get("/api/approvals?status=pending", headers=bearer(demo["outsider"]))
    assert response.status_code == 200
    assert response.json() == []


def test_an_unknown_status_filter_is_refused(client, demo, parked):
    response = client.get("/api/approvals?status=maybe", headers=bearer(demo["reviewer"]))
    assert response.status_code == 422
    assert response.json()["error"] == "invalid"


def test_ops_without_approve_permission_sees_no_cards(client, demo, parked):
    assert client.get("/api/approvals", headers=bearer(demo["ops"])).json() == []


def test_a_reviewer_does_not_see_the_cards_of_runs_they_started(client, demo, rita):
    _, theirs = start_parked_run(client, demo["reviewer"])
    _, agents = start_parked_run(client, demo["agent"], {**REFUND, "customer_id": "cus_2001"})

    seen_by_reviewer = client.get("/api/approvals?status=pending", headers=bearer(demo["reviewer"])).json()
    seen_by_rita = client.get("/api/approvals?status=pending", headers=bearer(rita)).json()

    assert [c["id"] for c in seen_by_reviewer] == [agents.pk]
    assert sorted(c["id"] for c in seen_by_rita) == sorted([theirs.pk, agents.pk])


def test_listing_cards_needs_a_token(client, demo, parked):
    response = client.get("/api/approvals?status=pending")
    assert response.status_code == 401
    assert response.json()["error"] == "unauthorized"


# POST /api/approvals/{id}/decision


def test_an_approval_requeues_the_run_which_then_pays_once(client, demo, parked):
    run, card = parked

    response = decide(client, demo["reviewer"], card, decision="approve", comment="looks right")

    assert response.status_code == 200
    assert response.json()["status"] == "approved"
    assert response.json()["version"] == card.version + 1
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    assert queued_jobs(run) == 1
    decision = Decision.objects.get(approval=card)
    assert (decision.actor, decision.decision, decision.comment) == (demo["reviewer"], "approve", "looks right")
    assert sandbox.stats()["channels"]["payments"] == 0

    run = work_the_runs_job(run)

    assert run.status == Run.Status.SUCCEEDED
    stats = sandbox.stats()
    assert (stats["channels"]["payments"], stats["channels"]["email"], stats["duplicates"]) == (1, 1, 0)
    payment = SandboxCall.objects.get(system="payments")
    assert payment.payload["amount_cents"] == REFUND["amount_cents"]


def test_an_edit_pays_the_edited_amount(client, demo, parked):
    run, card = parked
    payload = copy.deepcopy(card.proposed)
    payload["refund"]["amount_cents"] = 4_321

    response = decide(client, demo["reviewer"], card, decision="edit", comment="partial refund", payload=payload)

    assert response.status_code == 200
    assert response.json()["status"] == "edited"
    assert Decision.objects.get(approval=card).payload == payload
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    payment = SandboxCall.objects.get(system="payments")
    assert payment.payload["amount_cents"] == 4_321
    assert payment.payload["customer_id"] == REFUND["customer_id"]
    assert side_effects(run) == {"payments": 1, "email": 1}


def test_an_edit_without_a_payload_is_refused(client, demo, parked):
    _, card = parked
    before = snapshot(card)

    response = decide(client, demo["reviewer"], card, decision="edit")

    assert response.status_code == 422
    assert response.json()["error"] == "invalid"
    assert snapshot(card) == before


def test_a_rejection_pays_nothing_and_records_the_comment(client, demo, parked):
    run, card = parked

    response = decide(
        client, demo["reviewer"], card, decision="reject", comment="customer already refunded", reason="duplicate"
    )

    assert response.status_code == 200
    assert response.json()["status"] == "rejected"
    decision = Decision.objects.get(approval=card)
    assert (decision.actor, decision.decision) == (demo["reviewer"], "reject")
    assert (decision.comment, decision.reason) == ("customer already refunded", "duplicate")
    run = drive(run)
    assert run.is_finished
    assert run.result["outcome"] == "rejected"
    assert run.result["comment"] == "customer already refunded"
    assert run.result["by"] == "reviewer"
    assert side_effects(run) == {"payments": 0, "email": 0}


@pytest.mark.parametrize("comment", [None, "", "   \n"], ids=["missing", "empty", "blank"])
def test_a_rejection_without_a_comment_is_refused(client, demo, parked, comment):
    run, card = parked
    before = snapshot(card)
    body = {"decision": "reject"} if comment is None else {"decision": "reject", "comment": comment}

    response = decide(client, demo["reviewer"], card, **body)

    assert response.status_code == 422
    assert response.json()["error"] == "invalid"
    assert "comment" in response.json()["detail"]
    assert snapshot(card) == before
    assert Approval.objects.get(pk=card.pk).status == Approval.Status.PENDING
    assert not Decision.objects.exists()
    assert Run.objects.get(pk=run.pk).status == Run.Status.WAITING_HUMAN


def test_a_stale_version_is_refused_with_409(client, demo, parked):
    _, card = parked
    before = snapshot(card)

    response = decide(client, demo["reviewer"], card, decision="approve", version=card.version + 5)

    assert response.status_code == 409
    assert response.json()["error"] == "conflict"
    assert "version" in response.json()["detail"]
    assert snapshot(card) == before


def test_a_second_decision_is_refused_and_names_who_decided(client, demo, rita, parked):
    run, card = parked
    assert decide(client, demo["reviewer"], card, decision="approve").status_code == 200
    card.refresh_from_db()
    before = snapshot(card)

    response = decide(client, rita, card, decision="reject", comment="too late?")

    assert response.status_code == 409
    assert response.json()["error"] == "conflict"
    assert "approved by reviewer" in response.json()["detail"]
    assert snapshot(card) == before
    assert Decision.objects.get().actor == demo["reviewer"]


def test_an_outsider_gets_404(client, demo, parked):
    _, card = parked
    before = snapshot(card)

    response = decide(client, demo["outsider"], card, decision="approve")

    assert response.status_code == 404
    assert response.json()["error"] == "not_found"
    assert snapshot(card) == before


def test_a_card_that_does_not_exist_gets_404(client, demo):
    response = client.post(
        "/api/approvals/999999/decision",
        data=json.dumps({"decision": "approve", "version": 1}),
        content_type="application/json",
        headers=bearer(demo["reviewer"]),
    )
    assert response.status_code == 404
    assert response.json()["error"] == "not_found"


def test_the_runs_creator_may_not_decide_its_card(client, demo):
    run, card = start_parked_run(client, demo["reviewer"])
    before = snapshot(card)

    response = decide(client, demo["reviewer"], card, decision="approve")

    assert response.status_code == 403
    assert response.json()["error"] == "forbidden"
    assert snapshot(card) == before
    assert side_effects(drive(run)) == {"payments": 0, "email": 0}


BAD_DECISIONS = {
    "unknown decision": {"decision": "maybe", "version": 1},
    "no decision": {"comment": "hmm", "version": 1},
    "no version": {"decision": "approve"},
    "version not a number": {"decision": "approve", "version": "latest"},
    "payload not an object": {"decision": "edit", "payload": [1, 2], "version": 1},
    "reason too long": {"decision": "reject", "comment": "no", "reason": "r" * 33, "version": 1},
}


@pytest.mark.parametrize("body", BAD_DECISIONS.values(), ids=BAD_DECISIONS.keys())
def test_a_malformed_decision_is_a_json_4xx_and_changes_nothing(client, demo, parked, body):
    _, card = parked
    before = snapshot(card)

    response = client.post(
        f"/api/approvals/{card.pk}/decision",
        data=json.dumps(body),
        content_type="application/json",
        headers=bearer(demo["reviewer"]),
    )

    assert 400 <= response.status_code < 500
    assert set(response.json()) == {"error", "detail"}
    assert snapshot(card) == before


def test_a_malformed_json_decision_is_a_json_4xx(client, demo, parked):
    _, card = parked
    before = snapshot(card)

    response = client.post(
        f"/api/approvals/{card.pk}/decision",
        data='{"decision": "approve", ',
        content_type="application/json",
        headers=bearer(demo["reviewer"]),
    )

    assert 400 <= response.status_code < 500
    assert set(response.json()) == {"error", "detail"}
    assert snapshot(card) == before


def test_a_decision_on_a_cancelled_runs_card_is_refused(client, demo, parked):
    run, card = parked
    assert client.post(f"/api/runs/{run.id}/cancel", headers=bearer(demo["ops"])).status_code == 200

    response = decide(client, demo["reviewer"], card, decision="approve")

    assert response.status_code == 409
    assert "cancelled" in response.json()["detail"]
    assert Run.objects.get(pk=run.pk).status == Run.Status.CANCELLED
    assert not Decision.objects.exists()


# Two decisions on one card at once


def race(n: int, work) -> list:
    """Run `work(i)` in n threads released together; each thread has its own database connection."""
    start = threading.Barrier(n)
    results: list = [None] * n

    def target(i: int) -> None:
        try:
            start.wait()
            results[i] = work(i)
        except Exception as exc:  # noqa: BLE001 - reported in the results, asserted by the test
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_two_reviewers_deciding_at_once_make_one_decision(transactional_db, rita):
    client = Client()
    run, card = start_parked_run(client, User.objects.get(username="agent"))
    reviewers = [bearer(User.objects.get(username="reviewer")), bearer(rita)]
    decisions = [{"decision": "approve"}, {"decision": "reject", "comment": "no"}]

    answers = race(2, lambda i: decide(Client(), reviewers[i], card, **decisions[i]))

    assert sorted(a.status_code for a in answers) == [200, 409]
    assert Decision.objects.filter(approval=card).count() == 1
    winner = next(i for i, a in enumerate(answers) if a.status_code == 200)
    card.refresh_from_db()
    assert card.status == ("approved", "rejected")[winner]
    assert card.version == 2
    assert queued_jobs(run) == 1


def test_an_edit_that_fits_nothing_is_refused_for_what_the_card_says_before_its_personal_data(client, demo, parked):
    """The API fuzzer's finding (CI, 2026-12-06): an edit whose payload lacks the field that names the person
    (`refund.customer_id`, the gate's x-pii-subject) was refused for that alone, before the card's own rules: a
    shadow agreement on a card that is not shadow, or a payload the gate refuses, said nothing of either."""
    _, card = parked
    before, reviewer = snapshot(card), bearer(demo["reviewer"])
    response = decide(client, reviewer, card, decision="edit", payload={"x": 1}, agreement="agree")
    assert response.status_code == 422 and "shadow" in str(response.json()["detail"]), response.content
    response = decide(client, reviewer, card, decision="edit", payload={"x": 1})
    assert response.status_code == 422, response.content
    locations = {error["loc"] for error in response.json()["detail"]}
    assert locations and "payload" not in locations, response.json()  # the gate's own field errors
    # A new address where none may be changed: refused, and the value it would have sealed is not kept either.
    sealed = PiiValue.objects.count()
    edited = {**card.proposed, "email": {**card.proposed["email"], "to": "someone.else@example.org"}}
    response = decide(client, reviewer, card, decision="edit", payload=edited)
    assert response.status_code == 422 and "email.to" in str(response.json()["detail"]), response.content
    assert snapshot(card) == before and PiiValue.objects.count() == sealed
