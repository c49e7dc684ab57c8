"""The console's system checks (Django's check framework: `manage.py check`, and the start of every management
command, `serve` and `worker` among them), registered by ConsoleConfig.ready()."""

from __future__ import annotations

from django.conf import settings
from django.core import checks

from console.mail_config import FILE_BACKEND, file_path_problem


@checks.register(checks.Tags.mail)
def check_file_mailer(app_configs, **kwargs) -> list[checks.CheckMessage]:
    errors = []
    for alias, mailer in (getattr(settings, "MAILERS", None) or {}).items():
        if mailer.get("BACKEND") != FILE_BACKEND:
            continue
        if problem := file_path_problem((mailer.get("OPTIONS") or {}).get("file_path")):
            errors.append(
                checks.Error(
                    f"The file email backend (MAILERS[{alias!r}]) would fail every send: {problem}.",
                    hint="Set EMAIL_FILE_PATH to a directory this process may write to, or choose another "
                    "EMAIL_BACKEND.",
                    id="console.E001",
                )
            )
    return errors
