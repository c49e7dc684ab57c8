"""The demo app's configuration: at start-up it registers the count of duplicate side effects its fake systems
received (core.monitoring), which the dashboard and /metrics show."""

from django.apps import AppConfig


class DemoConfig(AppConfig):
    """The demo: the `refund` workflow, the fake external systems it pays and emails through (deliberately not
    idempotent, so a duplicate side effect shows), and the scripted model. Installed in development and for the
    tests (settings.DEMO_ENABLED); nothing outside this app names refunds."""

    name = "demo"
    verbose_name = "Demo workflow and fake external systems"

    def ready(self):
        from core import monitoring
        from demo import sandbox

        # The duplicates its fake systems received: the dashboard's "Duplicate outbound" alert and
        # hitl_sandbox_duplicate_side_effects on /metrics (0 where the demo is not installed).
        monitoring.count_received_duplicates("demo sandbox", lambda: sandbox.stats()["duplicates"])
