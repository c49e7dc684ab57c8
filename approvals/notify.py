"""The notifier: tells people about a card that needs them (an SLA escalation).

A backend turns a Notification row into one delivery and raises on failure; the `send_notification` job
(approvals.tasks) calls it outside any transaction, retries it with backoff, and records the outcome on the
row. Backends: `email` (Django's mail, to each person the escalation asks, with their own Approve and Reject
links: approvals.links) and `webhook` (a JSON POST signed
with Standard Webhooks, like the deliveries we receive: `webhook-id` (the notification's id, the same on every
retry, so the receiver can drop a copy), `webhook-timestamp` and `webhook-signature: v1,<base64 HMAC-SHA256 of
"<id>.<timestamp>.<body>">`, one per NOTIFY_WEBHOOK_SECRET during a rotation; core.webhook_signing)."""

from __future__ import annotations

import json
import urllib.request
from typing import Protocol

from django.conf import settings
from django.contrib.auth.models import User
from django.core.mail import EmailMultiAlternatives
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import Q
from django.template.loader import render_to_string
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from approvals import labels, links
from approvals.models import DecisionLink, Notification
from core import pii, webhook_signing


class NothingToSend(Exception):
    """The backend has nobody to deliver to: the notification is skipped, not failed."""


class Backend(Protocol):
    name: str

    def send(self, notification: Notification) -> None:
        """Deliver it, or raise."""


class EmailBackend:
    """One email per person the escalation asks (`_recipients`), each with that person's own Approve and
    Reject links (approvals.links: they open the card with the choice pre-selected; the person logs in and
    presses the button). Templates: approvals/email/escalated.txt and .html. A retry after a failure part way
    mails only those whose email did not go out yet."""

    name = "email"

    def send(self, notification: Notification) -> None:
        recipients = list(_recipients(notification))
        if not recipients:
            raise NothingToSend(
                "no members of the escalation group (or people its policy level names) have an email address"
            )
        payload = notification.payload
        subject = f"[HITL] Card {payload.get('approval_id')} on {payload.get('channel')} escalated: SLA expired"
        base = settings.CONSOLE_URL
        words = labels.for_card(notification.approval)  # a reconcile card's "approve" is "It happened"
        for recipient in recipients:
            made = links.for_recipient(notification, recipient)
            if all(link.emailed_at is not None for link in made.values()):
                continue  # an earlier attempt of this notification mailed them
            context = {
                **pii.present(payload),  # personal data masked: an email never reveals it
                "recipient": recipient,
                "card_url": base + str(payload.get("url", "")),
                "approve_url": base + links.path_for(made["approve"]),
                "reject_url": base + links.path_for(made["reject"]),
                "labels": words,
                "deadline": parse_datetime(payload["due_at"]),  # shown in the console's time zone (TIME_ZONE)
            }
            message = EmailMultiAlternatives(
                subject, render_to_string("approvals/email/escalated.txt", context), None, [recipient.email]
            )
            message.attach_alternative(render_to_string("approvals/email/escalated.html", context), "text/html")
            message.send()
            DecisionLink.objects.filter(pk__in=[link.pk for link in made.values()]).update(emailed_at=timezone.now())


def _recipients(notification: Notification):
    """Who an escalation email goes to: on a card under an approval policy escalated to its next level
    (`policy.escalate`), the people that level names, its users and the members of its groups (as the card's
    snapshot of the policy has them), never the run's creator, who may not decide it; otherwise the members of
    the notification's group (the channel's escalation group, ops when a policy is exhausted). Active users with
    an email address, each once."""
    people = User.objects.filter(is_active=True).exclude(email="")
    card, position = notification.approval, (notification.payload.get("policy_stage") or {}).get("position")
    if notification.event == "policy.escalate" and card.admin_policy and position:
        level = card.policy["stages"][position - 1]
        named = Q(pk__in=level["users"]) | Q(groups__in=level["groups"])
        return people.filter(named).exclude(pk=card.run.created_by_id).distinct().order_by("email", "pk")
    if notification.group_id is None:
        return people.none()
    return people.filter(groups=notification.group_id).order_by("email", "pk")


class WebhookBackend:
    name = "webhook"

    def send(self, notification: Notification) -> None:
        url = settings.NOTIFY_WEBHOOK_URL
        if not url:
            raise NothingToSend("NOTIFY_WEBHOOK_URL is not set")
        body = json.dumps(
            {"id": notification.pk, "event": notification.event, **pii.present(notification.payload)},  # masked
            cls=DjangoJSONEncoder,
            sort_keys=True,
        ).encode()
        secrets = webhook_signing.secret_list(settings.NOTIFY_WEBHOOK_SECRET)
        request = urllib.request.Request(
            url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                "User-Agent": "hitl-console-notifier",
                **webhook_signing.signed_headers(secrets, str(notification.pk), body),
            },
        )
        # urlopen raises HTTPError for 4xx/5xx: the job records it and retries.
        with urllib.request.urlopen(request, timeout=settings.NOTIFY_WEBHOOK_TIMEOUT) as response:
            response.read(1024)


# The apps above register their own backends at start-up (their AppConfig.ready): approvals knows only these.
BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (EmailBackend(), WebhookBackend())}


def enabled_backends() -> list[str]:
    """The backends each escalation notifies through: NOTIFY_BACKENDS, less the webhook when it has no URL."""
    names = [name for name in settings.NOTIFY_BACKENDS if name in BACKENDS]
    return [name for name in names if name != "webhook" or settings.NOTIFY_WEBHOOK_URL]
