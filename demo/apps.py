from django.apps import AppConfig


class DemoConfig(AppConfig):
    """The demo: the `refund` workflow, the fake external systems it pays and emails through (deliberately not
    idempotent, so a duplicate side effect shows), and the scripted model. Installed in development and for the
    tests (settings.DEMO_ENABLED); nothing outside this app names refunds."""

    name = "demo"
    verbose_name = "Demo workflow and fake external systems"
