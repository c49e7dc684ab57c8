"""The console app's configuration: at start-up it registers the console's system checks (console.checks)."""

from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    """The top floor: the Django project (settings, urls, the web server) and the pages that cross apps
    (dashboard, channels, audit log). Its models moved down to `core` (migration console.0012)."""

    name = "console"

    def ready(self) -> None:
        from console import checks  # noqa: F401 - registers the console's system checks
