"""The cards and what hangs on them: the card (Approval), its decisions, notifications and emailed decision links;
the approval policies that say who decides a channel's cards (ApprovalPolicy, PolicyStage); and delegation while
someone is away."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import Group, User
from django.contrib.postgres.fields import ArrayField
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, models, transaction
from django.db.models import Q
from django.dispatch import Signal
from django.utils import timezone

from approvals import edits, personal, rules
from approvals.errors import Expired, InvalidDecision
from approvals.rules import Agreement, AtEnd, DecisionKind, StagePurpose
from core import pii, tracing
from core.access import decidable_channels, may_approve
from core.models import AuditEntry, Channel
from runs import compensations
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


# Sent by Approval.decide, in its transaction, when a person's decision finds the card past its deadline: the card's
# expiry (approvals.sla.apply_sla: escalate, safe default, expire) is applied there and then, whatever the timer
# jobs do, and the decision is refused (Expired). approvals.apps connects approvals.sla, which imports this module.
card_overdue = Signal()

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
    # A hard end (an external agent's `expires_in`): the card expires then whatever its stage, and no stage's
    # deadline is later. Null: the card's policy or channel says when it ends.
    expires_at = models.DateTimeField(null=True, blank=True)
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
    # The approval policy the card was opened under (ApprovalPolicy.snapshot: an admin's later edit does not
    # change it), or its channel's own rule as a one-stage policy (rules.channel_rule), and the row of it the card
    # is at. Null on a card opened before every card carried one: its channel's rule, read as `rule`.
    policy = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    stage = models.PositiveSmallIntegerField(default=0)
    # Who the card asks now (rules.Asking of its stage), as columns the inbox filters on: anyone who may approve
    # the channel, or these users and the members of these groups (and whoever covers for these users).
    asked_anyone = models.BooleanField(default=True)
    asked_users = ArrayField(models.IntegerField(), default=list, blank=True)
    asked_groups = ArrayField(models.IntegerField(), default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    # The card's place in its run's trace (core.tracing): the W3C traceparent of the span that opened it, then, once
    # decided, of its `approval.wait` span (which the resumed step links to). Blank with tracing off.
    trace_parent = models.CharField(max_length=55, blank=True, default="", db_default="")

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
        undo: bool = False,
    ) -> Approval:
        """Approve, edit (the edited payload is what executes) or reject (a comment is required). Writes the
        decision, updates the card and re-queues the run with its job, all in one transaction.

        The rules are approvals.rules: what a decision carries (`Asked`), who may take it (a person with
        `approve_channel` on the card's channel, never on a run they started; the system, with no actor, always
        may), what it must fit (an edit the card's validator, approvals.edits; a shadow card's agreement), and
        the one count (`PolicyCount`, under the policy the card carries, `rule`: an admin's, or its channel's own
        rule as a one-stage policy; on a channel with `required_approvals = 2` the card stays open until a second
        person approves what executes as it stands). An edit is what runs from then on
        (`to_execute`): the card's display columns become the edit's, and the version that a later decision must
        name is the one after it. On a shadow card the decision records what the reviewer did by hand. `via` names
        where it was taken or where the person came from when not the console itself (`slack`; `email`: a
        DecisionLink), in its audit entry. `undo` (a rejection of an action or budget card only): reject and undo,
        what the run did is compensated too (runs.compensations; refused when there is nothing it can undo)."""
        asked = rules.Asked.of(
            decision,
            comment=comment,
            reason=reason,
            payload=payload,
            agreement=agreement,
            done_by_hand=done_by_hand,
            undo=undo,
        )
        with transaction.atomic():
            # One lock order everywhere: the run, then its card (Run.cancel, the engine and approvals.sla do the
            # same). The card's lock orders this against the SLA timer's compare-and-swap (approvals.sla):
            # whichever commits first wins, the other sees the card's new status.
            run = Run.objects.select_for_update().get(pk=self.run_id)
            card = Approval.objects.select_for_update().select_related("channel").get(pk=self.pk)
            card.run = run
            covering = Delegation.covered_by(actor)
            # An edit keeps personal data as references (a mask left as shown, a clear value typed back, a new
            # value of a marked field: approvals.personal), whichever view it comes from; sealed in this
            # transaction, so that a refused edit leaves nothing in the vault. One that cannot be sealed (it lacks
            # the subject's field) is refused after the card's own rules, which say what is wrong with it.
            unsealable = None
            if asked.decision == DecisionKind.EDIT:
                try:
                    asked = dataclasses.replace(asked, payload=personal.keep_personal(card, asked.payload))
                except pii.SchemaError as exc:
                    unsealable = InvalidDecision(str(exc), [{"loc": "payload", "msg": str(exc)}])
            rules.check(actor, card, asked, version, covering)  # on what the lock lets us read: whoever the caller is
            if unsealable is not None:
                raise unsealable
            if asked.undo:
                compensations.check_undo_on_rejection(card)  # nothing to undo: refused (UndoRefused), nothing done
            now = timezone.now()
            if actor is not None and card.due_at <= now:
                # Past its deadline: the card's expiry applies now, in this transaction, and the decision is refused
                # once it commits. A deadline does not depend on a timer job having run (the system's own
                # decisions, actor None, are the expiry).
                missed = card.due_at
                card_overdue.send(Approval, card=card, now=now)
                late = Expired(card, missed)
            else:
                late = None
                card._record(run, actor, asked, covering, via)
        if late is not None:
            # Committed: the card's expiry stands; the decision was not taken.
            raise late
        return card

    def _record(self, run: Run, actor, asked: rules.Asked, covering: list[int], via: str) -> None:
        """Approval.decide's write, on this card and its run as decide locked and checked them: the decision, where
        it leaves the card (the one count, rules.PolicyCount, under the policy it carries), its audit entry, and the
        run resumed when the card is decided."""
        earlier = list(self.decisions.order_by("created_at", "pk"))
        count = rules.PolicyCount.of(self, actor, asked.decision, earlier, covering)
        count.check(actor)
        # Under an admin's policy a decision records its stage (and whom it was taken for); under the channel's
        # own rule, as before cards carried it, none (its evidence reads no `policy_stage`).
        on_policy = not count.channel_rule
        Decision.objects.create(
            approval=self,
            actor=actor,
            decision=asked.decision,
            comment=asked.comment,
            reason=asked.reason,
            payload=asked.payload,
            agreement=asked.agreement,
            done_by_hand=asked.done_by_hand,
            undo=asked.undo,
            stage=count.stage if on_policy else None,
            stage_name=count.stage_name if on_policy else "",
            on_behalf_of_id=count.on_behalf_of if on_policy else None,
        )
        moved = []
        traced = []
        if count.complete:
            self.status, self.decided_at = self.Status(rules.outcome(asked.decision, earlier)), timezone.now()
            traced = self._trace_wait(actor, earlier + [asked])
        elif on_policy and count.to_stage != self.stage:
            moved = self.enter_stage(count.to_stage, timezone.now())
        # Under an admin's policy the version names what runs (a quorum's second person approves what the first one
        # saw, even when both clicked at once): an edit or the card's end changes it, another yes does not.
        # Under the channel's own rule (the two-person rule) every decision changes it, as it always did.
        if not on_policy or count.complete or asked.decision == DecisionKind.EDIT:
            self.version += 1
        # The inbox shows what runs: after an edit, the display columns are the edit's (in this transaction).
        display = self.display_of(self.to_execute) if asked.decision == DecisionKind.EDIT else {}
        for column, value in display.items():
            setattr(self, column, value)
        self.save(update_fields=["status", "decided_at", "version", *moved, *display, *traced])
        self._audit_decision(actor, asked, count, earlier, via=via)
        if count.complete:
            card_closed.send(Approval, card=self)
        # Two-person rule: a first approval leaves the card open and the run parked.
        if count.complete and run.status in Run.PARKED:
            run.resume()

    def _trace_wait(self, actor, decisions: list) -> list[str]:
        """The person's wait for this card as an `approval.wait` span (core.tracing), from the card's opening to its
        decision, under the span that opened it; the card keeps the wait's traceparent, which the job that resumes
        the run links its step to (approvals.gates), so that the wait spans the park and the resume. Ids only: the
        decider's user id, never a name. Exported once the decision commits. The fields to save (none when off)."""
        if not tracing.ENABLED:
            return []
        wait = tracing.start_span(
            "approval.wait",
            {
                "hitl.approval_id": self.pk,
                "hitl.run_id": str(self.run_id),
                "hitl.channel": self.channel.name,
                "hitl.approval.kind": self.kind,
                "hitl.policy.stage": self.stage,
                "hitl.decision": str(self.status),
                "hitl.edited": any(d.decision == DecisionKind.EDIT for d in decisions),
                "hitl.decided_by": str(actor.pk) if actor is not None else "system",
            },
            # A card opened outside any span (a budget card, or by a process with traces off): under its run's root.
            parent=self.trace_parent
            or tracing.parent_of(self.run.trace_parent, self.run.trace_id, self.run.pk.hex[:16]),
            start_time=self.created_at,
        )
        self.trace_parent = tracing.traceparent_of(wait)
        decided_at = self.decided_at
        transaction.on_commit(lambda: tracing.end_span(wait, decided_at))
        return ["trace_parent"]

    # --- the policy the card carries --------------------------------------------------------------------------------

    @property
    def rule(self) -> dict:
        """The policy this card is counted and asks under (rules.PolicyCount, rules.Asking): its snapshot of an
        admin's policy; under its channel's own rule, the rule as the card carries it, never weaker than the channel
        is now (rules.channel_rule_now); for a card opened before every card carried one (`policy` null), its
        channel's rule, read now. The one place where a card's channel rule is read."""
        if not self.on_channel_rule:
            return self.policy
        return rules.channel_rule_now(self.policy, self.channel)

    @property
    def on_channel_rule(self) -> bool:
        """Under its channel's own rule (`required_approvals`, the channel's SLA policy), not an admin's policy."""
        return rules.is_channel_rule(self.policy)

    @property
    def admin_policy(self) -> dict | None:
        """The admin-defined approval policy this card was opened under, or None (its channel's own rule): what the
        card page, the API (`policy_stage`, `asked`), the audit log and notifications name as a policy."""
        return None if self.on_channel_rule else self.policy

    def policy_stage(self, row: int | None = None) -> dict | None:
        """Which policy, at which version, and which of its stages (row `row`, else the card's): for the audit log
        and the evidence export. None under the channel's own rule."""
        if self.on_channel_rule:
            return None
        row = self.stage if row is None else row
        stage = self.policy["stages"][row]
        return {
            "policy": self.policy["name"],
            "version": self.policy["version"],
            "stage": stage["name"],
            "position": row + 1,
            "of": len(self.policy["stages"]),
        }

    def asked_names(self) -> dict:
        """Who the card asks now, by name (its asked_* columns): for audit entries and the card page."""
        return {
            "anyone_on_channel": self.asked_anyone,
            "users": sorted(User.objects.filter(pk__in=self.asked_users).values_list("username", flat=True)),
            "groups": sorted(Group.objects.filter(pk__in=self.asked_groups).values_list("name", flat=True)),
        }

    STAGE_COLUMNS = ("stage", "due_at", "status", "asked_anyone", "asked_users", "asked_groups", "assigned_group")

    def enter_stage(self, row: int, now: datetime) -> tuple[str, ...]:
        """Move this open card (locked by the caller) to row `row` of its policy: who it asks, and its deadline,
        the row's SLA from `now`. Returns the columns changed, for the caller's save or UPDATE. An escalation level
        makes the card `escalated`, assigned to the level's first group."""
        stage = self.rule["stages"][row]
        asking = rules.Asking.at(self.rule, row)
        self.stage, self.due_at = row, now + timedelta(seconds=stage["sla"])
        if self.expires_at is not None:
            self.due_at = min(self.due_at, self.expires_at)
        escalated = stage["purpose"] == StagePurpose.ESCALATE
        self.status = self.Status.ESCALATED if escalated else self.Status.PENDING
        self.asked_anyone, self.asked_users, self.asked_groups = (
            asking.anyone,
            sorted(asking.users),
            sorted(asking.groups),
        )
        self.assigned_group_id = stage["groups"][0] if escalated and stage["groups"] else None
        return self.STAGE_COLUMNS

    def _audit_decision(self, actor, asked: rules.Asked, count, earlier: list[Decision], via: str = "") -> None:
        edit_pending = any(d.decision == DecisionKind.EDIT for d in earlier)
        policy = {}
        if not count.channel_rule:
            # The evidence export reads `policy_stage` and `on_behalf_of` (core.audit_verifier.decision_summary).
            policy = {
                "policy_stage": self.policy_stage(count.stage),
                **({"on_behalf_of": _username(count.on_behalf_of)} if count.on_behalf_of else {}),
                **({"next_stage": self.policy_stage(self.stage)} if not count.complete else {}),
            }
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
                **({"undo": True} if asked.undo else {}),
                **policy,
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
    undo = models.BooleanField(
        default=False, db_default=False, help_text="Reject and undo: what the run did is undone too."
    )
    # Under an approval policy (Approval.policy): the row of it the decision was taken at, its name, and the
    # absent person it was taken for (Delegation), when the actor decided as their cover.
    stage = models.PositiveSmallIntegerField(null=True, blank=True)
    stage_name = models.CharField(max_length=100, blank=True)
    on_behalf_of = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
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
            models.CheckConstraint(
                condition=Q(undo=False) | Q(decision=DecisionKind.REJECT), name="approvals_decision_undo_rejects"
            ),
        ]


def latest_edits() -> models.QuerySet[Decision]:
    """Edit decisions, the latest first: a card's first one is what runs in place of its proposal."""
    return Decision.objects.filter(decision=DecisionKind.EDIT).order_by("-created_at", "-pk")


class InboxCount(models.Model):
    """How many open cards there are of each kind the inbox tells apart without a clock, kept by PostgreSQL: a
    trigger on the cards and one on the decisions (migration 0016) add a row of +n or -n in the transaction of
    every write that opens, closes or moves an open card, whatever makes it (the ORM, raw SQL, admin, bulk). The
    count of a key is the sum of its rows; `compact` folds them into one row per key, periodically.

    A key is what the inbox filters on (channel, risk, workflow) and what says who may decide the card
    (approvals.access.deciding: who started its run, whom its stage asks, who decided it already), so that a
    reviewer's counts are the sum of the rows they may decide, exactly as their rows (approvals.inbox). Adding rows
    rather than updating one per key: no writer waits for another's counter (nor deadlocks on one)."""

    KEY = (
        *("channel_id", "risk", "workflow", "run_created_by_id"),
        *("asked_anyone", "asked_users", "asked_groups", "deciders"),
    )

    channel = models.ForeignKey(
        Channel, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    risk = models.CharField(max_length=8)
    workflow = models.CharField(max_length=100)
    run_created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="+",
    )
    asked_anyone = models.BooleanField()
    asked_users = ArrayField(models.IntegerField())
    asked_groups = ArrayField(models.IntegerField())
    # The people who decided the card already, sorted (its decisions' actors): an open card they decided waits
    # for someone else (the two-person rule, a policy's quorum), and is not in their inbox.
    deciders = ArrayField(models.IntegerField())
    n = models.IntegerField()

    def __str__(self) -> str:
        return f"{self.n:+d} open on channel {self.channel_id}, {self.risk}, {self.workflow}"

    @classmethod
    def compact(cls) -> int:
        """Fold the rows into one per key (none for a key whose rows sum to 0); returns the rows left. One
        transaction: a reader sees the rows before or after it, whose sums are the same. Writers only insert, and
        rows committed after this started are left for the next time, so it never waits for a writer nor makes one
        wait; a second compaction at the same time does nothing."""
        key = ", ".join(cls.KEY)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_xact_lock(hashtext('approvals_inboxcount.compact'))")
            if not cursor.fetchone()[0]:
                return 0
            cursor.execute(
                f"WITH gone AS (DELETE FROM approvals_inboxcount RETURNING {key}, n)"
                f" INSERT INTO approvals_inboxcount ({key}, n)"
                f" SELECT {key}, sum(n) FROM gone GROUP BY {key} HAVING sum(n) <> 0"
            )
            return cursor.rowcount


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


def _username(user_id: int | None) -> str:
    return User.objects.filter(pk=user_id).values_list("username", flat=True).first() or ""


# --- approval policies --------------------------------------------------------------------------------------------


class ApprovalPolicy(models.Model):
    """Who decides a channel's cards, how many, and by when (rules: approvals.rules, "approval policies").

    Bound to a channel: `applies_to` empty, every card of the channel; else the cards of one workflow step (its
    name) or one agent tool (`tool:<name>`), which it overrides. A gate may also name its policy in code
    (`wf.gate(..., policy="<name>")`), which wins over both. The cards of a channel with no policy carry its own
    rule as a one-stage policy (rules.channel_rule: `required_approvals` of any approvers, its SLA policy). Each
    card keeps a snapshot of the policy it was opened under (`snapshot`), so an edit here applies to cards opened
    after it. Edited in Django admin, audited."""

    AtEnd = AtEnd

    name = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=200, blank=True)
    channel = models.ForeignKey(Channel, on_delete=models.CASCADE, related_name="approval_policies")
    applies_to = models.CharField(
        max_length=100,
        blank=True,
        help_text="Empty: every card of the channel. Else a workflow step's name, or tool:<name> for an agent's tool.",
    )
    at_end = models.CharField(
        max_length=8,
        choices=AtEnd.choices,
        default=AtEnd.REJECT,
        help_text="When the last escalation level's SLA runs out.",
    )
    version = models.PositiveIntegerField(default=1, editable=False)

    class Meta:
        verbose_name_plural = "approval policies"
        ordering = ["channel__name", "applies_to"]
        constraints = [
            models.UniqueConstraint(fields=["channel", "applies_to"], name="approvals_policy_one_per_key"),
            models.CheckConstraint(condition=Q(at_end__in=AtEnd.values), name="approvals_policy_at_end_valid"),
        ]

    def __str__(self) -> str:
        return self.name

    @classmethod
    def for_card(cls, channel: Channel, step: str = "", tool: str = "", named: str = "") -> ApprovalPolicy | None:
        """The policy a card opening on `channel` follows: the one its gate names, else the channel's for its
        step or tool, else the channel's own, else None (the channel's rule)."""
        policies = cls.objects.prefetch_related("stages__users", "stages__groups")
        if named:
            policy = policies.filter(name=named).first()
            if policy is None:
                raise LookupError(f"the gate names approval policy {named!r}, which does not exist")
            return policy
        keys = [*([step] if step else []), *([f"tool:{tool}"] if tool else []), ""]
        found = {p.applies_to: p for p in policies.filter(channel=channel, applies_to__in=keys)}
        return next((found[key] for key in keys if key in found), None)

    @staticmethod
    def missing(name: str, channel: Channel) -> dict:
        """The snapshot a card gets when its gate names policy `name` and there is none: fail closed. One stage
        that asks nobody (nobody may approve it), rejected by the system at the channel's SLA."""
        stage = {"name": f"policy {name} does not exist", "purpose": StagePurpose.APPROVE, "quorum": 1}
        stage |= {"sla": int(channel.sla.total_seconds()), "anyone": False, "users": [], "groups": []}
        return {"id": None, "name": name, "version": 0, "at_end": AtEnd.REJECT, "stages": [stage]}

    def snapshot(self) -> dict:
        """What a card keeps of this policy (approvals.rules reads it)."""
        return {
            "id": self.pk,
            "name": self.name,
            "version": self.version,
            "at_end": self.at_end,
            "stages": [stage.snapshot() for stage in self.stages.all()],
        }


class PolicyStage(models.Model):
    """One row of an approval policy, in order: a stage of the chain (`approve`), or an escalation level of the
    stage above it (`escalate`), with who decides there, how many distinct people, and its SLA."""

    Purpose = StagePurpose

    policy = models.ForeignKey(ApprovalPolicy, on_delete=models.CASCADE, related_name="stages")
    position = models.PositiveSmallIntegerField(default=0)
    name = models.CharField(max_length=100)
    purpose = models.CharField(max_length=8, choices=StagePurpose.choices, default=StagePurpose.APPROVE)
    quorum = models.PositiveSmallIntegerField(default=1, help_text="How many distinct people must approve here.")
    sla = models.DurationField(null=True, blank=True, help_text="Empty: the channel's SLA.")
    channel_approvers = models.BooleanField(
        default=False, help_text="Anyone who may approve the channel decides here (else the groups and users named)."
    )
    groups = models.ManyToManyField(Group, blank=True, related_name="+")
    users = models.ManyToManyField(settings.AUTH_USER_MODEL, blank=True, related_name="+")

    class Meta:
        ordering = ["position", "pk"]
        constraints = [
            models.CheckConstraint(condition=Q(quorum__gte=1), name="approvals_policystage_quorum_positive"),
            models.CheckConstraint(
                condition=Q(purpose__in=StagePurpose.values), name="approvals_policystage_purpose_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.policy}: {self.name}"

    def snapshot(self) -> dict:
        return {
            "name": self.name,
            "purpose": self.purpose,
            "quorum": self.quorum,
            "sla": int((self.sla or self.policy.channel.sla).total_seconds()),
            "anyone": self.channel_approvers,
            "users": sorted(u.pk for u in self.users.all()),
            "groups": sorted(g.pk for g in self.groups.all()),
        }


# --- delegation ---------------------------------------------------------------------------------------------------


class DelegationRefused(ValueError):
    """A delegation that may not be set: said to the person, nothing changed."""


class Delegation(models.Model):
    """ "Away until ..., cover: X": until `until`, the cards whose policy names `user` are decided by `cover`
    as well, each such decision recorded and audited as taken on `user`'s behalf. Set and cleared by the user in
    the console (approvals.views.away), audited."""

    LONGEST = timedelta(days=90)

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="delegation")
    cover = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="covering")
    until = models.DateTimeField()
    created_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=~Q(user=models.F("cover")), name="approvals_delegation_not_to_self")
        ]

    def __str__(self) -> str:
        return f"{self.user} away until {self.until:%Y-%m-%d %H:%M}, cover {self.cover}"

    @classmethod
    def covered_by(cls, user, now: datetime | None = None) -> list[int]:
        """The people `user` covers for now: their delegation's window is open and they are active. Whether each
        still holds the right to decide a given card is read when the cover decides it (approvals.rules
        .holds_the_right, on the card's channel)."""
        if user is None or not getattr(user, "pk", None):
            return []
        return list(
            cls.objects.filter(cover=user, until__gt=now or timezone.now(), user__is_active=True)
            .order_by("user_id")
            .values_list("user_id", flat=True)
        )

    @classmethod
    def refusal(cls, user, cover, until: datetime | None, now: datetime | None = None) -> str:
        """Why `user` may not hand their cards to `cover` until `until` ("" when they may): not to themselves,
        not in the past nor more than LONGEST (90 days) ahead, and only to someone who may approve every channel
        `user` approves."""
        now = now or timezone.now()
        if cover is None or not cover.is_active:
            return "choose an active user to cover for you"
        if cover.pk == user.pk:
            return "you cannot delegate to yourself"
        if until is None or until <= now:
            return "the end of your absence must be in the future"
        if until > now + cls.LONGEST:
            # A delegation hands on a right that the person may lose meanwhile: it is renewed, not left open.
            return f"a delegation lasts at most {cls.LONGEST.days} days: set it again when it ends"
        channels = list(decidable_channels(user))
        if not channels:
            return "you approve no channel: there is nothing to delegate"
        missing = [channel.name for channel in channels if not may_approve(cover, channel)]
        if missing:
            return f"{cover.get_username()} may not approve {', '.join(missing)}: choose someone who may"
        return ""

    @classmethod
    def set(cls, user, cover, until: datetime | None) -> Delegation:
        """Record (or replace) `user`'s delegation, audited; DelegationRefused, and nothing changed, otherwise."""
        if refusal := cls.refusal(user, cover, until):
            raise DelegationRefused(refusal)
        with transaction.atomic():
            before = cls.objects.select_for_update().filter(user=user).first()
            delegation, _ = cls.objects.update_or_create(user=user, defaults={"cover": cover, "until": until})
            AuditEntry.record(
                "delegation.set",
                actor=user,
                target=f"user:{user.get_username()}",
                data={
                    "user": user.get_username(),
                    "cover": cover.get_username(),
                    "until": until,
                    "before": before and {"cover": before.cover.get_username(), "until": before.until},
                },
            )
        return delegation

    @classmethod
    def clear(cls, user) -> bool:
        """End `user`'s delegation now, audited. False when there was none."""
        with transaction.atomic():
            before = cls.objects.select_for_update().select_related("cover").filter(user=user).first()
            if before is None:
                return False
            before.delete()
            AuditEntry.record(
                "delegation.clear",
                actor=user,
                target=f"user:{user.get_username()}",
                data={"user": user.get_username(), "cover": before.cover.get_username(), "until": before.until},
            )
        return True
