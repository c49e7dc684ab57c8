from __future__ import annotations

import hashlib
import json
import secrets
from datetime import timedelta
from typing import NamedTuple

from django.conf import settings
from django.contrib.auth.models import Group
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, models, transaction
from django.dispatch import Signal
from django.utils import timezone


class Role(models.TextChoices):
    """The roles of DESIGN.md, kept as Django groups (created by migration console.0002)."""

    REVIEWER = "reviewer"
    OPS = "ops"
    ADMIN = "admin"


class Channel(models.Model):
    """Where side effects go (`payments`, `email`, `crm`): its kill switch, SLA and approval rules."""

    class EscalationPolicy(models.TextChoices):
        ESCALATE = "escalate"
        SAFE_DEFAULT = "safe_default"

    name = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=200, blank=True)
    sla = models.DurationField(default=timedelta(hours=1), help_text="How long a card may wait for a decision.")
    escalation_policy = models.CharField(
        max_length=16, choices=EscalationPolicy.choices, default=EscalationPolicy.ESCALATE
    )
    required_approvals = models.PositiveSmallIntegerField(default=1)
    escalation_group = models.ForeignKey(
        Group, null=True, blank=True, on_delete=models.SET_NULL, related_name="escalation_channels"
    )
    kill_switch_engaged = models.BooleanField(default=False)
    kill_switch_reason = models.TextField(blank=True)
    kill_switch_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    kill_switch_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        permissions = [
            ("approve_channel", "Can see and decide the approval cards of this channel"),
            ("operate_channel", "Can engage and release this channel's kill switch"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(required_approvals__in=[1, 2]),
                name="console_channel_required_approvals_1_or_2",
            ),
            models.CheckConstraint(
                condition=models.Q(escalation_policy__in=["escalate", "safe_default"]),
                name="console_channel_escalation_policy_valid",
            ),
            models.CheckConstraint(
                condition=models.Q(kill_switch_engaged=False) | models.Q(kill_switch_at__isnull=False),
                name="console_channel_engaged_has_time",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @classmethod
    def killed_for_effects(cls, name: str) -> Killed | None:
        """Inside the transaction that writes an effect's receipt: the switch that stops `name` (the global
        one first), else None. FOR SHARE makes engaging a switch (an UPDATE of its row) wait until effects
        already past this point have committed, and every effect after it see the switch."""
        assert connection.in_atomic_block
        with connection.cursor() as cursor:
            for _ in range(2):
                cursor.execute(
                    "SELECT kill_switch_engaged, kill_switch_reason FROM console_globalkillswitch"
                    " WHERE id = 1 FOR SHARE"
                )
                if (row := cursor.fetchone()) is not None:
                    break
                # Migration console.0006 creates the row; only a flushed (test) database lacks it. Without a
                # row there would be nothing to lock, and an engage could commit under an effect in flight.
                GlobalKillSwitch.ensure_row(cursor)
            if row is not None and row[0]:
                return Killed(GLOBAL_SWITCH, row[1])
            cursor.execute(
                "SELECT kill_switch_engaged, kill_switch_reason FROM console_channel WHERE name = %s FOR SHARE",
                [name],
            )
            row = cursor.fetchone()
        if row is not None and row[0]:
            return Killed(name, row[1])
        return None

    def engage_kill_switch(self, by, reason: str) -> bool:
        """Stop every side effect on this channel from the moment this commits (effects already past their
        receipt finish). Idempotent: an engaged switch stays as it was (same reason, no audit entry), and
        False is returned. Raises ReasonRequired for a blank reason."""
        return _flip(self, True, by, reason, switch=self.name)

    def release_kill_switch(self, by, reason: str) -> bool:
        """Let effects through again and, in the same transaction, resume every run this switch paused.
        Idempotent like engage_kill_switch."""
        return _flip(self, False, by, reason, switch=self.name)

    @property
    def switch_key(self) -> str:
        """How runs paused by this channel's switch name it (Run.paused_switch)."""
        return self.name


# Sent inside the transaction that releases a switch, with `switch` (a channel's name or GLOBAL_SWITCH);
# each receiver returns how many runs it resumed.
kill_switch_released = Signal()

# Run.paused_switch of a run paused by the global switch (channel names are slugs, so no channel is "*").
GLOBAL_SWITCH = "*"


class Killed(NamedTuple):
    """Which switch stops a channel, and why."""

    switch: str  # the channel's name, or GLOBAL_SWITCH
    reason: str

    def describe(self, channel: str) -> str:
        if self.switch == GLOBAL_SWITCH:
            return f"global kill switch engaged (stops {channel}): {self.reason or 'no reason given'}"
        return f"kill switch engaged on {channel}: {self.reason or 'no reason given'}"


class ReasonRequired(ValueError):
    """Engaging or releasing a kill switch needs a reason (it is what the on-call person reads at 2 a.m.)."""


KILL_SWITCH_REASON_MAX = 500


class GlobalKillSwitch(models.Model):
    """The switch that stops every channel at once: a single row (id 1), checked before each channel's own
    switch by Channel.killed_for_effects. Ops (and superusers) engage and release it."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    kill_switch_engaged = models.BooleanField(default=False)
    kill_switch_reason = models.TextField(blank=True)
    kill_switch_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    kill_switch_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "global kill switch"
        constraints = [
            models.CheckConstraint(condition=models.Q(id=1), name="console_globalkillswitch_single_row"),
            models.CheckConstraint(
                condition=models.Q(kill_switch_engaged=False) | models.Q(kill_switch_at__isnull=False),
                name="console_globalkillswitch_engaged_has_time",
            ),
        ]

    def __str__(self) -> str:
        return "global kill switch " + ("engaged" if self.kill_switch_engaged else "released")

    @staticmethod
    def ensure_row(cursor) -> None:
        cursor.execute(
            "INSERT INTO console_globalkillswitch (id, kill_switch_engaged, kill_switch_reason)"
            " VALUES (1, false, '') ON CONFLICT (id) DO NOTHING"
        )

    @classmethod
    def load(cls) -> GlobalKillSwitch:
        with connection.cursor() as cursor:
            cls.ensure_row(cursor)
        return cls.objects.select_related("kill_switch_by").get(pk=1)

    def engage_kill_switch(self, by, reason: str) -> bool:
        """Stop every channel; see Channel.engage_kill_switch."""
        return _flip(self, True, by, reason, switch=GLOBAL_SWITCH)

    def release_kill_switch(self, by, reason: str) -> bool:
        """Let every channel go again (each channel's own switch still applies) and resume the runs this
        switch paused; see Channel.release_kill_switch."""
        return _flip(self, False, by, reason, switch=GLOBAL_SWITCH)

    @property
    def switch_key(self) -> str:
        return GLOBAL_SWITCH


def _flip(switch_row: Channel | GlobalKillSwitch, engaged: bool, by, reason: str, *, switch: str) -> bool:
    """Engage or release one switch (a Channel or the GlobalKillSwitch row): lock its row, re-read, change
    it if it is not already in that state, audit, and on release resume its runs, all in one transaction.
    `switch_row` is refreshed to the stored state either way. True when it changed."""
    reason = (reason or "").strip()
    if not reason:
        raise ReasonRequired("a reason is required")
    if len(reason) > KILL_SWITCH_REASON_MAX:
        raise ReasonRequired(f"the reason is longer than {KILL_SWITCH_REASON_MAX} characters")
    model = type(switch_row)
    with transaction.atomic():
        # The lock waits for every effect that has checked this switch (FOR SHARE) and not yet committed its
        # receipt; once this commits, every later check sees the new state.
        locked = model.objects.select_for_update().get(pk=switch_row.pk)
        changed = locked.kill_switch_engaged != engaged
        if changed:
            locked.kill_switch_engaged = engaged
            locked.kill_switch_reason = reason
            locked.kill_switch_by = by
            locked.kill_switch_at = timezone.now()  # after the lock: later than every receipt that got past
            locked.save(update_fields=["kill_switch_engaged", "kill_switch_reason", "kill_switch_by", "kill_switch_at"])
            # The runs app resumes what this switch paused, in this transaction (the outbox: they resume if and
            # only if the release commits). A signal, so that the base app does not import runs.
            resumed = 0 if engaged else sum(n for _, n in kill_switch_released.send(sender=model, switch=switch))
            AuditEntry.record(
                "kill_switch.engage" if engaged else "kill_switch.release",
                actor=by,
                target="kill_switch:global" if switch == GLOBAL_SWITCH else f"channel:{switch}",
                channel="" if switch == GLOBAL_SWITCH else switch,
                data={"reason": reason, **({} if engaged else {"resumed_runs": resumed})},
            )
    for field in ("kill_switch_engaged", "kill_switch_reason", "kill_switch_by", "kill_switch_at"):
        setattr(switch_row, field, getattr(locked, field))
    return changed


def _digest(raw: str) -> str:
    # Tokens are 256 random bits, so a fast hash is enough: there is nothing to brute-force.
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiToken(models.Model):
    """A bearer token for the JSON API. Only its SHA-256 digest is stored; the token is shown once."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    digest = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=8, help_text="The token's first characters, to tell tokens apart.")
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"

    @classmethod
    def issue(cls, user) -> tuple[ApiToken, str]:
        raw = "hitl_" + secrets.token_urlsafe(32)
        token = cls.objects.create(user=user, digest=_digest(raw), prefix=raw[5:13])
        return token, raw

    @classmethod
    def authenticate(cls, raw: str):
        """The active user that `raw` belongs to, or None."""
        token = (
            cls.objects.select_related("user")
            .filter(digest=_digest(raw), revoked_at__isnull=True, user__is_active=True)
            .first()
        )
        if token is None:
            return None
        now = timezone.now()
        if token.last_used_at is None or token.last_used_at < now - timedelta(minutes=1):
            cls.objects.filter(pk=token.pk).update(last_used_at=now)
        return token.user


class ActorType(models.TextChoices):
    HUMAN = "human"
    AGENT = "agent"
    SYSTEM = "system"


# One lock for every append: an entry's prev_hash is the hash of the entry committed just before it.
_AUDIT_CHAIN_LOCK = 0x41554454  # "AUDT"


class AuditEntry(models.Model):
    """Append-only and tamper-evident: each entry's `hash` covers its content and the previous entry's hash,
    and a database trigger (migration console.0004) refuses UPDATE and DELETE. `manage.py audit_verify`
    recomputes the chain."""

    ActorType = ActorType

    at = models.DateTimeField()
    actor_type = models.CharField(max_length=8, choices=ActorType.choices)
    actor = models.CharField(max_length=150, help_text="Username, or the name of the system component.")
    action = models.CharField(max_length=64)
    target = models.CharField(max_length=200, blank=True)
    run_id = models.UUIDField(null=True, blank=True)
    approval_id = models.BigIntegerField(null=True, blank=True)
    channel = models.CharField(max_length=64, blank=True)
    data = models.JSONField(default=dict, blank=True)
    trace_id = models.CharField(max_length=32, blank=True)
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64, unique=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["-at"], name="console_audit_at"),
            models.Index(fields=["actor", "-at"], name="console_audit_actor_at"),
            models.Index(fields=["action", "-at"], name="console_audit_action_at"),
            models.Index(fields=["channel", "-at"], name="console_audit_channel_at"),
            models.Index(fields=["run_id"], name="console_audit_run"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(actor_type__in=ActorType.values), name="console_auditentry_actor_type_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"

    GENESIS = "0" * 64
    # Every column, in the order the admin page and the CSV export show them.
    COLUMNS = (
        "id",
        "at",
        "actor_type",
        "actor",
        "action",
        "target",
        "run_id",
        "approval_id",
        "channel",
        "data",
        "trace_id",
        "prev_hash",
        "hash",
    )

    @classmethod
    def record(
        cls,
        action: str,
        *,
        actor=None,
        actor_type: str | None = None,
        target: str = "",
        run_id=None,
        approval_id=None,
        channel: str = "",
        data: dict | None = None,
        trace_id: str = "",
    ) -> AuditEntry:
        """Append an entry, inside the caller's transaction (the entry commits with the change it records).

        `actor` is a user (a human, or the `agent` service identity) or a component name (system)."""
        assert connection.in_atomic_block, "audit entries are written in the transaction of what they record"
        if isinstance(actor, str) or actor is None:
            name, kind = actor or "system", actor_type or ActorType.SYSTEM
        else:
            name = actor.get_username()
            kind = actor_type or (ActorType.AGENT if name == "agent" else ActorType.HUMAN)
        entry = cls(
            actor_type=kind,
            actor=name,
            action=action,
            target=target,
            run_id=run_id,
            approval_id=approval_id,
            channel=channel,
            # Stored exactly as hashed: JSON-native values only.
            data=json.loads(json.dumps(data or {}, cls=DjangoJSONEncoder)),
            trace_id=trace_id,
        )
        with connection.cursor() as cursor:
            # Stamped by the database once the chain is ours: `at` grows with `id` (and the chain) whatever the
            # clocks of the web and worker machines say.
            cursor.execute("SELECT pg_advisory_xact_lock(%s), clock_timestamp()", [_AUDIT_CHAIN_LOCK])
            entry.at = cursor.fetchone()[1]
        last = cls.objects.order_by("-id").values_list("hash", flat=True).first()
        entry.prev_hash = last or cls.GENESIS
        entry.hash = entry.compute_hash()
        entry.save(force_insert=True)
        return entry

    def canonical(self) -> str:
        return json.dumps(
            {
                "at": self.at.isoformat(),
                "actor_type": self.actor_type,
                "actor": self.actor,
                "action": self.action,
                "target": self.target,
                "run_id": str(self.run_id) if self.run_id else None,
                "approval_id": self.approval_id,
                "channel": self.channel,
                "data": self.data,
                "trace_id": self.trace_id,
                "prev_hash": self.prev_hash,
            },
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        )

    def compute_hash(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    @classmethod
    def verify_chain(cls, chunk_size: int = 5000):
        """Yield (entry, problem) for every entry that breaks the chain; nothing when it is whole."""
        previous = cls.GENESIS
        for entry in cls.objects.order_by("id").iterator(chunk_size=chunk_size):
            if entry.prev_hash != previous:
                yield entry, f"prev_hash does not match entry before it ({previous[:12]}…)"
            elif entry.compute_hash() != entry.hash:
                yield entry, "content does not match its hash (altered)"
            previous = entry.hash
