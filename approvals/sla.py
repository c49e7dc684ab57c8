"""A card's deadline (its SLA): what happens to a card nobody decided by its `due_at`.

`apply_sla(card_id, now)` is called by the card's own timer job (approvals.tasks.card_due, scheduled at
`due_at`) and by the periodic sweep behind it. Both may fire for the same deadline, and a reviewer may click at
the same moment: a compare-and-swap on (status, due_at) decides, so exactly one of them acts and the others
find nothing to do.

- `escalate`: the card stays open (`escalated`, still decidable), is assigned to the channel's escalation
  group, gets a new deadline (due_at + the channel's SLA) with a new timer, and the group is notified.
- `safe_default`: the card is rejected by `system` (no side effect happens) and the run is re-queued, so it
  ends as its workflow says a rejection ends. Reconcile cards escalate instead (their rejection would act).

A card may override its channel (`Approval.on_expiry`, an external agent's request): `expire` closes it as
expired at its deadline (fail closed: nothing runs), `escalate` escalates it once and expires it at the next.

Every card carries a policy snapshot (`Approval.policy`). Under its channel's own rule (approvals.rules.channel_rule,
or no snapshot on an older card) the card follows the channel's SLA policy above, as it always did. A card opened
under an admin's approval policy follows that policy instead: its deadline is its stage's; when
it passes, the card moves to the stage's next escalation level (announced: an audit entry and a notification),
and past the last level the policy's end applies: `reject` (fail closed, as the safe default; a reconcile card
waits instead) or `wait` (the card stays open and ops are alerted, again at each of the level's SLA).
"""

from __future__ import annotations

from datetime import datetime, timedelta

import structlog
from django.contrib.auth.models import Group
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone
from procrastinate.contrib.django import app
from procrastinate.exceptions import AlreadyEnqueued

from approvals import notify, rules
from approvals.models import Approval, Decision, Notification, OnExpiry, card_closed
from core.models import AuditEntry, Channel, Role
from runs.gates import Kind
from runs.models import Run

log = structlog.get_logger("approvals.sla")

SAFE_DEFAULT_COMMENT = "SLA expired: safe default"
SAFE_DEFAULT_REASON = "policy"
SYSTEM = "system"  # the actor named in the audit log


def _audit(card: Approval, action: str, data: dict) -> None:
    """The system's audit entry about `card` (in the caller's transaction)."""
    AuditEntry.record(
        action,
        actor=SYSTEM,
        target=f"approval:{card.pk}",
        run_id=card.run_id,
        approval_id=card.pk,
        channel=card.channel.name,
        trace_id=card.run.trace_id,
        data=data,
    )


def schedule_timer(card: Approval) -> None:
    """Defer the card's timer job at its `due_at`, in the caller's transaction (the one that opens the card or
    moves its deadline): the timer exists if and only if that commits. One waiting timer per card; a timer
    that fires on a deadline moved later re-schedules itself (approvals.tasks.card_due, deferred by its name: the
    tasks call this module)."""
    assert connection.in_atomic_block, "the timer is deferred in the transaction that sets the deadline"
    timer = app.configure_task(
        "approvals.tasks.card_due", allow_unknown=False, schedule_at=card.due_at, queueing_lock=f"card-due:{card.pk}"
    )
    try:
        with transaction.atomic():  # a savepoint: AlreadyEnqueued must not abort the caller's transaction
            timer.defer(card_id=card.pk)
    except AlreadyEnqueued:
        pass  # a timer already waits for this card: it re-schedules itself if the deadline moved


def apply_sla(card_id: int, now: datetime | None = None) -> str | None:
    """Apply the channel's policy to the card if it is still open and past its deadline at `now`.

    Returns what was done ("escalate" or "safe_default"), or None when there was nothing to do (decided,
    cancelled, not yet due, or another caller acted first)."""
    now = now or timezone.now()
    card = Approval.objects.select_related("channel", "run").filter(pk=card_id).first()
    if card is None or card.status not in Approval.OPEN or card.due_at > now:
        return None
    channel: Channel = card.channel
    # A hard end (an external agent's `expires_in`): the card expires, fail closed, whatever its stage.
    if card.expires_at is not None and card.expires_at <= now:
        return "expire" if _expire(card, now) else None
    if not card.on_channel_rule:
        return _policy_deadline(card, now)
    # The channel's own rule: the channel's SLA policy (read now, as it always was), or what the card says.
    # A card may say what its deadline does (an external agent's request): it expires, fail closed, at once or
    # after one escalation.
    if card.on_expiry == OnExpiry.EXPIRE or (
        card.on_expiry == OnExpiry.ESCALATE and card.status == card.Status.ESCALATED
    ):
        return "expire" if _expire(card, now) else None
    if card.on_expiry == OnExpiry.ESCALATE:
        return "escalate" if _escalate(card, now) else None
    # A reconcile card is never auto-rejected: there a rejection means "it did not happen: do the write now",
    # an ambiguous write done again with nobody deciding. Nor a failed compensation's: there it means "a person
    # undid it by hand". They escalate instead.
    if channel.escalation_policy == Channel.EscalationPolicy.SAFE_DEFAULT and card.kind not in NEVER_AUTO_REJECTED:
        return "safe_default" if _safe_default(card, now) else None
    return "escalate" if _escalate(card, now) else None


def _swap(card: Approval, now: datetime, **changes) -> bool:
    """The compare-and-swap: change the card only if it is still open with the deadline we read. The UPDATE
    waits for a reviewer's decide() holding the row, then re-checks the condition against what it committed."""
    return (
        Approval.objects.filter(pk=card.pk, status__in=Approval.OPEN, due_at=card.due_at, due_at__lte=now).update(
            **changes
        )
        == 1
    )


def _escalate(card: Approval, now: datetime) -> bool:
    channel = card.channel
    # The new deadline counts from the missed one, not from whenever the timer ran, so a late worker does not
    # stretch the SLA; but it is never in the past, or the card would escalate again at once.
    due_at = max(card.due_at + channel.sla, now + channel.sla / 10)
    group = channel.escalation_group
    with transaction.atomic():
        # The version is left alone: a reviewer who loaded the card before the escalation still decides it.
        if not _swap(card, now, status=Approval.Status.ESCALATED, assigned_group=group, due_at=due_at):
            return False
        missed, card.due_at = card.due_at, due_at
        card.status, card.assigned_group = Approval.Status.ESCALATED, group
        _audit(
            card,
            "sla.escalate",
            {"missed_due_at": missed, "due_at": due_at, "group": group.name if group else None},
        )
        schedule_timer(card)
        _notify(card, missed)
    log.info("card escalated", card_id=card.pk, channel=channel.name, group=group.name if group else None)
    return True


def _policy_deadline(card: Approval, now: datetime) -> str | None:
    """The deadline of a card's policy stage passed: its next escalation level, else the policy's end."""
    row = rules.next_level(card.policy, card.stage)
    if row is not None:
        return "escalate" if _escalate_level(card, now, row) else None
    if card.on_expiry:
        # An external agent's request ends as it said (`on_expiry`): past the policy's last level, it expires.
        return "expire" if _expire(card, now) else None
    if card.policy["at_end"] == rules.AtEnd.REJECT and card.kind not in NEVER_AUTO_REJECTED:
        return "safe_default" if _safe_default(card, now, comment=FAIL_CLOSED_COMMENT) else None
    return "alert_ops" if _alert_ops(card, now) else None


FAIL_CLOSED_COMMENT = "Approval policy exhausted: fail closed"
NEVER_AUTO_REJECTED = (Kind.RECONCILE, Kind.UNDO_FAILED)  # a rejection there says something happened


def _stage_swap(card: Approval, now: datetime, columns) -> bool:
    """The compare-and-swap of a policy card: change it only if it is still open, at the stage and with the
    deadline we read. A decision holding the row (Approval.decide) is waited for; one that moved the card on (to
    its next stage, or decided it) makes this find nothing."""
    changes = {("assigned_group_id" if c == "assigned_group" else c): getattr(card, c) for c in columns}
    return (
        Approval.objects.filter(
            pk=card.pk, status__in=Approval.OPEN, due_at=card._missed, stage=card._from, due_at__lte=now
        ).update(**changes)
        == 1
    )


def _escalate_level(card: Approval, now: datetime, row: int) -> bool:
    card._missed, card._from = card.due_at, card.stage
    columns = card.enter_stage(row, card.due_at)  # counted from the missed deadline, as a channel's escalation
    level = timedelta(seconds=card.policy["stages"][row]["sla"])
    card.due_at = max(card.due_at, now + level / 10)  # never in the past
    with transaction.atomic():
        if not _stage_swap(card, now, columns):
            return False
        _audit(
            card,
            "policy.escalate",
            {
                "missed_due_at": card._missed,
                "due_at": card.due_at,
                "from": card.policy_stage(card._from),
                "policy_stage": card.policy_stage(row),
                "asked": card.asked_names(),
            },
        )
        schedule_timer(card)
        _notify(card, card._missed, event="policy.escalate")
    log.info("card escalated to its policy's next level", card_id=card.pk, stage=row)
    return True


def _alert_ops(card: Approval, now: datetime) -> bool:
    """The end of a `wait` policy: the card stays open where it is, ops are alerted, and again after the level's
    SLA if nobody decides it meanwhile."""
    card._missed, card._from = card.due_at, card.stage
    card.due_at = max(card.due_at, now) + timedelta(seconds=card.policy["stages"][card.stage]["sla"])
    with transaction.atomic():
        if not _stage_swap(card, now, ["due_at"]):
            return False
        _audit(
            card,
            "policy.exhausted",
            {"missed_due_at": card._missed, "due_at": card.due_at, "policy_stage": card.policy_stage()},
        )
        schedule_timer(card)
        _notify(card, card._missed, event="policy.exhausted", group=Group.objects.filter(name=Role.OPS).first())
    log.warning("approval policy exhausted: the card waits, ops alerted", card_id=card.pk)
    return True


def _notify(card: Approval, missed: datetime, event: str = "sla.escalate", group: Group | None = None) -> None:
    """A Notification row and its job per enabled backend, in the escalation's transaction: sent if and only
    if the escalation commits, and sent (with retries) by the `outbound` queue, never by this transaction."""
    group = group or card.assigned_group
    payload = {
        "approval_id": card.pk,
        "run_id": str(card.run_id),
        "workflow": card.run.workflow,
        "channel": card.channel.name,
        "summary": card.summary,
        "risk": card.risk,
        "group": group.name if group else None,
        **({"policy_stage": card.policy_stage()} if card.admin_policy else {}),
        "missed_due_at": missed.isoformat(),
        "due_at": card.due_at.isoformat(),
        "url": f"/approvals/{card.pk}/",
    }
    for backend in notify.enabled_backends():
        notification = Notification.objects.create(
            approval=card, event=event, backend=backend, group=group, payload=payload
        )
        app.configure_task("approvals.tasks.send_notification", allow_unknown=False).defer(
            notification_id=notification.pk
        )


def _safe_default(card: Approval, now: datetime, comment: str = SAFE_DEFAULT_COMMENT) -> bool:
    with transaction.atomic():
        # Same lock order as Approval.decide() and Run.cancel(): the run, then the card (the UPDATE below).
        run = Run.objects.select_for_update().get(pk=card.run_id)
        swapped = _swap(card, now, status=Approval.Status.REJECTED, decided_at=timezone.now(), version=F("version") + 1)
        if not swapped:
            return False
        Decision.objects.create(
            approval=card,
            actor=None,
            decision=Decision.Kind.REJECT,
            comment=comment,
            reason=SAFE_DEFAULT_REASON,
            stage=card.stage if card.admin_policy else None,
            stage_name=card.policy["stages"][card.stage]["name"] if card.admin_policy else "",
        )
        _audit(
            card,
            "sla.safe_default",
            {
                "missed_due_at": card.due_at,
                "comment": comment,
                "reason": SAFE_DEFAULT_REASON,
                **({"policy_stage": card.policy_stage()} if card.admin_policy else {}),
                "kind": card.kind,
                "proposed": card.proposed,
            },
        )
        card.refresh_from_db()
        card_closed.send(Approval, card=card)
        if run.status in Run.PARKED:
            run.resume()
    log.info("card rejected by its SLA's safe default", card_id=card.pk, channel=card.channel.name)
    return True


def _expire(card: Approval, now: datetime) -> bool:
    """The card's deadline passed with nobody deciding it: it is closed as expired, and nothing of it runs."""
    with transaction.atomic():
        # Same lock order as Approval.decide() and Run.cancel(): the run, then the card (the UPDATE below).
        run = Run.objects.select_for_update().get(pk=card.run_id)
        if not _swap(card, now, status=Approval.Status.EXPIRED, decided_at=timezone.now(), version=F("version") + 1):
            return False
        card.refresh_from_db()
        _audit(
            card,
            "sla.expire",
            {"missed_due_at": card.due_at, "kind": card.kind, "proposed": card.proposed},
        )
        card_closed.send(Approval, card=card)
        if run.status in Run.PARKED:
            run.resume()
    log.info("card expired", card_id=card.pk, channel=card.channel.name)
    return True


def on_overdue(sender, card: Approval, now: datetime, **_) -> None:
    """approvals.models.card_overdue: a person's decision found `card` past its deadline, in Approval.decide's
    transaction (the run and the card locked): the expiry applies there, as the timer would have applied it."""
    apply_sla(card.pk, now)


def overdue_card_ids(now: datetime, limit: int = 500) -> list[int]:
    """Open cards past their deadline, oldest deadline first (the sweep's work list)."""
    return list(
        Approval.objects.filter(status__in=Approval.OPEN, due_at__lte=now)
        .order_by("due_at")
        .values_list("pk", flat=True)[:limit]
    )
