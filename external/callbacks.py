"""An external agent's decision callback: when its request's card closes (external.status.card_closed), the
decision is written as a notification with its job, in the decision's transaction, and the `outbound` queue
(approvals.tasks.send_notification) delivers it through CallbackBackend, sent, signed and retried like any other
notification. This app registers the backend at start-up (external.apps), as slackapp registers Slack's: approvals
knows nothing of external agents' callbacks."""

from __future__ import annotations

import json

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder

from approvals.models import Notification
from approvals.notify import NothingToSend
from approvals.tasks import send_notification
from core import outbound_url, pii, webhook_signing
from core.models import ApiToken
from external.models import ActionRequest


def queue(request: ActionRequest, answer: dict, stored_arguments=None) -> None:
    """The decision on the request's card (`answer`: its state, as the agent reads it) to POST to its callback_url.
    The notification keeps `stored_arguments` (references) in place of the answer's clear arguments: they are
    opened when it is sent (CallbackBackend), so that no clear value waits in the outbox."""
    if answer.get("arguments") is not None:
        answer = {**answer, "arguments": stored_arguments}
    notification = Notification.objects.create(
        approval=request.card,
        event="external.decision",
        backend=CallbackBackend.name,
        payload={
            "url": request.callback_url,
            "body": json.loads(json.dumps(answer, default=str)),
            "user_id": request.created_by_id,
            "token_id": request.api_token_id,  # whose secret signs it (else every live token of the user's)
        },
    )
    send_notification.defer(notification_id=notification.pk)


class CallbackBackend:
    """An external agent's decision callback (queued by `queue`): `payload` is {url, body, user_id}, the body
    POSTed to the url as JSON, signed (Standard Webhooks; `webhook-id` the notification's id, the same on every
    retry, so the agent can drop a repeated delivery) with the callback secret of each live API token of the
    token that asked (core.models.ApiToken.callback_secret; a request asked before the request named its token: each
    live token of the user who asked): no other agent holds a key that verifies it.

    The URL is checked again now and the connection goes to the address that check approved, with no redirect
    followed (core.outbound_url): a URL that now resolves inward, or answers a 3xx, is a failed delivery."""

    name = "callback"

    def send(self, notification: Notification) -> None:
        body = dict(notification.payload["body"])
        if body.get("arguments") is not None:
            body["arguments"] = pii.present(body["arguments"], clear=True)  # the agent's own values (status.for_agent)
        body = json.dumps(body, cls=DjangoJSONEncoder, sort_keys=True).encode()
        secrets = ApiToken.callback_secrets(_asker(notification), notification.payload.get("token_id"))
        if not secrets:
            raise NothingToSend("the agent that asked has no live API token whose secret could sign its callback")
        outbound_url.post(
            notification.payload["url"],
            body,
            {
                "Content-Type": "application/json",
                "User-Agent": "hitl-console-callback",
                **webhook_signing.signed_headers(secrets, str(notification.pk), body),
            },
            timeout=settings.NOTIFY_WEBHOOK_TIMEOUT,
        )


def _asker(notification: Notification):
    """The user whose request the callback answers: in its payload, or (a callback queued before the payload
    named it) through the card's request."""
    if "user_id" in notification.payload:
        return notification.payload["user_id"]
    request = getattr(notification.approval, "action_request", None)
    return request.created_by_id if request is not None else None
