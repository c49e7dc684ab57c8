from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import Group
from django.db import connection, models
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
    def killed_for_effects(cls, name: str) -> str | None:
        """Inside the transaction that writes an effect's receipt: the kill switch reason if `name` is
        stopped, else None. FOR SHARE makes engaging the switch (an UPDATE of this row) wait until effects
        already past this point have committed, and every effect after it see the switch."""
        assert connection.in_atomic_block
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT kill_switch_engaged, kill_switch_reason FROM console_channel WHERE name = %s FOR SHARE",
                [name],
            )
            row = cursor.fetchone()
        if row is not None and row[0]:
            return row[1] or "no reason given"
        return None


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
