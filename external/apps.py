"""The external app (external/__init__.py says which module does what), wired at start-up into the apps below it,
which know nothing of this one: its cards' gates (approvals.edits), what a decision on one of them does
(approvals.models.card_closed), the backend that sends a decision to an agent's callback (approvals.notify), and
the undo of an external run (runs.compensations: its registry, its cancel and undo; external.undo)."""

from django.apps import AppConfig


class ExternalConfig(AppConfig):
    name = "external"
    verbose_name = "external agents"

    def ready(self):
        from approvals import edits, notify
        from approvals.models import card_closed
        from external import asks, callbacks, status, undo
        from runs import compensations
        from runs.models import EXTERNAL_WORKFLOW

        edits.register_resolver(EXTERNAL_WORKFLOW, asks.gate_of)
        card_closed.connect(status.card_closed, dispatch_uid="external.card_closed")
        # After the step's end (above): a "reject and undo" begins the undo; a declined compensation may end it.
        card_closed.connect(undo.card_closed, dispatch_uid="external.undo.card_closed")
        compensations.register_external(undo.ExternalUndo())
        # Registered by this app, as slackapp registers Slack's: approvals does not know external agents' callbacks.
        notify.BACKENDS[callbacks.CallbackBackend.name] = callbacks.CallbackBackend()
