"""Decisions from Slack: who a Slack account is here, where a channel's cards are posted, and the messages
posted (so that each can be updated with the card's outcome)."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from approvals.models import Approval, Notification
from core.models import Channel


class SlackIdentity(models.Model):
    """A Slack account (its workspace's team id and its user id, as Slack's signed payloads name them) linked to
    one of our users by an admin. A click from Slack decides as this user, through the console's own rules;
    an account that is not linked decides nothing. Never matched by display name or email: those can be
    changed by the Slack user."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="slack_identities")
    team_id = models.CharField(max_length=32, help_text="The Slack workspace's id (T…, or E… on Enterprise Grid).")
    slack_user_id = models.CharField(max_length=32, help_text="The Slack member id (U… or W…), not a display name.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "Slack identity"
        verbose_name_plural = "Slack identities"
        constraints = [
            models.UniqueConstraint(fields=["team_id", "slack_user_id"], name="slackapp_slackidentity_one_account"),
        ]

    def __str__(self) -> str:
        return f"{self.team_id}/{self.slack_user_id} is {self.user}"

    @classmethod
    def user_for(cls, team_id: str, slack_user_id: str):
        """Our active user linked to that Slack account, or None."""
        identity = (
            cls.objects.select_related("user")
            .filter(team_id=team_id, slack_user_id=slack_user_id, user__is_active=True)
            .first()
        )
        return identity.user if identity is not None else None


class SlackRoute(models.Model):
    """Where a console channel's new cards are posted in Slack (else SLACK_DEFAULT_CHANNEL, if set)."""

    channel = models.OneToOneField(Channel, on_delete=models.CASCADE, related_name="slack_route")
    slack_channel = models.CharField(
        max_length=80,
        help_text="A Slack channel id (C…; the app must be a member), or a member id (U…) for a direct message.",
    )

    def __str__(self) -> str:
        return f"{self.channel} -> {self.slack_channel}"


class SlackMessage(models.Model):
    """A card as posted to Slack (by its `card.opened` notification): where it is, so that it can be updated."""

    approval = models.ForeignKey(Approval, on_delete=models.CASCADE, related_name="slack_messages")
    notification = models.OneToOneField(Notification, on_delete=models.CASCADE, related_name="slack_message")
    slack_channel = models.CharField(max_length=80)  # as Slack answered (a direct message's conversation id)
    ts = models.CharField(max_length=32)  # the message's timestamp: its id within the channel
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["slack_channel", "ts"], name="slackapp_slackmessage_one_row"),
        ]

    def __str__(self) -> str:
        return f"card {self.approval_id} in {self.slack_channel} at {self.ts}"
