"""The Slack app's configuration: at start-up it registers Slack as a notification backend (approvals.notify), and
posts a new card to Slack or updates its messages when the card is saved or closed (slackapp.posting)."""

from django.apps import AppConfig


class SlackAppConfig(AppConfig):
    """Decisions from Slack: cards posted as Block Kit messages, clicks verified and decided through the console's
    own rules (slackapp.posting, slackapp.interactions)."""

    name = "slackapp"
    verbose_name = "Slack"

    def ready(self):
        from django.db.models.signals import post_save

        from approvals import notify
        from approvals.models import Approval, card_closed
        from slackapp import posting

        # Registered by this app, as the demo registers its counts: approvals does not know Slack.
        notify.BACKENDS[posting.SlackBackend.name] = posting.SlackBackend()
        post_save.connect(posting.card_saved, sender=Approval, dispatch_uid="slackapp.card_saved")
        card_closed.connect(posting.card_closed, dispatch_uid="slackapp.card_closed")
