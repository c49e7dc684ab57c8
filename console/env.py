"""Reading settings from the environment: small typed helpers that fail with a clear message."""

from __future__ import annotations

import os
from decimal import Decimal, InvalidOperation
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

from core import webhook_signing

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from None


def env_decimal(name: str, default: str) -> Decimal:
    raw = os.environ.get(name)
    value = default if raw is None or raw.strip() == "" else raw
    try:
        number = Decimal(value)
    except InvalidOperation:
        raise ImproperlyConfigured(f"{name} must be a decimal number, got {raw!r}") from None
    if not number.is_finite():
        raise ImproperlyConfigured(f"{name} must be a finite decimal number, got {raw!r}")
    return number


def env_list(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def webhook_secrets(name: str, value: str) -> list[str]:
    """The comma-separated Standard Webhooks secrets of `value` (read from `name`), each `whsec_<base64>` or a plain
    string: refused at start rather than at the first delivery when one is not a usable key."""
    secrets = webhook_signing.secret_list(value)
    if not secrets:
        raise ImproperlyConfigured(f"{name} holds no secret")
    for secret in secrets:
        try:
            webhook_signing.key(secret)
        except ValueError as exc:
            raise ImproperlyConfigured(f"{name}: {exc}") from None
    return secrets


def env_secret(name: str, *, development_default: str, development: bool) -> str:
    """A secret that has a throwaway default in development and is required everywhere else."""
    value = os.environ.get(name, "")
    if value:
        return value
    if development:
        return development_default
    raise ImproperlyConfigured(f"{name} must be set when CONSOLE_ENV is not 'development'")


def database_from_url(url: str, name: str = "DATABASE_URL") -> dict:
    """Django's DATABASES entry for a `postgres://user:password@host:port/name?option=value` URL (read from the
    variable `name`, which error messages name).

    A unix socket goes in the host (`postgresql://postgres@/db?host=/run/postgresql`).
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} is not a valid URL ({exc}): {_redact(url)}") from None
    if parts.scheme not in ("postgres", "postgresql"):
        raise ImproperlyConfigured(f"{name} must start with postgres:// or postgresql://, got {_redact(url)}")
    database = unquote(parts.path.lstrip("/"))
    if not database:
        raise ImproperlyConfigured(f"{name} names no database: {_redact(url)}")
    options = dict(parse_qsl(parts.query))
    host = options.pop("host", None) or unquote(parts.hostname or "")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": database,
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": str(port or ""),
        "OPTIONS": options,
    }


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@")
    return url
