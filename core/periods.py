"""A period as commands and APIs take one: `since` an age back from now (30d, 12h, 2w, 90m) or an ISO date or
datetime, `until` the same or now. Used by `manage.py evaluate` and `manage.py replay` (evals, runs.replay)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime


class PeriodInvalid(ValueError):
    """A period that does not read, or ends before it starts."""


_UNITS = {"m": timedelta(minutes=1), "h": timedelta(hours=1), "d": timedelta(days=1), "w": timedelta(weeks=1)}


def parse_when(text: str, now: datetime | None = None, name: str = "since") -> datetime:
    """A point in time as the command and the API take it: an age ("30d", "12h", "2w", "90m": that long before
    `now`), an ISO date (midnight UTC) or an ISO datetime (UTC when it names no offset)."""
    now = now or timezone.now()
    text = (text or "").strip()
    if len(text) > 1 and text[-1] in _UNITS and text[:-1].isdigit():
        count = int(text[:-1])
        if count > 100 * 365:
            raise PeriodInvalid(f"{name}: {text!r} is too far back")
        return now - count * _UNITS[text[-1]]
    try:
        moment = parse_datetime(text)
        if moment is None and (day := parse_date(text)) is not None:
            moment = datetime(day.year, day.month, day.day)
    except ValueError:
        moment = None
    if moment is None:
        raise PeriodInvalid(f"{name}: {text!r} is neither an age (30d, 12h, 2w, 90m) nor an ISO date or datetime")
    if timezone.is_naive(moment):
        moment = timezone.make_aware(moment, UTC)
    return moment


def period(since: str, until: str | None, now: datetime | None = None) -> tuple[datetime, datetime]:
    """The period [since, until); until defaults to now. PeriodInvalid when it is empty."""
    now = now or timezone.now()
    start = parse_when(since, now, "since")
    end = parse_when(until, now, "until") if until else now
    if end <= start:
        raise PeriodInvalid(f"until ({end.isoformat()}) must be after since ({start.isoformat()})")
    return start, end
