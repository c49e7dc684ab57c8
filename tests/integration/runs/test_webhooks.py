"""Signed webhooks: POST /api/webhooks/{source} (runs.webhooks). On the production server:
tests/system/test_webhooks_server.py. The signatures themselves (core.webhook_signing):
tests/unit/test_webhook_signing.py."""

from __future__ import annotations

import base64
import json
import threading
import time

import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.test import Client
from procrastinate.contrib.django.models import ProcrastinateJob

from demo import sandbox
from demo.models import SandboxCall
from runs import submission
from runs.models import Run, WebhookDelivery
from tests.engine_helpers import SMALL_REFUND, drive, queued_jobs
from tests.unit.test_webhook_signing import SECRET, signed  # what a provider sends, worked out apart from our code

WHSEC = "whsec_" + base64.b64encode(b"the 32-byte key of a whsec secret").decode()


@pytest.fixture(autouse=True)
def _demo_secret(settings):
    settings.WEBHOOK_SECRETS = {"demo": [SECRET]}


def deliver(client, body, headers: dict | None = None, source: str = "demo", **sign):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = signed(data, **sign) if headers is None else headers
    return client.post(f"/api/webhooks/{source}", data=data, content_type="application/json", headers=headers)


def assert_nothing_created() -> None:
    assert not Run.objects.exists()
    assert not WebhookDelivery.objects.exists()
    assert not ProcrastinateJob.objects.filter(task_name="runs.tasks.advance_run").exists()


def test_it_accepts_a_signed_delivery_with_202_and_does_no_agent_work(client, demo):
    response = deliver(client, SMALL_REFUND)

    assert response.status_code == 202, response.content
    run = Run.objects.get()
    assert response.json() == {
        "id": str(run.id),
        "status": "queued",
        "url": f"/api/runs/{run.id}",
        "delivery": "new",
    }
    assert (run.workflow, run.input, run.created_by.username) == ("refund", SMALL_REFUND, "agent")
    assert queued_jobs(run) == 1
    assert not SandboxCall.objects.exists()  # no model call, no side effect
    delivery = WebhookDelivery.objects.get()
    assert (delivery.source, delivery.delivery_id, delivery.status, delivery.run) == ("demo", "dlv-1", "accepted", run)


def test_it_needs_no_bearer_token_and_runs_without_a_creator_when_there_is_no_agent(client, db):
    response = deliver(client, SMALL_REFUND)

    assert response.status_code == 202, response.content
    assert Run.objects.get().created_by is None


def test_the_same_delivery_three_times_in_a_row_makes_one_run_and_one_payment(client, demo):
    answers = [deliver(client, SMALL_REFUND, delivery_id="dlv-3") for _ in range(3)]

    assert [a.status_code for a in answers] == [202, 200, 200]
    assert [a.json()["delivery"] for a in answers] == ["new", "duplicate", "duplicate"]
    run = Run.objects.get()
    assert {a.json()["id"] for a in answers} == {str(run.id)}
    assert WebhookDelivery.objects.get().run == run
    assert queued_jobs(run) == 1

    assert drive(run).status == Run.Status.SUCCEEDED
    stats = sandbox.stats()
    assert stats["channels"]["payments"] == 1
    assert stats["duplicates"] == 0
    # Sent again after the run finished: still that run, nothing new.
    again = deliver(client, SMALL_REFUND, delivery_id="dlv-3")
    assert (again.status_code, again.json()["id"], again.json()["status"]) == (200, str(run.id), "succeeded")
    assert sandbox.stats()["channels"]["payments"] == 1


def test_a_duplicate_is_known_by_its_delivery_id_whatever_its_body(client, demo):
    first = deliver(client, SMALL_REFUND, delivery_id="dlv-x")
    second = deliver(client, {**SMALL_REFUND, "amount_cents": 1}, delivery_id="dlv-x")

    assert (first.status_code, second.status_code) == (202, 200)
    assert second.json()["id"] == first.json()["id"]
    assert Run.objects.get().input == SMALL_REFUND


def test_different_delivery_ids_make_different_runs(client, demo):
    ids = {deliver(client, SMALL_REFUND, delivery_id=f"dlv-{n}").json()["id"] for n in range(3)}

    assert len(ids) == 3
    assert Run.objects.count() == WebhookDelivery.objects.count() == 3


def test_the_same_delivery_three_times_at_once_in_separate_transactions_makes_one_run(transactional_db):
    """Each copy in its own thread, on its own database connection: the unique index decides."""
    call_command("demo_setup", verbosity=0)
    data = json.dumps(SMALL_REFUND).encode()
    headers = signed(data, delivery_id="dlv-race")
    start = threading.Barrier(3)
    answers: list[tuple[int, dict]] = []

    def post() -> None:
        try:
            start.wait()
            response = deliver(Client(), data, headers)
            answers.append((response.status_code, response.json()))
        finally:
            connection.close()

    threads = [threading.Thread(target=post) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert sorted(status for status, _ in answers) == [200, 200, 202]
    run = Run.objects.get()
    assert {answer["id"] for _, answer in answers} == {str(run.id)}
    assert WebhookDelivery.objects.get().run == run
    assert queued_jobs(run) == 1
    assert drive(run).status == Run.Status.SUCCEEDED
    assert sandbox.stats()["channels"]["payments"] == 1


def test_a_copy_sent_while_the_first_is_uncommitted_waits_for_it_and_answers_with_its_run(
    transactional_db, monkeypatch, settings
):
    """The race the unique index settles, made deterministic: the first delivery's transaction is held open
    after its INSERT; the copy's INSERT waits for it on the index, fails once it commits, and the copy reads
    the committed row (READ COMMITTED: a new snapshot per statement). As between two web processes: in one
    process, the copy would queue behind the first for the same group commit (runs.group_commit; a copy in the
    same batch: tests/integration/runs/test_group_commit.py)."""
    settings.GROUP_COMMIT = False
    call_command("demo_setup", verbosity=0)
    data = json.dumps(SMALL_REFUND).encode()
    headers = signed(data, delivery_id="dlv-held")
    inserted, release = threading.Event(), threading.Event()
    submit = submission.submit

    def held_submit(**kwargs):
        result = submit(**kwargs)
        if threading.current_thread().name == "first":
            inserted.set()
            assert release.wait(30)
        return result

    monkeypatch.setattr(submission, "submit", held_submit)
    answers: dict[str, tuple[int, dict]] = {}

    def post() -> None:
        try:
            response = deliver(Client(), data, headers)
            answers[threading.current_thread().name] = (response.status_code, response.json())
        finally:
            connection.close()

    first = threading.Thread(target=post, name="first")
    first.start()
    assert inserted.wait(30)
    copy = threading.Thread(target=post, name="copy")
    copy.start()
    deadline = time.monotonic() + 30
    with connection.cursor() as cursor:
        while True:  # until the copy's INSERT waits on the first one's lock
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
                " AND query LIKE 'INSERT INTO \"runs_webhookdelivery\"%%'"
            )
            if cursor.fetchone()[0] == 1:
                break
            assert time.monotonic() < deadline, "the copy never waited on the first delivery"
            time.sleep(0.02)
    assert "copy" not in answers
    release.set()
    first.join(30)
    copy.join(30)

    run = Run.objects.get()
    assert answers["first"] == (
        202,
        {"id": str(run.id), "status": "queued", "url": f"/api/runs/{run.id}", "delivery": "new"},
    )
    assert answers["copy"][0] == 200
    assert answers["copy"][1]["id"] == str(run.id)
    assert answers["copy"][1]["delivery"] == "duplicate"
    assert queued_jobs(run) == 1


def test_a_rotated_secret_accepts_the_old_and_the_new_one(client, demo, settings):
    settings.WEBHOOK_SECRETS = {"demo": [WHSEC, "old-secret"]}

    assert deliver(client, SMALL_REFUND, delivery_id="a", secret="old-secret").status_code == 202
    assert deliver(client, SMALL_REFUND, delivery_id="b", secret=WHSEC).status_code == 202
    refused = deliver(client, SMALL_REFUND, delivery_id="c", secret=SECRET)
    assert refused.status_code == 401
    assert Run.objects.count() == 2


def test_the_tolerance_is_ours_not_the_librarys_five_minutes(client, demo, settings):
    now = int(time.time())
    settings.WEBHOOK_TOLERANCE_SECONDS = 600
    assert deliver(client, SMALL_REFUND, delivery_id="late", timestamp=now - 500).status_code == 202
    assert deliver(client, SMALL_REFUND, delivery_id="early", timestamp=now + 500).status_code == 202

    settings.WEBHOOK_TOLERANCE_SECONDS = 60
    response = deliver(client, SMALL_REFUND, delivery_id="stale", timestamp=now - 90)
    assert response.status_code == 401
    assert response.json()["detail"] == "The webhook-timestamp is more than 60 s away from the server's clock."
    assert deliver(client, SMALL_REFUND, delivery_id="ahead", timestamp=now + 90).status_code == 401
    assert Run.objects.count() == WebhookDelivery.objects.count() == 2


def _tampered(headers: dict) -> dict:
    digest = headers["webhook-signature"].removeprefix("v1,")
    return {**headers, "webhook-signature": "v1," + ("A" if digest[0] != "A" else "B") + digest[1:]}


def _without(headers: dict, name: str) -> dict:
    return {key: value for key, value in headers.items() if key != name}


_BODY = json.dumps(SMALL_REFUND).encode()


def _NOW() -> int:
    return int(time.time())


def _DIGEST() -> str:
    """The base64 part of a valid signature of _BODY."""
    return signed(_BODY)["webhook-signature"].removeprefix("v1,")


_MALFORMED = "The webhook-signature header must be 'v1,<base64 HMAC-SHA256>' signatures, separated by spaces."
_MISMATCH = "The signature does not match."
# One refusal of each kind (each message of verify()), and a signature of an id sent without it (401, not the
# 400 of a delivery without an id). Every way a signature is refused: tests/unit/test_webhook_signing.py.
UNAUTHORIZED = {
    "a tampered signature": (lambda: _tampered(signed(_BODY)), _MISMATCH),
    "a signature of an id, sent without it": (
        lambda: _without(signed(_BODY, delivery_id="dlv-1"), "webhook-id"),
        _MISMATCH,
    ),
    "no signature": (lambda: _without(signed(_BODY), "webhook-signature"), "The webhook-signature header is missing."),
    "a signature without its version": (lambda: {**signed(_BODY), "webhook-signature": _DIGEST()}, _MALFORMED),
    "only a signature of another version": (
        lambda: {**signed(_BODY), "webhook-signature": "v2," + _DIGEST()},
        "The webhook-signature header holds no v1 signature.",
    ),
    "no timestamp": (
        lambda: _without(signed(_BODY), "webhook-timestamp"),
        "The webhook-timestamp header (unix seconds) is missing.",
    ),
    "a timestamp 6 minutes old": (
        lambda: signed(_BODY, timestamp=_NOW() - 360),
        "The webhook-timestamp is more than 300 s away from the server's clock.",
    ),
    "a timestamp that is not unix seconds": (
        lambda: signed(_BODY, timestamp="2026-12-01T10:00:00Z"),
        "The webhook-timestamp header must be unix seconds.",
    ),
}


@pytest.mark.parametrize(("make_headers", "detail"), UNAUTHORIZED.values(), ids=UNAUTHORIZED.keys())
def test_it_answers_401_to_an_unsigned_or_stale_delivery_and_records_nothing(client, demo, make_headers, detail):
    response = deliver(client, _BODY, make_headers())

    assert response.status_code == 401, response.content
    assert response.json() == {"error": "unauthorized", "detail": detail}
    assert_nothing_created()


def test_it_answers_404_for_an_unknown_source(client, demo):
    response = deliver(client, _BODY, source="stripe")

    assert response.status_code == 404
    assert response.json() == {"error": "not_found", "detail": "No webhook source 'stripe'."}
    assert_nothing_created()


def test_a_source_without_a_secret_is_not_served(client, demo, settings):
    settings.WEBHOOK_SECRETS = {}

    assert deliver(client, _BODY).status_code == 404
    assert_nothing_created()


def test_it_answers_400_without_a_delivery_id(client, demo):
    response = deliver(client, _BODY, delivery_id=None)

    assert response.status_code == 400
    assert response.json() == {"error": "bad_request", "detail": "The webhook-id header is missing."}
    assert_nothing_created()


def test_it_answers_400_for_a_delivery_id_too_long_to_keep(client, demo):
    response = deliver(client, _BODY, delivery_id="d" * 201)

    assert response.status_code == 400
    assert response.json() == {"error": "bad_request", "detail": "The webhook-id header is longer than 200 characters."}
    assert_nothing_created()


MALFORMED = {
    "not JSON": b"customer_id=cus_1",
    "an empty body": b"",
    "not UTF-8": b'{"reason": "\xff"}',
    "a JSON array": b"[1, 2]",
    "a JSON string": b'"refund"',
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_it_answers_400_for_a_malformed_body_and_records_it_refused_without_a_run(client, demo, body):
    response = deliver(client, body)

    assert response.status_code == 400, response.content
    assert response.json()["error"] == "bad_request"
    assert not Run.objects.exists()
    delivery = WebhookDelivery.objects.get()
    assert (delivery.status, delivery.run, bool(delivery.error)) == ("refused", None, True)


INVALID = {
    "a negative amount": ({**SMALL_REFUND, "amount_cents": -5}, "amount_cents"),
    "a missing field": ({k: v for k, v in SMALL_REFUND.items() if k != "currency"}, "currency"),
    "an unknown field": ({**SMALL_REFUND, "note": "hi"}, "note"),
    "an amount as a string": ({**SMALL_REFUND, "amount_cents": "900"}, "amount_cents"),
}


@pytest.mark.parametrize(("body", "field"), INVALID.values(), ids=INVALID.keys())
def test_it_answers_422_with_the_field_errors_and_records_it_refused_without_a_run(client, demo, body, field):
    response = deliver(client, body)

    assert response.status_code == 422, response.content
    answer = response.json()
    assert answer["error"] == "invalid"
    assert f"input.{field}" in {error["loc"] for error in answer["detail"]}  # the run input's fields
    assert not Run.objects.exists()
    assert not ProcrastinateJob.objects.filter(task_name="runs.tasks.advance_run").exists()
    delivery = WebhookDelivery.objects.get()
    assert (delivery.status, delivery.run) == ("refused", None)
    assert field in delivery.error


def test_it_answers_422_for_a_value_the_database_cannot_keep(client, demo):
    response = deliver(client, b'{"customer_id": "cus_1", "amount_cents": NaN, "currency": "EUR", "reason": "x"}')

    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == "amount_cents"
    assert not Run.objects.exists()


def test_a_refused_delivery_sent_again_valid_makes_its_run(client, demo):
    assert deliver(client, {**SMALL_REFUND, "amount_cents": -5}, delivery_id="dlv-fix").status_code == 422
    assert deliver(client, {**SMALL_REFUND, "amount_cents": -5}, delivery_id="dlv-fix").status_code == 422
    assert WebhookDelivery.objects.get().status == "refused"

    response = deliver(client, SMALL_REFUND, delivery_id="dlv-fix")

    assert response.status_code == 202
    delivery = WebhookDelivery.objects.get()
    assert (delivery.status, str(delivery.run_id), delivery.error) == ("accepted", response.json()["id"], "")
    assert deliver(client, SMALL_REFUND, delivery_id="dlv-fix").status_code == 200


def test_it_answers_413_for_a_body_over_the_limit(client, demo, settings):
    settings.API_MAX_BODY_BYTES = 1024
    body = json.dumps({**SMALL_REFUND, "reason": "x" * 2000}).encode()

    response = deliver(client, body)

    assert response.status_code == 413
    assert response.json()["error"] == "too_large"
    assert_nothing_created()


def test_deliveries_are_listed_read_only_in_django_admin(client, demo, alice):
    deliver(client, SMALL_REFUND, delivery_id="dlv-admin")
    deliver(client, b"nope", delivery_id="dlv-refused")
    run = Run.objects.get()
    client.force_login(alice)

    response = client.get("/admin/runs/webhookdelivery/")

    assert response.status_code == 200
    html = response.content.decode()
    assert "dlv-admin" in html and "dlv-refused" in html
    assert f"/admin/runs/run/{run.pk}/change/" in html
    delivery = WebhookDelivery.objects.get(delivery_id="dlv-admin")
    page = client.get(f"/admin/runs/webhookdelivery/{delivery.pk}/change/")
    assert page.status_code == 200
    assert client.get("/admin/runs/webhookdelivery/add/").status_code == 403
    assert client.post(f"/admin/runs/webhookdelivery/{delivery.pk}/delete/", {"post": "yes"}).status_code == 403


def test_an_outsider_does_not_see_deliveries_in_admin(client, demo, dave):
    dave.is_staff = True
    dave.save()
    client.force_login(dave)

    assert client.get("/admin/runs/webhookdelivery/").status_code == 403


def test_the_route_is_in_the_openapi_schema_without_a_bearer_token(client, demo):
    schema = client.get("/api/openapi.json").json()

    operation = schema["paths"]["/api/webhooks/{source}"]["post"]
    assert "security" not in operation or operation["security"] in ([], [{}])


def test_a_delivery_id_is_unique_per_source(demo):
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    WebhookDelivery.objects.create(source="demo", delivery_id="x", status="accepted", run=run)
    WebhookDelivery.objects.create(source="other", delivery_id="x", status="refused")

    with pytest.raises(IntegrityError), transaction.atomic():
        WebhookDelivery.objects.create(source="demo", delivery_id="x", status="refused")
    with pytest.raises(IntegrityError), transaction.atomic():
        WebhookDelivery.objects.create(source="other", delivery_id="y", status="refused", run=run)


def test_a_captured_delivery_replayed_under_a_new_delivery_id_is_refused_and_makes_no_run(client, demo):
    """The signature covers the delivery id: the same signed request resent within the window under another id
    (so that the dedup does not know it) is not signed, and starts no second run or payment."""
    captured = signed(_BODY, delivery_id="dlv-original")
    first = deliver(client, _BODY, captured)
    assert first.status_code == 202
    drive(Run.objects.get())
    assert sandbox.stats()["channels"]["payments"] == 1

    replay = deliver(client, _BODY, {**captured, "webhook-id": "dlv-replayed"})
    for run in Run.objects.exclude(status=Run.Status.SUCCEEDED):
        drive(run)

    runs, payments = Run.objects.count(), sandbox.stats()["channels"]["payments"]
    assert (replay.status_code, runs, payments) == (401, 1, 1)
    assert replay.json()["error"] == "unauthorized"
    assert not WebhookDelivery.objects.filter(delivery_id="dlv-replayed").exists()
