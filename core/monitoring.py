"""What monitoring (console.monitoring, on top) reads from the base app, the helpers each app's own monitoring
queries share, and where an app registers a figure that only it can count (the demo: the duplicate side effects
its fake external systems received), so that monitoring never has to look for the app.

Every figure is a query: the web server and the workers are different processes, so nothing is a process-local
counter."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from django.db import connection
from django.db.models import Count, QuerySet
from django.db.models.functions import TruncMinute

from core.models import Channel, GlobalKillSwitch


def rows(sql: str, params) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def per_minute(queryset: QuerySet, field: str, start: datetime, minutes: int) -> list[int]:
    """Rows of `queryset` per minute of `field`, for the `minutes` minutes from `start` (a whole minute)."""
    counts = dict(
        queryset.filter(**{f"{field}__gte": start})
        .annotate(minute=TruncMinute(field))
        .values_list("minute")
        .annotate(n=Count("id"))
    )
    return [counts.get(start + timedelta(minutes=i), 0) for i in range(minutes)]


def kill_switches() -> dict[str, bool]:
    """Each channel's name and whether its kill switch is engaged."""
    return dict(Channel.objects.values_list("name", "kill_switch_engaged"))


def global_kill_switch_engaged() -> bool:
    return GlobalKillSwitch.objects.filter(kill_switch_engaged=True).exists()


# Counters of duplicate side effects as the external systems received them, by who registered them: only the
# systems themselves (or a fake of them) can tell, so without one registered the figure is 0.
_received_duplicates: dict[str, Callable[[], int]] = {}


def count_received_duplicates(name: str, counter: Callable[[], int]) -> None:
    """Register `counter` (called on each snapshot) under `name`, from an app's AppConfig.ready(); registering a
    name again replaces its counter."""
    _received_duplicates[name] = counter


def received_duplicates() -> int:
    """Calls beyond the first per idempotency key that the registered external systems received."""
    return sum(counter() for counter in _received_duplicates.values())
