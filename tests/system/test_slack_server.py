"""Decisions from Slack with real processes: a worker posts the card to (a local fake of) Slack's Web API, a signed
click reaches the production server over HTTP and decides the card once, and the worker updates the message."""

from __future__ import annotations

import http.client

from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.core.management import call_command

from approvals.models import Approval, Decision
from core.models import AuditEntry, Channel
from runs import submission
from slackapp.models import SlackIdentity, SlackMessage, SlackRoute
from tests import slack_fake
from tests.conftest import ConsoleServer
from tests.engine_helpers import REFUND
from tests.worker import wait_until


def _post(port: int, body: bytes, headers: dict) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/api/slack/interactions", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_a_signed_click_over_http_decides_once_and_the_worker_updates_the_message(_console_env, start_worker):
    fake = slack_fake.FakeSlack()
    slack_env = {
        "SLACK_BOT_TOKEN": slack_fake.BOT_TOKEN,
        "SLACK_SIGNING_SECRET": slack_fake.SIGNING_SECRET,
        "SLACK_API_URL": fake.api_url,
        "SLACK_RESPONSE_URL_PREFIX": fake.hooks_url,
        "CONSOLE_URL": "https://console.example.com",
    }
    server = ConsoleServer({**_console_env, **slack_env})
    try:
        call_command("demo_setup", verbosity=0)
        reviewer = SlackIdentity.objects.create(
            user=User.objects.get(username="reviewer"),
            team_id=slack_fake.TEAM,
            slack_user_id="U0BOB",
        ).user
        SlackRoute.objects.create(channel=Channel.objects.get(name="payments"), slack_channel="C0PAYMENTS")
        start_worker(**slack_env)
        run = submission.submit(workflow="refund", input=REFUND, idempotency_key="slack-system")[0]

        # The worker parks the run on its card and posts it, through the outbound queue.
        card = wait_until(lambda: Approval.objects.filter(run=run).first(), message="the card")
        (post,) = wait_until(lambda: fake.calls("chat.postMessage"), message="chat.postMessage")
        assert post["channel"] == "C0PAYMENTS" and f'"card":{card.pk}' in str(post["blocks"])
        message = wait_until(lambda: SlackMessage.objects.filter(approval=card).first(), message="the message row")

        payload = slack_fake.click(card.pk, card.version, response_url=f"{fake.hooks_url}{slack_fake.TEAM}/1/abc")
        body, headers = slack_fake.signed(payload)
        unsigned = {"Content-Type": headers["Content-Type"]}
        assert _post(server.port, body, unsigned) == 401
        assert Approval.objects.get(pk=card.pk).status == "pending"

        assert _post(server.port, body, headers) == 200
        assert _post(server.port, body, headers) == 200  # replayed within the five minutes
        card.refresh_from_db()
        assert card.status == "approved"
        assert list(Decision.objects.filter(approval=card).values_list("actor", flat=True)) == [reviewer.pk]
        (entry,) = AuditEntry.objects.filter(action="approval.approve", approval_id=card.pk)
        assert (entry.actor, entry.data["via"]) == ("reviewer", "slack")
        (told,) = fake.responses()
        assert told["response_type"] == "ephemeral" and "already approved by reviewer" in told["text"]

        # The API's body limit applies here too, while the body arrives (console.body_limit): 413, nothing read.
        big = slack_fake.click(card.pk, card.version, comment="x" * django_settings.API_MAX_BODY_BYTES)
        assert _post(server.port, *slack_fake.signed(big)) == 413

        update = wait_until(lambda: fake.calls("chat.update"), message="chat.update")[-1]
        assert (update["channel"], update["ts"]) == (message.slack_channel, message.ts)
        assert "Approved by reviewer at" in str(update["blocks"])
    finally:
        server.stop()
        fake.close()
