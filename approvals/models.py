from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import Group
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction
from django.db.models import Q
from django.dispatch import Signal
from django.utils import timezone

from approvals import edits
from core.models import AuditEntry, Channel
from runs.gates import Kind
from runs.models import Run


class DecisionError(Exception):
    """A decision that cannot be taken; `status` is the HTTP status it maps to."""

    status = 400


class InvalidDecision(DecisionError):
    status = 422

    def __init__(self, message: str, errors: list[dict] | None = None):
        super().__init__(message)
        self.errors = errors or []  # an edit's field errors, {loc, msg}


class AlreadyDecided(DecisionError):
    status = 409

    def __init__(self, card: Approval):
        last = card.decisions.order_by("-created_at").first()
        by = last.actor.username if last and last.actor else "system"
        when = (card.decided_at or timezone.now()).isoformat()
        super().__init__(f"this card was already {card.status} by {by} at {when}")
        self.card, self.by, self.at = card, by, when


class NotAllowed(DecisionError):
    """The actor may not take this decision (separation of duties, or the two-person rule)."""

    status = 403


class SecondApproverNeeded(DecisionError):
    """Two-person rule: the same person cannot give both approvals."""

    status = 409


class CannotCheckEdit(DecisionError):
    """This process cannot find the card's gate (approvals.edits.GateUnresolved), so it cannot check an edit:
    refused, not checked less. Asking again once web and workers run the same workflows will do."""

    status = 409


class StaleVersion(DecisionError):
    status = 409

    def __init__(self, card: Approval, version: int):
        super().__init__(f"the card changed (version {card.version}, you sent {version}): reload it")
        self.card = card


class ApprovalStatus(models.TextChoices):
    PENDING = "pending"
    APPROVED = "approved"
    EDITED = "edited"
    REJECTED = "rejected"
    EXPIRED = "expired"
    ESCALATED = "escalated"
    CANCELLED = "cancelled"


_OPEN = [ApprovalStatus.PENDING, ApprovalStatus.ESCALATED]


class DecisionKind(models.TextChoices):
    APPROVE = "approve"
    EDIT = "edit"
    REJECT = "reject"


class Agreement(models.TextChoices):
    """On a shadow card: whether the reviewer, who did the action by hand, agrees with what the agent proposed."""

    AGREE = "agree", "I agree with the agent"
    DISAGREE = "disagree", "I disagree with the agent"


DONE_BY_HAND_MAX = 5000


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
    ) -> Approval:
        """Approve, edit (the edited payload is what executes) or reject (a comment is required). Writes the
        decision, updates the card and re-queues the run with its job, all in one transaction.

        An edit must pass the card's validator (approvals.edits: the gate's declared schema, editable leaves and
        bounds), or nothing is written. On a channel with `required_approvals = 2` what executes needs the
        approvals of two different people given after its last change: an approval or an edit is recorded and
        the card stays open until a second person approves it as it stands (an edit restarts the count, its
        author counting as one); a rejection by anyone ends it, except on a reconcile card, where "it did not
        happen" (a rejection: the write is done now) needs two people too. Only a person with `approve_channel`
        on the card's channel decides it (NotAllowed otherwise; the system, with no actor, always may), and nobody
        a card of a run they started. An edit is what runs from then on (`to_execute`): the card's display
        columns become the edit's, and the version that a later decision must name is the one after it.

        On a shadow card the decision records what the reviewer did by hand (approve: as proposed; edit: the
        payload they used; reject: nothing), with `agreement` (agree or disagree with the agent, required) and an
        optional `done_by_hand` note; other cards refuse both."""
        status = {"approve": self.Status.APPROVED, "edit": self.Status.EDITED, "reject": self.Status.REJECTED}
        if decision not in status:
            raise InvalidDecision(f"decision must be approve, edit or reject, not {decision!r}")
        comment = (comment or "").strip()
        if decision == "reject" and not comment:
            raise InvalidDecision("a rejection needs a comment saying why")
        if decision == "edit" and not isinstance(payload, dict):
            raise InvalidDecision("an edit needs the new payload (an object)")
        agreement, done_by_hand = agreement or "", (done_by_hand or "").strip()
        if agreement and agreement not in Agreement.values:
            raise InvalidDecision(f"agreement must be agree or disagree, not {agreement!r}")
        if len(done_by_hand) > DONE_BY_HAND_MAX:
            raise InvalidDecision(f"what you did is longer than {DONE_BY_HAND_MAX} characters")
        with transaction.atomic():
            # One lock order everywhere: the run, then its card (Run.cancel, the engine and the SLA policy do the
            # same). The card's lock orders this against the SLA timer's compare-and-swap (approvals.policy):
            # whichever commits first wins, the other sees the card's new status.
            run = Run.objects.select_for_update().get(pk=self.run_id)
            card = Approval.objects.select_for_update().select_related("channel").get(pk=self.pk)
            card.run = run
            # Checked here whoever the caller is (card page, API, bulk): guardian's object permission, which a
            # superuser holds on every channel. The system (no actor: the SLA policy) needs none.
            if actor is not None and not actor.has_perm("core.approve_channel", card.channel):
                raise NotAllowed(f"you may not decide cards on {card.channel.name} (no approve_channel there)")
            if card.status not in self.OPEN:
                raise AlreadyDecided(card)
            if version is not None and version != card.version:
                raise StaleVersion(card, version)
            if actor is not None and run.created_by_id == getattr(actor, "pk", None):
                raise NotAllowed("you started this run: someone else must decide its cards")
            if card.shadow and not agreement:
                raise InvalidDecision("this is a shadow card: say whether you agree with the agent (agree or disagree)")
            if not card.shadow and (agreement or done_by_hand):
                raise InvalidDecision("agreement and what you did by hand are recorded on shadow cards only")
            _check_what_would_execute(card, decision, payload)
            earlier = list(card.decisions.order_by("created_at", "pk"))
            edit_pending = any(d.decision == Decision.Kind.EDIT for d in earlier)
            # The two-person rule: on an action card, what executes needs approvals from two different people given
            # after its last change (an edit resets the count; the editor counts as one). On a reconcile card a
            # rejection counts too: it means "it did not happen: do the write now", as risky as an approval.
            needs_two = card.channel.required_approvals > 1 and (decision != "reject" or card.kind == Kind.RECONCILE)
            counted: list[Decision] = []
            if needs_two and decision == "reject":
                counted = [d for d in earlier if d.decision == Decision.Kind.REJECT]
            elif needs_two and decision == "approve":
                last_edit = max((i for i, d in enumerate(earlier) if d.decision == Decision.Kind.EDIT), default=0)
                counted = [d for d in earlier[last_edit:] if d.decision in (Decision.Kind.APPROVE, Decision.Kind.EDIT)]
            if actor is not None and any(d.actor_id == actor.pk for d in counted):
                raise SecondApproverNeeded(
                    "you already answered this card as it stands: the two-person rule needs a different person"
                )
            Decision.objects.create(
                approval=card,
                actor=actor,
                decision=decision,
                comment=comment,
                reason=reason or "",
                payload=payload if decision == "edit" else None,
                agreement=agreement,
                done_by_hand=done_by_hand,
            )
            approvals_given = len(counted) + 1
            complete = not needs_two or approvals_given >= card.channel.required_approvals
            if complete:
                edited = decision == "edit" or edit_pending
                card.status = self.Status.EDITED if edited and decision != "reject" else status[decision]
                card.decided_at = timezone.now()
            card.version += 1
            # The inbox shows what runs: after an edit, the display columns are the edit's (in this transaction).
            display = card.display_of(card.to_execute) if decision == "edit" else {}
            for column, value in display.items():
                setattr(card, column, value)
            card.save(update_fields=["status", "decided_at", "version", *display])
            AuditEntry.record(
                f"approval.{decision}",
                actor=actor,
                target=f"approval:{card.pk}",
                run_id=run.id,
                approval_id=card.pk,
                channel=card.channel.name,
                trace_id=run.trace_id,
                data={
                    "kind": card.kind,
                    "comment": comment,
                    "reason": reason or "",
                    "version": card.version,
                    "proposed": card.proposed,
                    # What this decision lets run, when it is not the proposal: an edit, or the approval of one.
                    **({"payload": payload} if decision == "edit" else {}),
                    **({"payload": card.to_execute} if decision == "approve" and edit_pending else {}),
                    **({"shadow": True, "agreement": agreement, "done_by_hand": done_by_hand} if card.shadow else {}),
                    **(
                        {"approvals": approvals_given, "required": card.channel.required_approvals} if needs_two else {}
                    ),
                },
            )
            if complete:
                card_closed.send(Approval, card=card)
            # Two-person rule: a first approval leaves the card open and the run parked.
            if complete and run.status in Run.PARKED:
                run.resume()
        return card


def _check_what_would_execute(card: Approval, decision: str, payload) -> None:
    """An edit must pass the card's validator (approvals.edits), which must be able to find the card's gate; an
    approval of a budget card must keep the limit within its ceiling."""
    try:
        if decision == "edit" and (errors := edits.edit_errors(card, payload)):
            raise InvalidDecision(f"this edit is not allowed: {edits.as_text(errors)}", errors)
    except edits.GateUnresolved as exc:
        raise CannotCheckEdit(str(exc)) from exc
    if decision == "approve" and (refusal := edits.approval_refusal(card)):
        raise InvalidDecision(f"this card cannot be approved: {refusal}")


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
