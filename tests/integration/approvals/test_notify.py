"""The notifier: email to the escalation group, a signed webhook, retries, and failures that stay visible."""

from __future__ import annotations

import base64
import json
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.conf import settings
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.test import Client
from procrastinate.contrib.django.models import ProcrastinateJob
from procrastinate.retry import RetryDecision
from standardwebhooks import Webhook, WebhookVerificationError

from approvals import sla
from approvals.models import Approval, Notification
from approvals.tasks import send_notification
from core.models import Channel
from jobs.retry import BackoffWithJitter
from runs import submission
from tests.engine_helpers import REFUND, drive
from tests.serving import serve_in_thread
from tests.worker import wait_until

SECRET = "notify-test-secret"
WHSEC = "whsec_" + base64.b64encode(b"the receiver's 32-byte webhook key").decode()


class Receiver:
    """A local HTTP endpoint that records each request and answers with the next status in `statuses`."""

    def __init__(self, statuses=(200,)):
        self.requests: list[dict] = []
        self.statuses = list(statuses)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append({"headers": dict(self.headers), "body": body})
                status = receiver.statuses.pop(0) if len(receiver.statuses) > 1 else receiver.statuses[0]
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/hitl"
        self.thread = serve_in_thread(self.server)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(statuses=(200,)) -> Receiver:
        made.append(Receiver(statuses))
        return made[-1]

    yield make
    for r in made:
        r.close()


def escalated_card(**settings_changes) -> Approval:
    group, _ = Group.objects.get_or_create(name="payments-leads")
    lena, _ = User.objects.get_or_create(username="lena", defaults={"email": "lena@example.com"})
    lena.groups.add(group)
    Channel.objects.filter(name="payments").update(escalation_policy="escalate", escalation_group=group)
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    card = Approval.objects.get(run=run)
    assert sla.apply_sla(card.pk, card.due_at + timedelta(seconds=1)) == "escalate"
    card.refresh_from_db()
    return card


@pytest.fixture
def webhook_settings(settings, receiver):
    def configure(statuses=(200,)) -> Receiver:
        r = receiver(statuses)
        settings.NOTIFY_BACKENDS = ["webhook"]
        settings.NOTIFY_WEBHOOK_URL = r.url
        settings.NOTIFY_WEBHOOK_SECRET = SECRET
        settings.NOTIFY_MAX_ATTEMPTS = 3
        return r

    return configure


def test_the_webhook_is_signed_and_the_signature_verifies(demo, webhook_settings):
    r = webhook_settings()
    card = escalated_card()
    notification = Notification.objects.get()
    assert send_notification(notification_id=notification.pk) == "sent"

    (request,) = r.requests
    headers = request["headers"]
    # The receiver's side, with the standardwebhooks library itself (a plain secret's key is its UTF-8 bytes).
    body = Webhook(SECRET.encode()).verify(request["body"], headers)
    assert headers["Webhook-Id"] == str(notification.pk)
    assert abs(int(headers["Webhook-Timestamp"]) - time.time()) < 60
    assert headers["Webhook-Signature"].startswith("v1,") and " " not in headers["Webhook-Signature"]
    assert not [name for name in headers if name.lower().startswith("x-")]  # the old X-* headers are gone
    assert body == json.loads(request["body"])
    assert body["event"] == "sla.escalate" and body["approval_id"] == card.pk and body["channel"] == "payments"
    assert body["group"] == "payments-leads" and body["url"] == f"/approvals/{card.pk}/"
    notification.refresh_from_db()
    assert notification.status == "sent" and notification.attempts == 1 and notification.sent_at


def test_a_whsec_secret_signs_with_the_key_it_encodes(demo, webhook_settings, settings):
    r = webhook_settings()
    settings.NOTIFY_WEBHOOK_SECRET = WHSEC
    escalated_card()
    send_notification(notification_id=Notification.objects.get().pk)

    (request,) = r.requests
    Webhook(WHSEC).verify(request["body"], request["headers"])
    with pytest.raises(WebhookVerificationError):  # not the secret's text
        Webhook(WHSEC.encode()).verify(request["body"], request["headers"])


def test_during_a_rotation_each_secret_signs_and_either_verifies(demo, webhook_settings, settings):
    r = webhook_settings()
    settings.NOTIFY_WEBHOOK_SECRET = f"{WHSEC}, {SECRET}"
    escalated_card()
    send_notification(notification_id=Notification.objects.get().pk)

    (request,) = r.requests
    assert len(request["headers"]["Webhook-Signature"].split(" ")) == 2
    Webhook(WHSEC).verify(request["body"], request["headers"])
    Webhook(SECRET.encode()).verify(request["body"], request["headers"])
    with pytest.raises(WebhookVerificationError):
        Webhook(b"some other secret").verify(request["body"], request["headers"])


TAMPERED = {
    "the body": lambda request: (request["body"].replace(b"payments", b"paymentz"), request["headers"]),
    "the id": lambda request: (request["body"], {**request["headers"], "Webhook-Id": "999999"}),
    "the timestamp": lambda request: (
        request["body"],
        {**request["headers"], "Webhook-Timestamp": str(int(request["headers"]["Webhook-Timestamp"]) - 1)},
    ),
}


@pytest.mark.parametrize("tamper", TAMPERED.values(), ids=TAMPERED.keys())
def test_a_tampered_message_does_not_verify(demo, webhook_settings, tamper):
    r = webhook_settings()
    escalated_card()
    send_notification(notification_id=Notification.objects.get().pk)
    (request,) = r.requests
    Webhook(SECRET.encode()).verify(request["body"], request["headers"])  # as sent, it does

    body, headers = tamper(request)
    with pytest.raises(WebhookVerificationError, match="No matching signature"):
        Webhook(SECRET.encode()).verify(body, headers)


def test_a_failing_webhook_is_retried_then_stays_visible_as_failed(demo, webhook_settings):
    r = webhook_settings(statuses=(503,))
    card = escalated_card()
    notification = Notification.objects.get()

    for attempt in (1, 2):
        with pytest.raises(Exception, match="503"):  # raised: procrastinate retries the job with backoff
            send_notification(notification_id=notification.pk)
        notification.refresh_from_db()
        assert (notification.status, notification.attempts) == ("pending", attempt)
    assert send_notification(notification_id=notification.pk) == "failed"  # the last attempt gives up
    notification.refresh_from_db()
    assert notification.status == "failed" and notification.attempts == 3
    assert "503" in notification.last_error
    assert len(r.requests) == 3
    # Each attempt is signed afresh under the same webhook-id, so a receiver can drop a copy it already took.
    assert {request["headers"]["Webhook-Id"] for request in r.requests} == {str(notification.pk)}
    for request in r.requests:
        Webhook(SECRET.encode()).verify(request["body"], request["headers"])

    card.refresh_from_db()  # the escalation stood, and the card is still decided normally
    assert card.status == "escalated"
    reviewer = User.objects.get(username="reviewer")
    card.decide(reviewer, "approve")
    assert Approval.objects.get(pk=card.pk).status == "approved"


def test_the_notification_job_retries_with_backoff_on_the_outbound_queue(demo, webhook_settings):
    webhook_settings()
    escalated_card()
    job = ProcrastinateJob.objects.get(task_name="approvals.tasks.send_notification")
    assert job.queue_name == "outbound" and job.status == "todo"
    assert isinstance(send_notification.retry_strategy, BackoffWithJitter)
    decision = send_notification.retry_strategy.get_retry_decision(exception=RuntimeError("503"), job=job)
    assert isinstance(decision, RetryDecision)


def test_without_a_webhook_url_only_email_is_sent(demo, settings):
    settings.NOTIFY_BACKENDS = ["email", "webhook"]
    settings.NOTIFY_WEBHOOK_URL = ""
    escalated_card()
    assert list(Notification.objects.values_list("backend", flat=True)) == ["email"]


def test_a_group_without_email_addresses_is_skipped_not_failed(demo, settings):
    settings.NOTIFY_BACKENDS = ["email"]
    escalated_card()
    User.objects.filter(username="lena").update(email="")
    notification = Notification.objects.get()
    assert send_notification(notification_id=notification.pk) == "skipped"
    notification.refresh_from_db()
    assert notification.status == "skipped" and "no members" in notification.last_error


def test_a_failed_notification_is_listed_in_admin_and_can_be_sent_again(demo, webhook_settings, alice):
    webhook_settings(statuses=(500,))
    escalated_card()
    notification = Notification.objects.get()
    Notification.objects.filter(pk=notification.pk).update(status="failed", attempts=3, last_error="HTTPError: 500")
    client = Client()
    client.force_login(alice)
    page = client.get("/admin/approvals/notification/?status__exact=failed")
    assert page.status_code == 200 and b"HTTPError: 500" in page.content
    response = client.post(
        "/admin/approvals/notification/", {"action": "send_again", "_selected_action": [notification.pk]}
    )
    assert response.status_code == 302
    notification.refresh_from_db()
    assert notification.status == "pending" and notification.attempts == 0
    assert ProcrastinateJob.objects.filter(task_name="approvals.tasks.send_notification", status="todo").count() == 2


def test_a_real_worker_retries_a_failing_webhook_until_it_gives_up(start_worker, receiver):
    """The whole path: the escalation commits, a worker sends, the endpoint keeps failing, the job is retried
    with backoff, and the row ends `failed` while the escalation stands."""
    call_command("demo_setup", verbosity=0)
    r = receiver(statuses=(500,))
    settings_backup = (settings.NOTIFY_BACKENDS, settings.NOTIFY_WEBHOOK_URL)
    settings.NOTIFY_BACKENDS, settings.NOTIFY_WEBHOOK_URL = ["webhook"], r.url
    try:
        card = escalated_card()
    finally:
        settings.NOTIFY_BACKENDS, settings.NOTIFY_WEBHOOK_URL = settings_backup
    worker = start_worker(
        NOTIFY_BACKENDS="webhook",
        NOTIFY_WEBHOOK_URL=r.url,
        NOTIFY_WEBHOOK_SECRET=SECRET,
        NOTIFY_MAX_ATTEMPTS=3,
        RETRY_BASE_SECONDS=0.05,
        RETRY_CAP_SECONDS=0.2,
    )
    notification = wait_until(
        lambda: Notification.objects.filter(status="failed").first(), timeout=30, message=worker.log()
    )
    assert notification.attempts == 3 and "500" in notification.last_error
    assert len(r.requests) == 3
    assert Approval.objects.get(pk=card.pk).status == "escalated"
