"""The core app's configuration (CoreConfig says what the app holds)."""

from django.apps import AppConfig


class CoreConfig(AppConfig):
    """The ground floor: channels and their kill switches, the audit log, API tokens and roles, and the small
    modules every app shares (safe_input, webhook_signing, and `api`: what every API router declares). It imports
    no other app of ours."""

    name = "core"
    verbose_name = "Channels, audit log and API tokens"

    def ready(self) -> None:
        # Traces, once per process (the web server, each worker, a management command): on only when the
        # environment asks for them (OTEL_*: core.tracing).
        from core import tracing

        tracing.setup()
