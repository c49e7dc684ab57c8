"""The approvals app's jobs: each card's SLA timer, the sweep behind the timers, notifications, and the folding of
the inbox's count rows."""

from __future__ import annotations

import structlog
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from procrastinate.contrib.django import app

from approvals import notify, sla
from approvals.models import Approval, InboxCount, Notification
from jobs.retry import BackoffWithJitter

log = structlog.get_logger("approvals.tasks")


@app.task(name="approvals.tasks.card_due", queue="hitl")
def card_due(card_id: int) -> str | None:
    """A card's deadline came: apply its channel's SLA policy (a no-op if it was decided in time). A timer that
    finds the deadline moved later (the card escalated through the sweep meanwhile) waits for the new one."""
    now = timezone.now()
    done = sla.apply_sla(card_id, now)
    card = Approval.objects.filter(pk=card_id, status__in=Approval.OPEN, due_at__gt=now).first()
    if card is not None:
        with transaction.atomic():
            sla.schedule_timer(card)
    return done


@app.periodic(cron=settings.SLA_SWEEP_CRON)
@app.task(name="approvals.tasks.sla_sweep", queue="hitl", queueing_lock="sla_sweep")
def sla_sweep(timestamp: int) -> int:
    """The safety net behind the timers (a timer lost with a restored backup, a card opened before timers
    existed): applies the policy to every open card past its deadline. Returns how many it changed."""
    now = timezone.now()
    changed = sum(1 for card_id in sla.overdue_card_ids(now) if sla.apply_sla(card_id, now))
    if changed:
        log.warning("the SLA sweep applied a policy a timer had not", cards=changed)
    return changed


@app.periodic(cron=settings.INBOX_COMPACT_CRON)
@app.task(name="approvals.tasks.compact_inbox_counts", queue="maintenance", queueing_lock="compact_inbox_counts")
def compact_inbox_counts(timestamp: int) -> int:
    """Fold the inbox's count rows into one per key (InboxCount.compact): the triggers add a row per write, and
    the inbox reads them all, so this keeps what it reads near the number of kinds of open cards. Returns the rows
    left. Missing a tick costs the inbox a few more rows to read, never a wrong count."""
    return InboxCount.compact()


class NotificationFailed(Exception):
    pass


@app.task(name="approvals.tasks.send_notification", queue="outbound", retry=BackoffWithJitter())
def send_notification(notification_id: int) -> str:
    """Deliver one notification. A failure is recorded on the row and raised, so the job is retried with
    backoff; after NOTIFY_MAX_ATTEMPTS the row stays `failed` (visible in admin) and the job gives up."""
    notification = Notification.objects.filter(pk=notification_id).first()
    if notification is None or notification.status in (Notification.Status.SENT, Notification.Status.SKIPPED):
        return "nothing to do"
    backend = notify.BACKENDS.get(notification.backend)
    attempts = notification.attempts + 1
    try:
        if backend is None:
            raise NotificationFailed(f"no notification backend named {notification.backend!r}")
        backend.send(notification)
    except notify.NothingToSend as exc:
        Notification.objects.filter(pk=notification.pk).update(
            status=Notification.Status.SKIPPED, attempts=attempts, last_error=str(exc)
        )
        return "skipped"
    except Exception as exc:
        error = f"{exc.__class__.__name__}: {exc}"
        give_up = attempts >= settings.NOTIFY_MAX_ATTEMPTS
        Notification.objects.filter(pk=notification.pk).update(
            status=Notification.Status.FAILED if give_up else Notification.Status.PENDING,
            attempts=attempts,
            last_error=error[:2000],
        )
        log.warning(
            "notification failed",
            notification_id=notification.pk,
            backend=notification.backend,
            attempts=attempts,
            gave_up=give_up,
            error=error,
        )
        if give_up:
            return "failed"
        raise NotificationFailed(error) from exc
    Notification.objects.filter(pk=notification.pk).update(
        status=Notification.Status.SENT, attempts=attempts, last_error="", sent_at=timezone.now()
    )
    return "sent"
