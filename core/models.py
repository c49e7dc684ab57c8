"""The models every app shares: channels and their kill switches (and the global one), the roles, API tokens, and
the append-only, hash-chained audit log."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import secrets
from datetime import timedelta
from typing import NamedTuple

from django.conf import settings
from django.contrib.auth.models import Group
from django.core.exceptions import ImproperlyConfigured
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, models, transaction
from django.dispatch import Signal
from django.utils import timezone

from core import audit_verifier


class Role(models.TextChoices):
    """The roles of DESIGN.md, kept as Django groups (created by migration console.0002, from before this app)."""

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
    shadow = models.BooleanField(
        default=False,
        help_text="Shadow mode (a pilot's first weeks): cards on this channel are marked shadow and its side effects "
        "are recorded, never sent; the reviewer does the action by hand and says whether they agree with the agent.",
    )
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
        # The tables, and the names of their constraints and indexes, are those the console app made before
        # these models moved down here (migration core.0001): a move of state only.
        db_table = "console_channel"
        ordering = ["name"]
        permissions = [
            ("approve_channel", "Can see and decide the approval cards of this channel"),
            ("operate_channel", "Can engage and release this channel's kill switch"),
            ("request_channel", "Can ask for approvals on this channel (an external agent's token)"),
            ("act_unreviewed", "Can act on this channel without a person's approval (an external agent's token)"),
            ("view_pii", "Can reveal the personal data on this channel's cards (each reveal is audited)"),
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
    def in_shadow(cls, name: str, workflow: str) -> bool:
        """Whether `workflow`'s cards and effects on channel `name` are in shadow mode: the workflow is listed in
        SHADOW_WORKFLOWS, or the channel is in shadow for every workflow. Read when a card opens, and when the
        receipt of an effect that no card authorized is first written (runs.workflow): an effect a person
        authorized follows that card's mode, so a change applies to the cards, and the unapproved effects, after it."""
        return workflow in settings.SHADOW_WORKFLOWS or cls.objects.filter(name=name, shadow=True).exists()

    @classmethod
    def killed_for_effects(cls, name: str) -> Killed | None:
        """Inside the transaction that writes an effect's receipt: the switch that stops `name` (the global
        one first), else None. The effect holds a shared advisory lock on both switches until it commits, and
        engaging a switch takes that switch's lock exclusively (`_flip`): the engage waits for effects already
        past this point, and every effect after it waits for the engage to commit, then reads it. No row is
        locked or written, so concurrent effects share nothing hot (FOR SHARE on one global row made every
        effect transaction write MultiXact entries)."""
        assert connection.in_atomic_block
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_xact_lock_shared(%s, hashtext(%s)), pg_advisory_xact_lock_shared(%s, hashtext(%s))",
                [_SWITCH_LOCKS, GLOBAL_SWITCH, _SWITCH_LOCKS, name],
            )
            # A statement of its own, after the locks: under READ COMMITTED its snapshot includes an engage that
            # committed while this transaction waited for them.
            cursor.execute(
                "SELECT g.kill_switch_engaged, g.kill_switch_reason, c.kill_switch_engaged, c.kill_switch_reason"
                " FROM (SELECT 1) one"
                " LEFT JOIN console_globalkillswitch g ON g.id = 1"
                " LEFT JOIN console_channel c ON c.name = %s",
                [name],
            )
            global_engaged, global_reason, engaged, reason = cursor.fetchone()
        if global_engaged:
            return Killed(GLOBAL_SWITCH, global_reason)
        if engaged:
            return Killed(name, reason)
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
# The first key of the kill switches' advisory locks (the second is hashtext of the switch's name).
_SWITCH_LOCKS = 0x4B494C4C  # "KILL"


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
        db_table = "console_globalkillswitch"
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
        # The switch's exclusive lock waits for every effect that has checked it (holding it shared) and not yet
        # committed its receipt; once this commits, every later check sees the new state.
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [_SWITCH_LOCKS, switch])
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


def _default_tenants() -> list[str]:
    return ["default"]


def _digest(raw: str) -> str:
    # Tokens are 256 random bits, so a fast hash is enough: there is nothing to brute-force.
    return hashlib.sha256(raw.encode()).hexdigest()


def new_callback_secret() -> str:
    """A callback signing secret as Standard Webhooks writes one: `whsec_` and 32 random bytes in base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


class ApiToken(models.Model):
    """A bearer token for the JSON API. Only its SHA-256 digest is stored; the token is shown once.

    Its `callback_secret` signs the decisions POSTed to the callbacks of the requests its user asks for
    (external.callbacks.CallbackBackend), so that an agent verifies them with a secret no other agent has. It is
    stored as it is, not hashed: the console needs the key itself to compute each HMAC (a hash could only
    verify one). It is shown once, when the token is issued or the secret rotated, and never in admin."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    digest = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=8, help_text="The token's first characters, to tell tokens apart.")
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    tenants = models.JSONField(
        default=_default_tenants, help_text="The tenants (a list) this token may start runs for; '*' means any."
    )
    callback_secret = models.CharField(
        max_length=100,
        default=new_callback_secret,
        editable=False,
        help_text="Signs the callbacks of its user's approval requests (Standard Webhooks); shown once.",
    )

    class Meta:
        db_table = "console_apitoken"

    ANY_TENANT = "*"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"

    def allows_tenant(self, tenant: str) -> bool:
        return self.ANY_TENANT in self.tenants or tenant in self.tenants

    @classmethod
    def issue(cls, user, *, by=None, tenants: list[str] | None = None) -> tuple[ApiToken, str]:
        """A new token for `user` and its secret (shown once, never stored), audited as issued `by` a person
        or a component (default: system). It may start runs for `tenants` only (default: `default`)."""
        raw = "hitl_" + secrets.token_urlsafe(32)
        with transaction.atomic():
            token = cls.objects.create(
                user=user, digest=_digest(raw), prefix=raw[5:13], tenants=tenants or _default_tenants()
            )
            token.record_audit("api_token.create", by)
        return token, raw

    def rotate_callback_secret(self, by) -> str:
        """A new callback signing secret in place of the old one (which signs nothing from now on), audited;
        the new one is returned to be shown once."""
        with transaction.atomic():
            self.callback_secret = new_callback_secret()
            ApiToken.objects.filter(pk=self.pk).update(callback_secret=self.callback_secret)
            self.record_audit("api_token.rotate_callback_secret", by)
        return self.callback_secret

    @classmethod
    def callback_secrets(cls, user_id, token_id=None) -> list[str]:
        """The secrets a callback of `user_id`'s request is signed with: the asking token's (`token_id`), while it
        is live; for a request that did not record its token, one per live token of that user, oldest first."""
        live = cls.objects.filter(user_id=user_id, revoked_at__isnull=True)
        if token_id is not None:
            live = live.filter(pk=token_id)
        return list(live.order_by("created_at", "pk").values_list("callback_secret", flat=True))

    def revoke(self, by) -> bool:
        """Refuse this token from now on, audited. Idempotent: False (and no entry) when it already was."""
        with transaction.atomic():
            now = timezone.now()
            if not ApiToken.objects.filter(pk=self.pk, revoked_at__isnull=True).update(revoked_at=now):
                self.refresh_from_db(fields=["revoked_at"])
                return False
            self.revoked_at = now
            self.record_audit("api_token.revoke", by)
        return True

    def record_audit(self, action: str, by) -> None:
        # The prefix tells tokens apart (it is shown in admin); the token and its digest never reach the log.
        name = self.user.get_username()
        AuditEntry.record(
            action, actor=by, target=f"user:{name}", data={"user": name, "token_id": self.pk, "prefix": self.prefix}
        )

    @classmethod
    def authenticate(cls, raw: str):
        """The active user that `raw` belongs to, or None."""
        token = cls.find(raw)
        return token.user if token is not None else None

    @classmethod
    def _active(cls, digest: str):
        return cls.objects.select_related("user").filter(digest=digest, revoked_at__isnull=True, user__is_active=True)

    @classmethod
    def find(cls, raw: str) -> ApiToken | None:
        """The active token `raw` is (its user active too), or None; notes its use."""
        token = _find_active_token(_digest(raw))
        if token is None:
            return None
        now = timezone.now()
        if token.last_used_at is None or token.last_used_at < now - timedelta(minutes=1):
            cls.objects.filter(pk=token.pk).update(last_used_at=now)
        return token


class _TokenQuery(NamedTuple):
    sql: str
    token_fields: list[str]
    user_fields: list[str]


_TOKEN_QUERIES: dict[str, _TokenQuery] = {}
_DIGEST_PLACEHOLDER = "0" * 64


def _token_query() -> _TokenQuery:
    """The SQL Django writes for `ApiToken._active(digest)[:1]`, compiled once per process and database: every API
    request looks its token up, and compiling the queryset cost more CPU than running it (issue 11). Checked
    when built: one parameter (the digest) and the token's then its user's columns, in model order."""
    query = _TOKEN_QUERIES.get(connection.alias)
    if query is None:
        compiler = ApiToken._active(_DIGEST_PLACEHOLDER)[:1].query.get_compiler(connection=connection)
        sql, params = compiler.as_sql()
        token_fields = [f.attname for f in ApiToken._meta.concrete_fields]
        user_fields = [f.attname for f in ApiToken._meta.get_field("user").related_model._meta.concrete_fields]
        columns = [col.target for col, _, _ in compiler.select]
        # The only conversions the ORM would apply are the fields' own from_db_value (what _converted applies).
        converters = compiler.get_converters([col for col, _, _ in compiler.select])
        expected = {i: [f.from_db_value] for i, f in enumerate(columns) if hasattr(f, "from_db_value")}
        if (
            list(params) != [_DIGEST_PLACEHOLDER]
            or [f.attname for f in columns] != token_fields + user_fields
            or {i: funcs for i, (funcs, _) in converters.items()} != expected
        ):
            raise ImproperlyConfigured(f"unexpected token query: {sql} {params}")
        query = _TOKEN_QUERIES.setdefault(connection.alias, _TokenQuery(sql, token_fields, user_fields))
    return query


def _find_active_token(digest: str) -> ApiToken | None:
    """`ApiToken._active(digest).first()` without compiling the queryset each time (see _token_query)."""
    query = _token_query()
    with connection.cursor() as cursor:
        cursor.execute(query.sql, [digest])
        row = cursor.fetchone()
    if row is None:
        return None
    split = len(query.token_fields)
    token = ApiToken.from_db(connection.alias, query.token_fields, _converted(ApiToken, row[:split]))
    user_model = ApiToken._meta.get_field("user").related_model
    token.user = user_model.from_db(connection.alias, query.user_fields, _converted(user_model, row[split:]))
    return token


def _converted(model, values) -> list:
    """Database values as the ORM would hand them to from_db (from_db_value: the tenants' JSON)."""
    out = list(values)
    for index, field in enumerate(model._meta.concrete_fields):
        if hasattr(field, "from_db_value"):
            out[index] = field.from_db_value(out[index], None, connection)
    return out


class ActorType(models.TextChoices):
    HUMAN = "human"
    AGENT = "agent"
    SYSTEM = "system"


# One lock for every append: an entry's prev_hash is the hash of the entry committed just before it.
_AUDIT_CHAIN_LOCK = 0x41554454  # "AUDT"

logger = logging.getLogger(__name__)


class HashScheme(models.TextChoices):
    """How an entry's `hash` was made. SHA-256 can be recomputed by anyone who can write to the database;
    an HMAC needs AUDIT_HMAC_KEY, which is kept out of it."""

    SHA256 = "sha256", "SHA-256"
    HMAC_SHA256 = "hmac-sha256", "HMAC-SHA256"


def audit_hmac_key() -> bytes | None:
    """AUDIT_HMAC_KEY, or None when it is not set."""
    key = getattr(settings, "AUDIT_HMAC_KEY", "")
    return key.encode() if key else None


def audit_key_id(key: bytes) -> str:
    """A name for a key, stored with each entry it signs: which key signed an entry, without revealing it. (It
    tells an attacker nothing the entries' HMACs do not: both are HMACs under the key.)"""
    return audit_verifier.key_id(key)


class AuditEntry(models.Model):
    """Append-only and tamper-evident: each entry's `hash` covers its content and the previous entry's hash
    (an HMAC when AUDIT_HMAC_KEY is set), and database triggers (migrations console.0004 and 0009) refuse
    UPDATE, DELETE and TRUNCATE. `manage.py audit_verify` recomputes the chain and prints its head."""

    ActorType = ActorType
    HashScheme = HashScheme

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
    # Entries written before these columns existed are plain SHA-256 (the database default).
    hash_scheme = models.CharField(
        max_length=16, choices=HashScheme.choices, default=HashScheme.SHA256, db_default=HashScheme.SHA256
    )
    hmac_key_id = models.CharField(
        max_length=16, blank=True, default="", db_default="", help_text="audit_key_id() of the key that signed it."
    )

    class Meta:
        db_table = "console_auditentry"
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
            models.CheckConstraint(
                condition=models.Q(hash_scheme=HashScheme.SHA256, hmac_key_id="")
                | (models.Q(hash_scheme=HashScheme.HMAC_SHA256) & ~models.Q(hmac_key_id="")),
                name="console_auditentry_hash_scheme_valid",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"

    GENESIS = "0" * 64
    # Every column, in the order the admin page and the CSV export show them.
    COLUMNS = ("id", *audit_verifier.CONTENT_FIELDS, "hash", *audit_verifier.SIGNING_FIELDS)

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
        key = audit_hmac_key()
        entry = cls(
            actor_type=kind,
            actor=name,
            action=action,
            target=target,
            run_id=run_id,
            approval_id=approval_id,
            channel=channel,
            trace_id=trace_id,
            hash_scheme=HashScheme.HMAC_SHA256 if key else HashScheme.SHA256,
            hmac_key_id=audit_key_id(key) if key else "",
        )
        with connection.cursor() as cursor:
            # Stamped by the database once the chain is ours: `at` grows with `id` (and the chain) whatever the
            # clocks of the web and worker machines say.
            #
            # And `data` is hashed as PostgreSQL will give it back, or audit_verify would cry wolf over entries
            # nobody touched: jsonb keeps numbers as `numeric` and prints them its own way, so Python's 1e+16
            # comes back as the integer 10000000000000000, -0.0 as 0.0, 1e-07 as 0.0000001. The entry keeps
            # what PostgreSQL makes of the data (`::jsonb::text`, parsed as JSONField parses every read), and
            # that value is a fixed point: stored again, it reads back the same, so the canonical JSON hashed
            # here is the one audit_verify recomputes (tests/integration/core/test_audit_hash.py checks edge cases
            # and random doubles). Cheaper and simpler than a second text column, and the data stays queryable jsonb.
            cursor.execute(
                "SELECT pg_advisory_xact_lock(%s), clock_timestamp(), %s::jsonb::text",
                [_AUDIT_CHAIN_LOCK, json.dumps(data or {}, cls=DjangoJSONEncoder)],
            )
            _, entry.at, stored_data = cursor.fetchone()
        entry.data = json.loads(stored_data)
        last = cls.objects.order_by("-id").values_list("hash", "hash_scheme").first()
        if last is not None and last[1] == HashScheme.HMAC_SHA256 and key is None:
            logger.error(
                "AUDIT_HMAC_KEY is not set, but the audit log is signed with a key: entry %r is written"
                " unsigned, and audit_verify will report it",
                action,
            )
        entry.prev_hash = last[0] if last is not None else cls.GENESIS
        entry.hash = entry.compute_hash(key)
        entry.save(force_insert=True)
        return entry

    def hashed_fields(self) -> dict:
        """The entry's fields as its hash sees them (JSON values; an audit export writes exactly these): every
        column but `id` and `hash`. Which of them the hash covers is core.audit_verifier's `covered`."""
        return {
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
            "hash_scheme": self.hash_scheme,
            "hmac_key_id": self.hmac_key_id,
        }

    def canonical(self) -> str:
        """The text an entry's hash covers: every column but `id` and `hash` (and, on a plain entry, the two that
        say how it was signed), as sorted, compact JSON. Made by core.audit_verifier, the module an audit export
        ships as its verifier: the offline check recomputes exactly this."""
        return audit_verifier.canonical(audit_verifier.covered(self.hashed_fields()))

    def compute_hash(self, key: bytes | None = None) -> str:
        """The entry's hash by its scheme; a signed entry needs the key (default: AUDIT_HMAC_KEY)."""
        try:
            return audit_verifier.entry_hash(self.hashed_fields(), key or audit_hmac_key())
        except audit_verifier.MissingKey:
            raise ImproperlyConfigured("this audit entry is signed: AUDIT_HMAC_KEY is needed to check it") from None

    @classmethod
    def verify_chain(cls, *, until: int | None = None, chunk_size: int = 5000):
        """Yield (entry, problem) for every entry, up to the entry with id `until`, that breaks the chain;
        nothing when it is whole. Signed entries are checked with AUDIT_HMAC_KEY. The checks are those of an
        audit export's offline verifier (core.audit_verifier.Chain)."""
        chain = audit_verifier.Chain(audit_hmac_key())
        entries = cls.objects.order_by("id")
        if until is not None:
            entries = entries.filter(id__lte=until)
        for entry in entries.iterator(chunk_size=chunk_size):
            problem = chain.check(entry.hashed_fields(), entry.hash, entry.pk)
            if problem is not None:
                yield entry, problem


# --- personal data by reference (core/pii.py, docs/personal-data.md) -----------------------------------------------


class PiiSubject(models.Model):
    """A data subject (a customer, named by the field a schema's `x-pii-subject` names) and their own data key,
    wrapped (AES-GCM) by the PII_KEYS key `key_id`. Erasure deletes the wrapped key: every value sealed under it is
    unreadable at once, wherever its reference was copied (crypto-shredding)."""

    subject = models.CharField(max_length=200, unique=True)
    key_id = models.CharField(max_length=16, blank=True)
    wrapped_key = models.BinaryField(null=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    erased_at = models.DateTimeField(null=True, blank=True)
    erased_by = models.CharField(max_length=150, blank=True)

    class Meta:
        constraints = [
            # A subject has a key, or was erased and has none: never both, never neither.
            models.CheckConstraint(
                condition=models.Q(wrapped_key__isnull=True, erased_at__isnull=False)
                | models.Q(wrapped_key__isnull=False, erased_at__isnull=True),
                name="core_piisubject_key_xor_erased",
            ),
        ]

    def __str__(self) -> str:
        return self.subject


class PiiValue(models.Model):
    """One personal value, sealed (nonce + AES-GCM ciphertext, bound to its id and subject) under its subject's
    key. Everything else holds its reference, `pii:<id hex>`."""

    id = models.UUIDField(primary_key=True, editable=False)
    subject = models.ForeignKey(PiiSubject, on_delete=models.PROTECT, related_name="values")
    field = models.CharField(max_length=200, help_text="Where the value came from: `input.email`, a read's field.")
    run_id = models.UUIDField(null=True, blank=True, db_index=True)
    sealed = models.BinaryField(editable=False)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"pii:{self.id.hex}"
