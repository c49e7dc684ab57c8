from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.auth.models import Group
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction
from django.db.models import Q
from django.dispatch import Signal
from django.utils import timezone

from approvals import edits, rules

# The errors of a decision (approvals.errors) and its vocabulary (approvals.rules), where callers found them before
# they moved: `from approvals.models import NotAllowed` still works.
from approvals.errors import AlreadyDecided as AlreadyDecided
from approvals.errors import CannotCheckEdit as CannotCheckEdit
from approvals.errors import DecisionError as DecisionError
from approvals.errors import InvalidDecision as InvalidDecision
from approvals.errors import NotAllowed as NotAllowed
from approvals.errors import SecondApproverNeeded as SecondApproverNeeded
from approvals.errors import StaleVersion as StaleVersion
from approvals.rules import Agreement, DecisionKind
from core.models import AuditEntry, Channel
from runs.gates import Kind
from runs.models import Run


class ApprovalStatus(models.TextChoices):
    PENDING = "pending"
    APPROVED = "approved"
    EDITED = "edited"
    REJECTED = "rejected"
    EXPIRED = "expired"
    ESCALATED = "escalated"
    CANCELLED = "cancelled"


_OPEN = [ApprovalStatus.PENDING, ApprovalStatus.ESCALATED]


class OnExpiry(models.TextChoices):
    """What a card's deadline does, when the card says rather than its channel (an external agent's request)."""

    CHANNEL = "", "as the channel's SLA policy says"
    EXPIRE = "expire", "expires: nothing runs (fail closed)"
    ESCALATE = "escalate", "escalates once as the channel says, then expires"


# Sent in the transaction that closes a card with an outcome (a decision that completes it, an SLA's safe default
# or expiry), with `card`: what depends on the outcome (an external agent's callback) is written with it.
card_closed = Signal()


class Risk(models.TextChoices):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


class Approval(models.Model):
    """The card: what the agent wants to do on a channel, against the current state, and why."""

    Status = ApprovalStatus
    Risk = Risk

    OPEN = tuple(_OPEN)
    DECIDED = (Status.APPROVED, Status.EDITED, Status.REJECTED)

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="approvals")
    # Copied from the run when the card opens, so that the inbox filters and counts open cards without joining
    # every one of them to its run.
    workflow = models.CharField(max_length=100, blank=True)
    run_created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_index=False
    )
    step_seq = models.PositiveIntegerField()
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.ACTION)
    channel = models.ForeignKey(Channel, on_delete=models.PROTECT, related_name="approvals")
    proposed = models.JSONField(encoder=DjangoJSONEncoder)
    current = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    summary = models.TextField(blank=True)
    # Display hints from the gate's declaration (runs.gates.Display), copied when the card opens so that the
    # inbox shows any workflow's headline and amount without knowing its proposal's shape; an edit writes them
    # again from what then runs (decide), so that they are never the proposal's once it was edited.
    headline = models.CharField(max_length=300, blank=True)
    amount_minor = models.BigIntegerField(null=True, blank=True, help_text="An amount in minor units (cents).")
    currency = models.CharField(max_length=3, blank=True)
    rule_id = models.CharField(max_length=100, blank=True)
    confidence = models.FloatField(null=True, blank=True)
    citations = models.JSONField(default=list, blank=True)
    risk = models.CharField(max_length=8, choices=Risk.choices, default=Risk.MEDIUM)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    # Shadow mode (core.models.Channel.in_shadow, read when the card opens): nothing is sent for it; the
    # reviewer does the action by hand and records what they did and whether they agree with the agent.
    shadow = models.BooleanField(default=False)
    args_hash = models.CharField(max_length=64)
    version = models.PositiveIntegerField(default=1)
    due_at = models.DateTimeField()
    on_expiry = models.CharField(
        max_length=16,
        choices=OnExpiry.choices,
        blank=True,
        default=OnExpiry.CHANNEL,
        help_text="What the deadline does when the card says so instead of its channel (external requests).",
    )
    # Set when the SLA ran out on an `escalate` channel: the group the card was escalated to.
    assigned_group = models.ForeignKey(
        Group, null=True, blank=True, on_delete=models.SET_NULL, related_name="escalated_approvals"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["due_at"]
        indexes = [
            models.Index(fields=["status", "channel", "due_at"], name="approvals_open_by_channel"),
            # The dashboard's agreement rate per workflow and rule reads shadow cards only.
            models.Index(fields=["workflow", "rule_id"], condition=Q(shadow=True), name="approvals_shadow_by_rule"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "step_seq"],
                condition=Q(status__in=_OPEN),
                name="approvals_approval_one_open_per_step",
            ),
            models.CheckConstraint(
                condition=Q(status__in=ApprovalStatus.values), name="approvals_approval_status_valid"
            ),
            models.CheckConstraint(condition=Q(kind__in=Kind.values), name="approvals_approval_kind_valid"),
            models.CheckConstraint(
                condition=Q(status__in=_OPEN, decided_at__isnull=True)
                | (~Q(status__in=_OPEN) & Q(decided_at__isnull=False)),
                name="approvals_approval_decided_iff_decided_at",
            ),
            models.CheckConstraint(
                condition=Q(confidence__isnull=True) | Q(confidence__gte=0, confidence__lte=1),
                name="approvals_approval_confidence_0_1",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} card on {self.channel} for {self.run_id}#{self.step_seq} ({self.status})"

    def save(self, *args, **kwargs):
        if self._state.adding and not self.workflow:
            self.workflow, self.run_created_by_id = self.run.workflow, self.run.created_by_id
        super().save(*args, **kwargs)

    # --- what runs ---------------------------------------------------------------------------------------------
    # The one answer to "what does approving this card run?", for the engine (approvals.gates), the card page, the
    # inbox and the API alike, so that what a person is shown and what runs cannot disagree.

    @property
    def last_edit(self) -> Decision | None:
        """The latest edit of this card: on an open card the pending edit, which runs if the card is approved as
        it stands (two-person rule); on an edited card, what ran. None when nobody edited it. Reads the card's
        decisions when they were prefetched (`prefetch_related("decisions__actor")`), else asks for it."""
        if "decisions" in getattr(self, "_prefetched_objects_cache", {}):
            edits_made = [d for d in self.decisions.all() if d.decision == DecisionKind.EDIT]
            return max(edits_made, key=lambda d: (d.created_at, d.pk), default=None)
        return latest_edits().filter(approval=self).select_related("actor").first()

    @property
    def to_execute(self) -> dict | None:
        """What runs: the last edit's payload, else the proposal as it stands; None once the card was rejected,
        expired or cancelled (nothing of it runs)."""
        if self.status in (self.Status.REJECTED, self.Status.EXPIRED, self.Status.CANCELLED):
            return None
        edit = self.last_edit
        return edit.payload if edit is not None else self.proposed

    def display_of(self, payload) -> dict:
        """The gate's display hints (runs.gates.Display: headline, amount, currency) applied to `payload`, for
        the columns the inbox reads; nothing for a card whose gate declares none (budget and reconcile cards), or
        whose gate this process cannot resolve (edits.GateUnresolved: a deploy in progress)."""
        try:
            spec = edits.gate_spec(self)
        except edits.GateUnresolved:
            return {}
        return spec.display.values(payload) if spec is not None else {}

    def decide(
        self,
        actor,
        decision: str,
        *,
        comment: str = "",
        reason: str = "",
        payload: dict | None = None,
        version: int | None = None,
        agreement: str = "",
        done_by_hand: str = "",
        via: str = "",
    ) -> Approval:
        """Approve, edit (the edited payload is what executes) or reject (a comment is required). Writes the
        decision, updates the card and re-queues the run with its job, all in one transaction.

        The rules are approvals.rules: what a decision carries (`Asked`), who may take it (a person with
        `approve_channel` on the card's channel, never on a run they started; the system, with no actor, always
        may), what it must fit (an edit the card's validator, approvals.edits; a shadow card's agreement), and
        the two-person count (`TwoPersonCount`: on a channel with `required_approvals = 2` the card stays open
        until a second person approves what executes as it stands). An edit is what runs from then on
        (`to_execute`): the card's display columns become the edit's, and the version that a later decision must
        name is the one after it. On a shadow card the decision records what the reviewer did by hand. `via` names
        where it was taken or where the person came from when not the console itself (`slack`; `email`: a
        DecisionLink), in its audit entry."""
        asked = rules.Asked.of(
            decision, comment=comment, reason=reason, payload=payload, agreement=agreement, done_by_hand=done_by_hand
        )
        with transaction.atomic():
            # One lock order everywhere: the run, then its card (Run.cancel, the engine and the SLA policy do the
            # same). The card's lock orders this against the SLA timer's compare-and-swap (approvals.policy):
            # whichever commits first wins, the other sees the card's new status.
            run = Run.objects.select_for_update().get(pk=self.run_id)
            card = Approval.objects.select_for_update().select_related("channel").get(pk=self.pk)
            card.run = run
            rules.check(actor, card, asked, version)  # on what the lock lets us read: whoever the caller is
            earlier = list(card.decisions.order_by("created_at", "pk"))
            count = rules.TwoPersonCount.of(card, asked.decision, earlier)
            count.check(actor)
            Decision.objects.create(
                approval=card,
                actor=actor,
                decision=asked.decision,
                comment=asked.comment,
                reason=asked.reason,
                payload=asked.payload,
                agreement=asked.agreement,
                done_by_hand=asked.done_by_hand,
            )
            if count.complete:
                card.status, card.decided_at = self.Status(rules.outcome(asked.decision, earlier)), timezone.now()
            card.version += 1
            # The inbox shows what runs: after an edit, the display columns are the edit's (in this transaction).
            display = card.display_of(card.to_execute) if asked.decision == DecisionKind.EDIT else {}
            for column, value in display.items():
                setattr(card, column, value)
            card.save(update_fields=["status", "decided_at", "version", *display])
            card._audit_decision(actor, asked, count, earlier, via=via)
            if count.complete:
                card_closed.send(Approval, card=card)
            # Two-person rule: a first approval leaves the card open and the run parked.
            if count.complete and run.status in Run.PARKED:
                run.resume()
        return card

    def _audit_decision(
        self, actor, asked: rules.Asked, count: rules.TwoPersonCount, earlier: list[Decision], via: str = ""
    ) -> None:
        edit_pending = any(d.decision == DecisionKind.EDIT for d in earlier)
        AuditEntry.record(
            f"approval.{asked.decision.value}",
            actor=actor,
            target=f"approval:{self.pk}",
            run_id=self.run.id,
            approval_id=self.pk,
            channel=self.channel.name,
            trace_id=self.run.trace_id,
            data={
                "kind": self.kind,
                "comment": asked.comment,
                "reason": asked.reason,
                "version": self.version,
                "proposed": self.proposed,
                # What this decision lets run, when it is not the proposal: an edit, or the approval of one.
                **({"payload": asked.payload} if asked.decision == DecisionKind.EDIT else {}),
                **({"payload": self.to_execute} if asked.decision == DecisionKind.APPROVE and edit_pending else {}),
                **(
                    {"shadow": True, "agreement": asked.agreement, "done_by_hand": asked.done_by_hand}
                    if self.shadow
                    else {}
                ),
                **({"approvals": count.given, "required": count.required} if count.applies else {}),
                **({"via": via} if via else {}),
            },
        )


class Decision(models.Model):
    """One person's (or the system's) decision on a card."""

    approval = models.ForeignKey(Approval, on_delete=models.CASCADE, related_name="decisions")
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT)
    Kind = DecisionKind

    decision = models.CharField(max_length=8, choices=DecisionKind.choices)
    comment = models.TextField(blank=True)
    reason = models.CharField(max_length=32, blank=True)
    payload = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    # Shadow cards only (Approval.shadow): the reviewer's agreement with the agent and what they did by hand.
    agreement = models.CharField(max_length=8, choices=Agreement.choices, blank=True)
    done_by_hand = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at"]
        constraints = [
            models.CheckConstraint(condition=Q(decision__in=DecisionKind.values), name="approvals_decision_valid"),
            models.CheckConstraint(
                condition=Q(agreement__in=["", *Agreement.values]), name="approvals_decision_agreement_valid"
            ),
            models.CheckConstraint(
                condition=~Q(decision=DecisionKind.REJECT) | ~Q(comment=""),
                name="approvals_decision_reject_has_comment",
            ),
        ]


def latest_edits() -> models.QuerySet[Decision]:
    """Edit decisions, the latest first: a card's first one is what runs in place of its proposal."""
    return Decision.objects.filter(decision=DecisionKind.EDIT).order_by("-created_at", "-pk")


class NotificationStatus(models.TextChoices):
    PENDING = "pending"
    SENT = "sent"
    FAILED = "failed"
    SKIPPED = "skipped"  # nothing to send to (an escalation group without email addresses)


class Notification(models.Model):
    """One notification about a card (an SLA escalation) through one backend (approvals.notify). Sent by its
    own job on the `outbound` queue and retried there; one that keeps failing stays here as `failed`, with its
    last error, for a person to see in Django admin. It never blocks the decision or the escalation."""

    Status = NotificationStatus

    approval = models.ForeignKey(Approval, on_delete=models.CASCADE, related_name="notifications")
    event = models.CharField(max_length=32, default="sla.escalate")
    backend = models.CharField(max_length=16)
    group = models.ForeignKey(Group, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    payload = models.JSONField(default=dict, encoder=DjangoJSONEncoder)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["status", "-created_at"], name="approvals_notification_status")]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=NotificationStatus.values),
                name="approvals_notification_status_valid",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event} via {self.backend} for card {self.approval_id} ({self.status})"


class RejectReason(models.TextChoices):
    """Why a reviewer rejected a card: the short taxonomy the card's reject form offers (validated by the view)."""

    WRONG_AMOUNT = "wrong_amount", "Wrong amount"
    WRONG_RECIPIENT = "wrong_recipient", "Wrong recipient"
    POLICY = "policy", "Against policy"
    DUPLICATE = "duplicate", "Duplicate"
    OTHER = "other", "Other"


class DecisionLink(models.Model):
    """An Approve or Reject link in a notification email (approvals.links): one per recipient per decision per
    notification. It opens the card with that decision pre-selected; it authenticates nobody (the console's login
    does) and decides nothing (the person presses the button of the card page's own decide form, which carries
    it). Good once (`used_at`, set in the decision's transaction), until `expires_at` (the card's deadline when it
    was sent) and while the card is open."""

    class Choice(models.TextChoices):
        APPROVE = DecisionKind.APPROVE.value
        REJECT = DecisionKind.REJECT.value

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    approval = models.ForeignKey(Approval, on_delete=models.CASCADE, related_name="decision_links")
    notification = models.ForeignKey(Notification, on_delete=models.CASCADE, related_name="decision_links")
    recipient = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    decision = models.CharField(max_length=8, choices=Choice.choices)
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    # Set once the email carrying it went out: a retried notification does not mail that recipient again.
    emailed_at = models.DateTimeField(null=True, blank=True)
    used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["notification", "recipient", "decision"], name="approvals_decisionlink_one_per_recipient"
            ),
            models.CheckConstraint(
                condition=Q(decision__in=["approve", "reject"]), name="approvals_decisionlink_decision_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.decision} link to card {self.approval_id} for user {self.recipient_id}"

    def use(self) -> bool:
        """Compare-and-swap: marks the link used, if nobody did. Called in the decision's transaction, after
        Approval.decide (the lock order stays run, card, then link): False means another request used it first,
        and the caller rolls the decision back."""
        now = timezone.now()
        used = DecisionLink.objects.filter(pk=self.pk, used_at__isnull=True).update(used_at=now) == 1
        if used:
            self.used_at = now
        return used
