"""Periodic work is configured as a period in seconds; the cron expression procrastinate wants is built here.

Why not let people write cron: croniter reads a sixth field as *seconds*, so `*/10 * * * * *` is "every second
of minutes :00, :10, ...", not "every 10 s" (a crashed worker's run then waited up to ten minutes). A period
turns into a cron expression only when cron can repeat it evenly: seconds that divide a minute, whole minutes
that divide an hour, whole hours that divide a day. Each expression is then checked with croniter itself, the
way procrastinate's periodic deferrer reads it, before the process starts.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime

import croniter
from django.core.exceptions import ImproperlyConfigured

MINUTE = 60
HOUR = 3600
DAY = 86400


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def allowed_periods() -> list[int]:
    """Every period (seconds) a cron expression repeats evenly, ascending."""
    return sorted({*_divisors(MINUTE)} | {MINUTE * m for m in _divisors(60)} | {HOUR * h for h in _divisors(24)})


def cron_every(seconds: int) -> str:
    """The cron expression (croniter's six-field form when it needs seconds) that runs every `seconds`.

    Raises ValueError for a period cron cannot repeat evenly (say 45 s: :00, :45, then :00 again 15 s later).
    """
    if seconds <= 0:
        raise ValueError(f"a period must be a positive number of seconds, got {seconds}")
    if seconds < MINUTE and MINUTE % seconds == 0:
        return "* * * * * *" if seconds == 1 else f"* * * * * */{seconds}"  # sixth field: seconds
    if seconds < HOUR and seconds % MINUTE == 0 and HOUR % seconds == 0:
        minutes = seconds // MINUTE
        return "* * * * *" if minutes == 1 else f"*/{minutes} * * * *"
    if seconds <= DAY and seconds % HOUR == 0 and DAY % seconds == 0:
        hours = seconds // HOUR
        return {1: "0 * * * *", 24: "0 0 * * *"}.get(hours, f"0 */{hours} * * *")
    below = [p for p in allowed_periods() if p < seconds]
    above = [p for p in allowed_periods() if p > seconds]
    nearest = " or ".join(str(p) for p in (below[-1:] + above[:1]))
    raise ValueError(
        f"cron cannot run something every {seconds} s evenly: use seconds that divide a minute"
        f" (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30), whole minutes that divide an hour (60, 120, 180, ..., 1800)"
        f" or whole hours that divide a day (3600, 7200, ..., 86400); nearest: {nearest}"
    )


def _start_points() -> list[float]:
    # Ticks are compared across the boundaries where a wrong field shows: a minute, an hour, a day and a year
    # turning over, the middle of an hour, and now.
    new_year = datetime(2025, 1, 1, tzinfo=UTC).timestamp()
    return [new_year - 1.5, new_year + 30 * MINUTE + 7.25, new_year + 9 * HOUR + 3 * MINUTE - 0.5, time.time()]


def ticks_to_check(seconds: float) -> int:
    """Enough ticks to cross the next larger unit once (a minute for periods in seconds, and so on), where an
    expression that does not repeat evenly shows it: `* * * * * */7` runs at :49, :56, then :00 of the next
    minute."""
    cycle = next((unit for unit in (MINUTE, HOUR, DAY) if seconds < unit), 7 * DAY)
    return int(cycle // seconds) + 2


def tick_gaps(cron: str, start: float, ticks: int = 4) -> list[float]:
    """Seconds from `start` to croniter's next tick, then between the following ticks (as procrastinate reads
    the expression: `croniter(cron).get_next(ret_type=float, start_time=...)`, in UTC)."""
    iterator = croniter.croniter(cron)
    gaps, previous = [], start
    for _ in range(ticks):
        tick = iterator.get_next(ret_type=float, start_time=previous)
        gaps.append(tick - previous)
        previous = tick
    return gaps


def check_schedule(name: str, cron: str, seconds: float) -> None:
    """Refuse a cron expression whose next ticks are not one period apart, naming the setting."""
    tolerance = max(0.5, 0.01 * seconds)
    try:
        for start in _start_points():
            at = start
            for i, gap in enumerate(tick_gaps(cron, start, ticks_to_check(seconds))):
                at += gap
                if gap > seconds + tolerance or (i and abs(gap - seconds) > tolerance):
                    raise ImproperlyConfigured(
                        f"{name}: the schedule {cron!r} does not run every {seconds:g} s: croniter puts a tick at"
                        f" {datetime.fromtimestamp(at, UTC):%Y-%m-%d %H:%M:%S} UTC, {gap:g} s after"
                        + (" the one before" if i else f" {datetime.fromtimestamp(start, UTC):%H:%M:%S.%f}")
                        + (" (croniter reads a sixth field as seconds)" if len(cron.split()) == 6 else "")
                    )
    except (ValueError, KeyError, croniter.CroniterError) as exc:
        raise ImproperlyConfigured(f"{name}: {cron!r} is not a valid cron expression ({exc})") from None


def periodic_from_env(prefix: str, default_seconds: int) -> tuple[int, str]:
    """Read `<prefix>_SECONDS` (a period in seconds) and return it with its checked cron expression.

    The `<prefix>_CRON` variable of earlier versions is refused rather than ignored, so nobody keeps a schedule
    that silently means something else.
    """
    seconds_name, cron_name = f"{prefix}_SECONDS", f"{prefix}_CRON"
    if os.environ.get(cron_name, "").strip():
        raise ImproperlyConfigured(
            f"{cron_name} is no longer read: set {seconds_name} to the period in seconds instead"
            f" (default {default_seconds}). croniter reads a sixth cron field as seconds, so"
            f" {os.environ[cron_name]!r} may not mean what it says."
        )
    raw = os.environ.get(seconds_name, "").strip()
    if not raw:
        seconds = default_seconds
    else:
        try:
            seconds = int(raw)
        except ValueError:
            raise ImproperlyConfigured(f"{seconds_name} must be a whole number of seconds, got {raw!r}") from None
    try:
        cron = cron_every(seconds)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{seconds_name}={raw or seconds}: {exc}") from None
    check_schedule(seconds_name, cron, seconds)
    return seconds, cron


def check_settings(namespace: dict) -> None:
    """Every `X_CRON` setting must have its period `X_SECONDS` and run at it: called at the end of settings, so
    a schedule added later by hand is checked too."""
    for name, cron in namespace.items():
        if not (name.isupper() and name.endswith("_CRON")):
            continue
        seconds_name = name.removesuffix("_CRON") + "_SECONDS"
        if seconds_name not in namespace:
            raise ImproperlyConfigured(
                f"{name}: a schedule is configured as a period, {seconds_name}, and built with console.schedules"
            )
        check_schedule(name, cron, namespace[seconds_name])
