"""An external agent's approval requests (docs/external-agents.md): one action that a person signs off, executed at
most once by the agent with the arguments the person approved.

A request lives on an external run (`Run.Status.EXTERNAL`, workflow `external`: the agent's session, whose page
reads as one timeline; the engine never drives it) as one step: its card (an `Approval`, in the inbox like any
other, with the two-person rule, the SLA and shadow mode) and, once the agent consumes the approval, its receipt
(a `Receipt`: written once, pending until the agent reports the outcome). The logic is in `external.asks`,
`external.status` and `external.executions`.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q


class ApprovalMode(models.TextChoices):
    REQUIRED = "required"  # a person signs it off on a card
    NEVER = "never"  # no card: approved by the channel's permission `act_unreviewed`, executed once all the same


class ActionRequest(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    # The API token that asked: its callback secret (core.models.ApiToken.callback_secret) signs the request's
    # callback, so no other token, of this user's or another's, holds a key that verifies it.
    api_token = models.ForeignKey("core.ApiToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    idempotency_key = models.CharField(max_length=200)
    request_hash = models.CharField(max_length=64, help_text="What was asked: the same key must ask the same.")
    run = models.ForeignKey("runs.Run", on_delete=models.PROTECT, related_name="action_requests")
    step_seq = models.PositiveIntegerField()
    channel = models.ForeignKey("core.Channel", on_delete=models.PROTECT, related_name="+")
    action = models.CharField(max_length=100)
    arguments = models.JSONField(encoder=DjangoJSONEncoder, help_text="What the agent asked to run.")
    schema = models.JSONField(null=True, blank=True, help_text="JSON Schema of the arguments: edits must fit it.")
    display = models.JSONField(null=True, blank=True, help_text="Dotted paths: headline, amount_minor, currency.")
    approval = models.CharField(max_length=8, choices=ApprovalMode.choices, default=ApprovalMode.REQUIRED)
    card = models.OneToOneField(
        "approvals.Approval", null=True, blank=True, on_delete=models.PROTECT, related_name="action_request"
    )
    receipt = models.OneToOneField(
        "runs.Receipt",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="action_request",
        help_text="Written when the agent consumes the approval: its one execution.",
    )
    consume_nonce = models.CharField(
        max_length=100, blank=True, help_text="The consumer's name for its consume: it may ask again, and only it."
    )
    callback_url = models.URLField(max_length=2000, blank=True)
    # Undo (external.undo): what undoes this action, as the agent's successful result declared it ({action,
    # arguments}); and, on a request that is itself a compensation, the execution it undoes and its place in the
    # undo (0 first: the reverse of the order the executions completed in).
    compensation = models.JSONField(
        null=True, blank=True, encoder=DjangoJSONEncoder, help_text="What undoes it: {action, arguments}."
    )
    compensates = models.OneToOneField(
        "self",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="compensated_by",
        help_text="The executed request this one undoes: one compensation per execution.",
    )
    undo_order = models.PositiveIntegerField(null=True, blank=True, help_text="Its place in the undo (0 first).")
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["created_by", "idempotency_key"], name="external_request_key_per_user"),
            models.UniqueConstraint(fields=["run", "step_seq"], name="external_request_one_per_step"),
            models.CheckConstraint(
                condition=Q(approval="never", card__isnull=True) | Q(approval="required", card__isnull=False),
                name="external_request_card_iff_required",
            ),
            models.CheckConstraint(
                condition=Q(compensates__isnull=True, undo_order__isnull=True)
                | Q(compensates__isnull=False, undo_order__isnull=False, compensation__isnull=True),
                name="external_request_undo_order_iff_compensates",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.action} on {self.channel_id} ({self.id})"
