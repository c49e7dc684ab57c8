"""The approvals app's start-up: its cards fill the engine's gate port (runs.gates), and a decision that finds a
card past its deadline has the card's expiry applied (approvals.sla, on approvals.models.card_overdue)."""

from django.apps import AppConfig

from runs import gates


class ApprovalsConfig(AppConfig):
    name = "approvals"

    def ready(self):
        # Here, not at the top: Django reads apps.py before it loads the models (CardBackend's module imports them).
        from approvals import sla
        from approvals.gates import CardBackend
        from approvals.models import card_overdue

        gates.register(CardBackend())
        card_overdue.connect(sla.on_overdue)
