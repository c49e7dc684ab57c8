"""The token rate limit: model tokens (in + out) per tenant per minute (TOKEN_RATE_LIMIT_PER_MINUTE, 0: off).

Before a compute step (runs.engine), `wait_for_tokens(run)` sums the tokens of the tenant's model calls of the
last 60 s (ModelUsage rows, written as each call answers, whatever then happens to its step: nothing is counted
twice, nothing needs resetting). At or over the limit the step
raises `Throttled`, a `Wait`: the run goes back to the queue until enough of those tokens have left the window
for the tenant to be under the limit again. Never dropped, and not an attempt.

The limit is checked before a step, not reserved: a call's tokens are only known once it has answered. So a tenant
whose steps run side by side may go over it by what those steps use; its next steps then wait longer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

import structlog
from django.conf import settings
from django.db import connection
from django.db.models import F
from django.utils import timezone

from runs.errors import Wait
from runs.models import ModelUsage, Run, TenantThrottle
from runs.sql import queries

log = structlog.get_logger("runs.ratelimit")

WINDOW = timedelta(seconds=60)
MIN_DELAY = 0.5  # seconds
JITTER = 1.0  # seconds, at most: the tenant's waiting runs do not all come back at the same instant


class Throttled(Wait):
    """The tenant has used its tokens of the last minute: the step waits `delay` seconds."""

    def __init__(self, tenant: str, used: int, limit: int, delay: float):
        super().__init__(f"tenant {tenant} used {used} tokens in the last minute (limit {limit})", delay)
        self.tenant, self.used, self.limit = tenant, used, limit


def _recent(tenant: str, now: datetime):
    """The tenant's model calls in the window, oldest first (runs_modelusage_tenant_at): every attempt's, also
    those of steps that failed or were lost before their checkpoint."""
    return (
        ModelUsage.objects.filter(tenant=tenant, at__gt=now - WINDOW, at__lte=now)
        .annotate(tokens=F("tokens_in") + F("tokens_out"))
        .order_by("at")
        .values_list("at", "tokens")
    )


def tokens_used(tenant: str, now: datetime | None = None) -> int:
    return sum(tokens for _, tokens in _recent(tenant, now or timezone.now()))


def wait_for_tokens(run: Run) -> None:
    """Raise Throttled when the run's tenant has reached its token rate; nothing when it has room (or no limit)."""
    limit = settings.TOKEN_RATE_LIMIT_PER_MINUTE
    if limit <= 0:
        return
    now = timezone.now()
    recent = list(_recent(run.tenant, now))
    used = sum(tokens for _, tokens in recent)
    if used < limit:
        return
    # The window has room again once enough of its oldest calls have aged out of it.
    left, room_at = used, now + WINDOW
    for at, tokens in recent:
        left -= tokens
        if left < limit:
            room_at = at + WINDOW
            break
    delay = max(MIN_DELAY, (room_at - now).total_seconds()) + random.uniform(0, JITTER)
    _note(run.tenant, now, now + timedelta(seconds=delay), used, limit)
    raise Throttled(run.tenant, used, limit, delay)


def _note(tenant: str, now: datetime, until: datetime, used: int, limit: int) -> None:
    """Who is throttled, for the dashboard: one row per tenant, upserted in one statement."""
    with connection.cursor() as cursor:
        cursor.execute(queries["note_throttled"], [tenant, until, used, limit, now])


@dataclass
class ThrottledTenant:
    tenant: str
    used: int  # tokens in the last minute, now
    limit: int
    waiting_until: datetime
    waits: int


def throttled(now: datetime | None = None) -> list[ThrottledTenant]:
    """Tenants with a step waiting for the token rate limit now, and their usage of the last minute."""
    now = now or timezone.now()
    return [
        ThrottledTenant(row.tenant, tokens_used(row.tenant, now), row.limit, row.waiting_until, row.waits)
        for row in TenantThrottle.objects.filter(waiting_until__gt=now).order_by("tenant")
    ]
