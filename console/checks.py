"""The console's system checks (Django's check framework: `manage.py check`, and the start of every management
command, `serve` and `worker` among them), registered by ConsoleConfig.ready()."""

from __future__ import annotations

from django.conf import settings
from django.core import checks

from console.mail_config import FILE_BACKEND, file_path_problem
from core import pii
from runs import workflow as workflows


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


@checks.register(checks.Tags.security)
def check_pii_keys(app_configs, **kwargs) -> list[checks.CheckMessage]:
    """Outside development, a deployment whose workflows mark personal data needs PII_KEYS (docs/personal-data.md):
    without it every run that seals or opens a value would fail. A malformed key is an error wherever it is set."""
    marking = [
        f"{w.name} v{w.version}: {', '.join(found)}" for w in workflows.every_version() if (found := w.personal_data())
    ]
    configured = bool((getattr(settings, "PII_KEYS", "") or "").strip())
    if not configured and (settings.DEVELOPMENT or not marking):
        return []
    try:
        pii.keys()
    except pii.KeysMissing as exc:
        return [
            checks.Error(
                str(exc) + (f". Workflows that mark personal data: {'; '.join(marking)}" if marking else ""),
                hint="Set PII_KEYS (docs/personal-data.md: keys and rotation).",
                id="console.E002",
            )
        ]
    return []
