"""Decision callbacks that cannot be aimed inward, each signed with its own agent's secret (issue 24, defect 5).

Driven through the API as an agent uses it: a callback URL that is not http(s), has a bad port, or whose host
resolves to loopback, link-local, unspecified, multicast, reserved or (unless allowed) private addresses is
refused (422) when the request is made, and nothing is written. The decision is POSTed without following a
redirect, signed with the secret of the asking agent's API token, so another agent's secret does not verify it.
"""

from __future__ import annotations

import importlib.util
import io
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.apps import apps
from django.contrib.auth.models import User
from django.core.management import call_command
from guardian.shortcuts import assign_perm
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from approvals import notify
from approvals.models import Notification
from approvals.tasks import send_notification
from core import webhook_signing
from core.models import ApiToken, AuditEntry, Channel
from external.callbacks import CallbackBackend
from external.models import ActionRequest
from tests.serving import serve_in_thread

ARGUMENTS = {"order_id": "ord_9", "amount_cents": 900}


class Agent:
    def __init__(self, client, user):
        self.token, raw = ApiToken.issue(user)
        self.client, self.headers = client, {"Authorization": f"Bearer {raw}"}

    def ask(self, key: str, callback_url: str | None):
        body = {"channel": "payments", "action": "refund", "arguments": ARGUMENTS, "idempotency_key": key}
        if callback_url is not None:
            body["callback_url"] = callback_url
        response = self.client.post(
            "/api/approval-requests", json.dumps(body), content_type="application/json", headers=self.headers
        )
        return response.status_code, response.json()


@pytest.fixture
def agent(client, demo):
    return Agent(client, demo["agent"])


@pytest.fixture
def other_agent(client, demo):
    user = User.objects.create_user("agent-b")
    assign_perm("core.request_channel", user, Channel.objects.get(name="payments"))
    return Agent(client, user)


class Receiver:
    """A local HTTP endpoint: records each POST, answers `status` (with `location` for a redirect)."""

    def __init__(self, status: int = 204, location: str = ""):
        self.received: list[tuple[dict, bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.received.append((dict(self.headers), body))
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST  # noqa: N815 - a followed 303 would arrive as a GET

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/decisions"
        serve_in_thread(self.server)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers():
    made: list[Receiver] = []

    def make(**kwargs) -> Receiver:
        made.append(Receiver(**kwargs))
        return made[-1]

    yield make
    for receiver in made:
        receiver.close()


@pytest.fixture
def local_receivers_allowed(settings):
    """The test's receivers listen on 127.0.0.1: an operator lets callbacks reach it by naming the host."""
    settings.CALLBACK_ALLOWED_HOSTS = ["127.0.0.1"]


def approve(client, demo, card_id: int) -> None:
    _, raw = ApiToken.issue(demo["reviewer"])
    headers = {"Authorization": f"Bearer {raw}"}
    (card,) = [c for c in client.get("/api/approvals", headers=headers).json() if c["id"] == card_id]
    response = client.post(
        f"/api/approvals/{card_id}/decision",
        json.dumps({"decision": "approve", "version": card["version"], "comment": "ok"}),
        content_type="application/json",
        headers=headers,
    )
    assert response.status_code == 200, response.content


INWARD = [
    "http://localhost:8000/api/runs",
    "http://127.0.0.2/hook",
    "http://[::1]/hook",
    "http://2130706433/hook",
    "http://localhost./hook",
    "http://169.254.169.254/latest/meta-data/",
    "http://0.0.0.0:8000/hook",
    "http://[::ffff:127.0.0.1]/hook",
    "http://224.0.0.1/hook",
    "http://240.0.0.1/hook",
    "http://10.0.0.1/hook",
    "http://192.168.1.10/hook",
    "http://127.0.0.1:notaport/hook",
    "http://127.0.0.1:99999/hook",
    "http://user:secret@8.8.8.8/hook",
    "https:///hook",
    "http://no-such-host.invalid/hook",
]


@pytest.mark.parametrize("url", INWARD)
def test_a_callback_aimed_inward_or_malformed_is_refused_and_nothing_is_written(agent, url):
    status, body = agent.ask("inward", url)
    assert status == 422, body
    assert body["error"] == "invalid" and body["detail"][0]["loc"] == "callback_url", body
    assert not ActionRequest.objects.exists()


def test_a_public_address_is_accepted(agent):
    status, body = agent.ask("public", "https://8.8.8.8/hooks/decisions")
    assert status == 202, body


def test_private_addresses_only_when_allowed_and_never_link_local_or_the_console(agent, settings):
    assert agent.ask("private", "http://10.0.0.1/hook")[0] == 422
    settings.CALLBACK_ALLOW_PRIVATE = True
    assert agent.ask("private", "http://10.0.0.1/hook")[0] == 202
    # Allowing private ranges does not open loopback.
    assert agent.ask("loopback", "http://127.0.0.1:9/hook")[0] == 422
    # A host the operator names is allowed, loopback included; cloud metadata and the console itself never are.
    settings.CALLBACK_ALLOWED_HOSTS = ["127.0.0.1", "169.254.169.254", "testserver"]
    assert agent.ask("loopback", "http://127.0.0.1:9/hook")[0] == 202
    assert agent.ask("metadata", "http://169.254.169.254/latest/meta-data/")[0] == 422
    assert agent.ask("console", "http://testserver/api/runs")[0] == 422


@pytest.mark.parametrize("status", [301, 302, 303, 307])
def test_a_redirect_is_not_followed(agent, demo, client, receivers, local_receivers_allowed, status):
    target = receivers()
    redirecting = receivers(status=status, location=target.url)
    answer, request = agent.ask("redirect", redirecting.url)
    assert answer == 202, request
    approve(client, demo, request["card_id"])
    (notification,) = Notification.objects.filter(backend="callback")
    with pytest.raises(Exception, match=str(status)):
        send_notification(notification_id=notification.pk)
    assert len(redirecting.received) == 1 and target.received == []
    notification.refresh_from_db()
    assert notification.status == Notification.Status.PENDING and str(status) in notification.last_error


def test_each_callback_verifies_with_its_own_tokens_secret_only(
    agent, other_agent, demo, client, receivers, local_receivers_allowed
):
    assert agent.token.callback_secret and other_agent.token.callback_secret
    assert agent.token.callback_secret != other_agent.token.callback_secret
    received = {}
    for name, who in (("a", agent), ("b", other_agent)):
        receiver = receivers()
        status, request = who.ask(f"signed-{name}", receiver.url)
        assert status == 202, request
        approve(client, demo, request["card_id"])
        notification = Notification.objects.get(backend="callback", approval_id=request["card_id"])
        assert send_notification(notification_id=notification.pk) == "sent"
        (received[name],) = receiver.received
    for name, own, other in (("a", agent, other_agent), ("b", other_agent, agent)):
        headers, body = received[name]
        headers = {k.lower(): v for k, v in headers.items()}
        verified = Webhook(webhook_signing.key(own.token.callback_secret)).verify(body, headers)
        assert verified["status"] == "approved"
        with pytest.raises(WebhookVerificationError):
            Webhook(webhook_signing.key(other.token.callback_secret)).verify(body, headers)


def test_the_command_prints_the_token_alone_on_stdout_and_the_secret_on_stderr(demo):
    out, err = io.StringIO(), io.StringIO()
    call_command("create_api_token", "agent", stdout=out, stderr=err)
    (token,) = ApiToken.objects.filter(user=demo["agent"])
    assert out.getvalue().strip().startswith("hitl_") and len(out.getvalue().split()) == 1
    assert token.callback_secret.startswith("whsec_") and token.callback_secret in err.getvalue()
    assert token.callback_secret not in out.getvalue()


def test_a_callback_secret_is_rotated_by_a_command_and_audited(demo):
    token, _ = ApiToken.issue(demo["agent"])
    before = token.callback_secret
    out = io.StringIO()
    call_command("rotate_callback_secret", token.prefix, stdout=out)
    token.refresh_from_db()
    assert token.callback_secret != before and out.getvalue().strip() == token.callback_secret
    entry = AuditEntry.objects.filter(action="api_token.rotate_callback_secret").get()
    assert entry.data["prefix"] == token.prefix and token.callback_secret not in json.dumps(entry.data)
    assert before not in json.dumps(entry.data)


def test_a_callback_secret_is_rotated_in_admin_shown_once_and_audited(admin_client, bob):
    token, _ = ApiToken.issue(bob)
    before = token.callback_secret
    assert before not in admin_client.get(f"/admin/core/apitoken/{token.pk}/change/").content.decode()
    response = admin_client.post(
        "/admin/core/apitoken/", {"action": "rotate_callback_secret", "_selected_action": [token.pk]}
    )
    token.refresh_from_db()
    assert response.status_code == 200 and token.callback_secret != before
    assert token.callback_secret in response.content.decode() and "no-store" in response["Cache-Control"]
    entry = AuditEntry.objects.get(action="api_token.rotate_callback_secret")
    assert (entry.actor, entry.target) == ("alice", "user:bob")
    # One token at a time: the page shows one secret, for the token it names.
    other, _ = ApiToken.issue(bob)
    response = admin_client.post(
        "/admin/core/apitoken/", {"action": "rotate_callback_secret", "_selected_action": [token.pk, other.pk]}
    )
    assert response.status_code == 302 and AuditEntry.objects.filter(action=entry.action).count() == 1


def test_two_tokens_of_one_user_do_not_verify_each_others_callbacks(
    agent, client, demo, receivers, local_receivers_allowed
):
    """The request records the token that asked, and only its secret signs the callback (before the request named
    its token, every live token of the user signed it, so a second token of the same user verified it too)."""
    second = Agent(client, demo["agent"])
    receiver = receivers()
    status, request = agent.ask("one-token", receiver.url)
    assert status == 202, request
    approve(client, demo, request["card_id"])
    notification = Notification.objects.get(backend="callback", approval_id=request["card_id"])
    assert send_notification(notification_id=notification.pk) == "sent"
    ((headers, body),) = receiver.received
    headers = {k.lower(): v for k, v in headers.items()}
    assert Webhook(webhook_signing.key(agent.token.callback_secret)).verify(body, headers)["status"] == "approved"
    with pytest.raises(WebhookVerificationError):
        Webhook(webhook_signing.key(second.token.callback_secret)).verify(body, headers)


def test_the_callback_backend_is_there_only_when_the_external_app_registers_it(monkeypatch, settings):
    """approvals knows email and webhook only: the callback backend is the external app's, registered at start-up
    (external.apps), and NOTIFY_BACKENDS names it to no effect without that registration."""
    spec = importlib.util.spec_from_file_location("approvals_notify_alone", notify.__file__)
    alone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alone)
    assert sorted(alone.BACKENDS) == ["email", "webhook"]
    assert isinstance(notify.BACKENDS["callback"], CallbackBackend)

    settings.NOTIFY_BACKENDS = ["email", "callback"]
    monkeypatch.setattr(notify, "BACKENDS", dict(alone.BACKENDS))
    assert notify.enabled_backends() == ["email"]
    apps.get_app_config("external").ready()
    assert isinstance(notify.BACKENDS["callback"], CallbackBackend)
    assert notify.enabled_backends() == ["email", "callback"]
