"""Posting cards to Slack, and keeping the posted messages up to date: a notification backend (approvals.notify)
named `slack`, registered by this app (slackapp.apps).

The outbox, as for every notification: a new card on a channel routed to Slack (a SlackRoute, else
SLACK_DEFAULT_CHANNEL) gets a `card.opened` Notification row and its `send_notification` job in the transaction
that opens the card; each decision on a posted card, and its close (the SLA's default or expiry too), a
`card.updated` one, in the transaction that makes it. The job (the `outbound` queue, retried with backoff) calls
Slack's Web API with slack_sdk's WebClient: chat.postMessage, whose channel and ts are kept as a SlackMessage,
then chat.update of each such message with the card as it stands when the job runs (so one update waiting in the
queue is enough: `queueing_lock`). Nothing is posted while SLACK_BOT_TOKEN is unset."""

from __future__ import annotations

from datetime import UTC

from django.conf import settings
from django.db import transaction
from procrastinate import exceptions as procrastinate_exceptions
from procrastinate.contrib.django import app
from slack_sdk import WebClient

from approvals import rules
from approvals.diff import against_current
from approvals.models import Approval, Decision, Notification
from approvals.notify import NothingToSend
from core import pii
from runs.gates import Kind
from slackapp import blocks
from slackapp.models import SlackMessage, SlackRoute

OPENED, UPDATED = "card.opened", "card.updated"


def enabled() -> bool:
    return bool(settings.SLACK_BOT_TOKEN)


def client() -> WebClient:
    """Slack's Web API client: SLACK_API_URL is Slack's own unless a test points it at a fake."""
    return WebClient(
        token=settings.SLACK_BOT_TOKEN, base_url=settings.SLACK_API_URL, timeout=int(settings.NOTIFY_WEBHOOK_TIMEOUT)
    )


def destination(card: Approval) -> str:
    """Where the card's channel posts in Slack: its SlackRoute, else SLACK_DEFAULT_CHANNEL; "" for nowhere."""
    route = SlackRoute.objects.filter(channel_id=card.channel_id).first()
    return route.slack_channel if route is not None else settings.SLACK_DEFAULT_CHANNEL


def card_url(card: Approval) -> str:
    return f"{settings.CONSOLE_URL.rstrip('/')}/approvals/{card.pk}/"


def _who(decision: Decision) -> str:
    if decision.actor is None:
        return "the system"
    name = decision.actor.get_full_name()
    return f"{decision.actor.get_username()} ({name})" if name else decision.actor.get_username()


def view_of(card: Approval) -> blocks.CardView:
    """The card as its Slack message shows it, read now."""
    decisions = list(card.decisions.select_related("actor").order_by("created_at", "pk"))
    is_open = card.status in Approval.OPEN
    approvals = ""
    # The two-person rule: the quorum of the channel's own rule, as the card carries it (Approval.rule).
    required = card.rule["stages"][0]["quorum"] if card.on_channel_rule else 1
    if is_open and required > 1:
        given = rules.counted(decisions, rules.DecisionKind.APPROVE)
        if given:
            names = ", ".join(_who(d) for d in given)
            approvals = f"{len(given)} of {required} approvals so far: {names}"
    outcome = ""
    if not is_open:
        last = decisions[-1] if decisions and card.status in Approval.DECIDED else None
        when = f"{card.decided_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC" if card.decided_at else ""
        by = f" by {_who(last)}" if last is not None else ""
        outcome = f"{card.status.capitalize()}{by} at {when}"
        if last is not None and last.comment:
            outcome += f': "{last.comment}"'
    # Slack never reveals personal data: what the card keeps (references) is shown masked, as on every page.
    to_run = card.to_execute
    shown = against_current(pii.present(card.current), pii.present(to_run if to_run is not None else card.proposed))
    return blocks.CardView(
        id=card.pk,
        version=card.version,
        channel=card.channel.name,
        workflow=card.workflow,
        headline=pii.present(card.headline),
        summary=pii.present(card.summary),
        risk=card.risk,
        due_at=card.due_at.astimezone(UTC),
        url=card_url(card),
        status=card.status,
        is_open=is_open,
        decidable=card.kind == Kind.ACTION and not card.shadow,
        changes=shown.to_show,
        claims_unchanged=shown.claims_unchanged,
        amount=f"{card.amount_minor / 100:,.2f} {card.currency}".strip() if card.amount_minor is not None else "",
        approvals=approvals,
        outcome=outcome,
    )


# --- the outbox: written in the transaction of what it tells ----------------------------------------------------


def _defer(notification: Notification, **options) -> None:
    app.configure_task("approvals.tasks.send_notification", allow_unknown=False, **options).defer(
        notification_id=notification.pk
    )


def announce(card: Approval) -> None:
    """A new card: post it, if its channel goes to Slack."""
    if not enabled() or not (to := destination(card)):
        return
    notification = Notification.objects.create(
        approval=card, event=OPENED, backend="slack", payload={"slack_channel": to, "url": card_url(card)}
    )
    _defer(notification)


def refresh(card_id: int) -> None:
    """The card changed: update its messages (if it has any). One update waiting in the queue shows whatever the
    card is when it runs, so a second is not queued beside it (its notification goes with it)."""
    if not enabled() or not SlackMessage.objects.filter(approval_id=card_id).exists():
        return
    try:
        with transaction.atomic():  # a savepoint: AlreadyEnqueued must not abort the caller's transaction
            notification = Notification.objects.create(approval_id=card_id, event=UPDATED, backend="slack")
            _defer(notification, queueing_lock=f"slack-update:{card_id}")
    except procrastinate_exceptions.AlreadyEnqueued:
        pass


def card_saved(sender, instance: Approval, created: bool, **_) -> None:
    """post_save of Approval: a new card is posted; a card saved again (a decision: Approval.decide saves it, an
    approval of two and an edit included; a card replaced by a new question) has its message updated."""
    if created:
        announce(instance)
    else:
        refresh(instance.pk)


def card_closed(sender, card: Approval, **_) -> None:
    """approvals.models.card_closed: also sent where a card is closed without being saved (approvals.sla's
    compare-and-swap: a safe default, an expiry; its run's cancel)."""
    refresh(card.pk)


# --- the backend: the job's side -------------------------------------------------------------------------------


class SlackBackend:
    name = "slack"

    def send(self, notification: Notification) -> None:
        if not enabled():
            raise NothingToSend("SLACK_BOT_TOKEN is not set")
        card = Approval.objects.select_related("channel").get(pk=notification.approval_id)
        if notification.event == OPENED:
            self._post(notification, card)
        else:  # card.updated, and an SLA escalation where NOTIFY_BACKENDS names slack
            self._update(card)

    def _post(self, notification: Notification, card: Approval) -> None:
        if SlackMessage.objects.filter(notification=notification).exists():
            return  # posted by an earlier attempt that failed after it
        view = view_of(card)
        response = client().chat_postMessage(
            channel=notification.payload["slack_channel"], unfurl_links=False, **blocks.message(view)
        )
        SlackMessage.objects.create(
            approval=card, notification=notification, slack_channel=response["channel"], ts=response["ts"]
        )
        # Decided while the post was on its way: the update queued then found no message to update.
        card.refresh_from_db(fields=["status", "version"])
        if card.version != view.version or card.status != view.status:
            self._update(card)

    def _update(self, card: Approval) -> None:
        messages = list(SlackMessage.objects.filter(approval=card))
        if not messages:
            raise NothingToSend("the card was not posted to Slack")
        content = blocks.message(view_of(card))
        web = client()
        for posted in messages:
            web.chat_update(channel=posted.slack_channel, ts=posted.ts, **content)
