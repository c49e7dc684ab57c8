from django.apps import AppConfig


class ExternalConfig(AppConfig):
    name = "external"
    verbose_name = "external agents"

    def ready(self):
        # Wiring at start-up (the lower apps know nothing of this one): its cards' gates, and what a decision on
        # one of them does.
        from approvals import edits
        from approvals.models import card_closed
        from external import asks, status
        from runs.models import EXTERNAL_WORKFLOW

        edits.register_resolver(EXTERNAL_WORKFLOW, asks.gate_of)
        card_closed.connect(status.card_closed, dispatch_uid="external.card_closed")
