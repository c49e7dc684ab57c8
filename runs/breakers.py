"""Circuit breakers, one per external system (`model`, `payments`, `email`, `crm`, or a tool's own name).

A tool wraps each call to its system in `guard(system)` (a context manager, or a decorator):

    with breakers.guard("crm"):
        answer = crm_client.get(...)

Closed, the call goes through and its outcome is counted on the system's `Breaker` row. When the last
BREAKER_WINDOW_SECONDS hold at least BREAKER_MIN_CALLS calls of which at least BREAKER_FAILURES, and a share of
BREAKER_FAILURE_RATE, failed, the breaker opens: for BREAKER_COOLDOWN_SECONDS every guarded call raises
`BreakerOpen` without reaching the system, and the engine gives the run back to the queue until the breaker may
let a call through (runs.engine: a `Wait` is not an attempt and not a failure). Then the first call to come
takes the half-open probe (a compare-and-swap open -> half_open: one caller wins, in whichever process): a
success closes the breaker, a failure opens it for another cool-down, and the others wait meanwhile. Ops can
hold a breaker open, or close it, by hand (`force`, audited).

Failures are what says the system is unwell: `Retryable` (429, 5xx, as the clients classify them) and OSError
(timeouts, refused connections, urllib's URLError). A `Fatal` answer (a 4xx, a refusal) is the system answering,
so it counts as a success. Anything else says nothing about the system and is not counted.

The state is shared by every worker in PostgreSQL; each read or update is a short transaction of its own, and
no lock is ever held during a call. Effects also ask `check(channel)` before their receipt is written
(runs.steps.Context.effect), so a run that waits on a breaker leaves no receipt behind.
"""

from __future__ import annotations

import random
from contextlib import ContextDecorator
from datetime import datetime, timedelta

import structlog
from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import F
from django.utils import timezone

from core.models import KILL_SWITCH_REASON_MAX, AuditEntry, ReasonRequired
from runs.errors import Fatal, Retryable, Wait
from runs.models import Breaker

log = structlog.get_logger("runs.breakers")

SYSTEMS = ("model", "payments", "email", "crm")  # always shown, with or without a row
WINDOW_MAX_CALLS = 200  # outcomes kept per breaker: its window is the last BREAKER_WINDOW_SECONDS, at most this many
FAILURES = (Retryable, OSError)
MIN_DELAY = 0.5  # seconds: the shortest wait, so that a run does not spin on a breaker about to change

OPEN, HALF_OPEN, CLOSED = Breaker.State.OPEN, Breaker.State.HALF_OPEN, Breaker.State.CLOSED


class BreakerOpen(Wait):
    """A call held back by an open (or half-open) breaker: the step waits `delay` seconds."""

    def __init__(self, system: str, state: str, delay: float):
        super().__init__(f"the {system} circuit breaker is {state.replace('_', '-')}", delay)
        self.system = system
        self.state = state


class UnknownSystem(LookupError):
    pass


class guard(ContextDecorator):  # noqa: N801 - used like a function: `with guard("crm"):`, `@guard("crm")`
    """Let one call to `system` through its breaker, and count how it went. Raises BreakerOpen (a `Wait`)
    instead of calling while the breaker holds calls back."""

    def __init__(self, system: str):
        self.system = system
        self.probe = False

    def _recreate_cm(self):
        return type(self)(self.system)  # as a decorator: a fresh guard per call (worker threads share the function)

    def __enter__(self):
        self.probe = _admit(self.system) if settings.BREAKERS_ENABLED else False
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not settings.BREAKERS_ENABLED or isinstance(exc, Wait):
            return False
        if exc is None or isinstance(exc, Fatal):
            failed = False
        elif isinstance(exc, FAILURES):
            failed = True
        else:
            failed = None  # says nothing about the system
        if failed is not None or self.probe:
            _record(self.system, self.probe, failed, f"{exc.__class__.__name__}: {exc}" if failed else "")
        return False


def check(system: str) -> None:
    """Raise BreakerOpen if a call to `system` would be held back now; never takes the probe (the call's own
    guard does). A system without a breaker row, or with breakers off, passes."""
    if not settings.BREAKERS_ENABLED:
        return
    breaker = Breaker.objects.filter(system=system).first()
    if breaker is not None and breaker.state != CLOSED and not _probe_due(breaker, timezone.now()):
        _hold_back(breaker, timezone.now())


def _probe_due(breaker: Breaker, now: datetime) -> bool:
    if breaker.state == OPEN:
        return not breaker.forced and breaker.open_until is not None and breaker.open_until <= now
    if breaker.state == HALF_OPEN:
        return breaker.probe_started_at <= now - timedelta(seconds=settings.BREAKER_PROBE_TIMEOUT_SECONDS)
    return False


def _admit(system: str) -> bool:
    """Before a call: True when it is the half-open probe, False when it simply goes (closed); raises
    BreakerOpen when it must wait."""
    breaker = Breaker.objects.filter(system=system).first() or Breaker.objects.get_or_create(system=system)[0]
    if breaker.state == CLOSED:
        return False
    now = timezone.now()
    if _probe_due(breaker, now):
        # The cool-down is over (or the last probe never came back: its worker died in the call). Whoever
        # swaps first is the probe, in any process; the others find the row changed and wait.
        taken = Breaker.objects.filter(
            pk=breaker.pk, state=breaker.state, forced=False, probe_started_at=breaker.probe_started_at
        ).update(state=HALF_OPEN, probe_started_at=now, changed_at=now)
        if taken:
            log.info("circuit breaker half-open: a probe call goes through", system=system)
            return True
        breaker.refresh_from_db()
        if breaker.state == CLOSED:
            return False  # closed by ops meanwhile
    _hold_back(breaker, now)


def _hold_back(breaker: Breaker, now: datetime):
    Breaker.objects.filter(pk=breaker.pk).update(held_back=F("held_back") + 1)
    cooldown = settings.BREAKER_COOLDOWN_SECONDS
    if breaker.state == OPEN and not breaker.forced and breaker.open_until is not None:
        wait = (breaker.open_until - now).total_seconds()
    elif breaker.state == HALF_OPEN and breaker.probe_started_at is not None:
        probe_deadline = breaker.probe_started_at + timedelta(seconds=settings.BREAKER_PROBE_TIMEOUT_SECONDS)
        wait = min(cooldown, (probe_deadline - now).total_seconds())
    else:
        wait = cooldown  # held open by ops (or closed meanwhile): look again after a cool-down
    # Jitter over a tenth of the cool-down: the runs that waited on one breaker do not all come back at once.
    delay = max(MIN_DELAY, wait) + random.uniform(0, cooldown / 10)
    raise BreakerOpen(breaker.system, breaker.state, delay)


def _record(system: str, probe: bool, failed: bool | None, error: str) -> None:
    """Count a call's outcome (`failed` None: an error that says nothing about the system, which only gives a
    probe's turn back). Bookkeeping never fails the call it counts: a database error is logged."""
    try:
        with transaction.atomic():
            breaker = Breaker.objects.select_for_update().get(system=system)
            now = timezone.now()
            if probe:
                if breaker.state != HALF_OPEN:
                    return  # ops forced it open or closed meanwhile: theirs is the last word
                if failed is None:
                    _set(breaker, now, state=OPEN, open_until=now, probe_started_at=None)  # the next call probes
                elif failed:
                    _open(breaker, now, error)
                else:
                    _close(breaker, now)
                    log.warning("circuit breaker closed: the probe succeeded", system=system)
                return
            if breaker.state != CLOSED:
                return  # a call that started before the breaker opened: the opening already counted its kind
            cutoff = now.timestamp() - settings.BREAKER_WINDOW_SECONDS
            window = [entry for entry in breaker.window if entry[0] > cutoff][-(WINDOW_MAX_CALLS - 1) :]
            window.append([round(now.timestamp(), 3), int(bool(failed))])
            calls, failures = len(window), sum(f for _, f in window)
            if (
                calls >= settings.BREAKER_MIN_CALLS
                and failures >= settings.BREAKER_FAILURES
                and failures >= settings.BREAKER_FAILURE_RATE * calls
            ):
                _open(breaker, now, error)
                log.warning("circuit breaker opened", system=system, calls=calls, failures=failures, error=error)
            else:
                breaker.window = window
                breaker.save(update_fields=["window"])
    except DatabaseError as exc:
        log.warning("could not count a call on its circuit breaker", system=system, error=str(exc))


def _set(breaker: Breaker, now: datetime, **fields) -> None:
    fields.setdefault("changed_at", now)
    for name, value in fields.items():
        setattr(breaker, name, value)
    breaker.save(update_fields=list(fields))


def _open(breaker: Breaker, now: datetime, error: str, *, forced: bool = False, by: str = "") -> None:
    _set(
        breaker,
        now,
        state=OPEN,
        forced=forced,
        opened_at=now,
        open_until=None if forced else now + timedelta(seconds=settings.BREAKER_COOLDOWN_SECONDS),
        probe_started_at=None,
        window=[],
        held_back=0,
        last_error=error[:2000],
        changed_by=by,
    )


def _close(breaker: Breaker, now: datetime, *, by: str = "") -> None:
    _set(breaker, now, state=CLOSED, forced=False, open_until=None, probe_started_at=None, window=[], changed_by=by)


# Ops: force a breaker open (held until closed by hand) or closed (counting again from nothing).


def known_systems() -> list[str]:
    return sorted(set(SYSTEMS) | set(Breaker.objects.values_list("system", flat=True)))


def force(system: str, *, open: bool, by, reason: str) -> bool:
    """Hold the breaker of `system` open (no probe until someone closes it), or close it. Audited. True when it
    changed; raises ReasonRequired for a blank reason, UnknownSystem for a system without a breaker."""
    reason = (reason or "").strip()
    if not reason:
        raise ReasonRequired("a reason is required")
    if len(reason) > KILL_SWITCH_REASON_MAX:
        raise ReasonRequired(f"the reason is longer than {KILL_SWITCH_REASON_MAX} characters")
    if system not in known_systems():
        raise UnknownSystem(f"no circuit breaker for {system!r}")
    with transaction.atomic():
        Breaker.objects.get_or_create(system=system)
        breaker = Breaker.objects.select_for_update().get(system=system)
        before = "forced_open" if breaker.forced else breaker.state
        if (open and breaker.forced) or (not open and breaker.state == CLOSED):
            return False
        now = timezone.now()
        if open:
            _open(breaker, now, f"forced open by {by.get_username()}: {reason}", forced=True, by=by.get_username())
        else:
            _close(breaker, now, by=by.get_username())
        after = "forced_open" if open else CLOSED
        AuditEntry.record(
            "breaker.force_open" if open else "breaker.force_closed",
            actor=by,
            target=f"breaker:{system}",
            data={"system": system, "before": before, "after": after, "reason": reason},
        )
    log.warning("circuit breaker forced " + ("open" if open else "closed"), system=system, by=by.get_username())
    return True


# What the dashboard and /metrics show.


def states(now: datetime | None = None) -> list[Breaker]:
    """Every breaker (the four systems, with or without a row), each with `calls` and `failures` in its
    window and `remaining` seconds of its cool-down (None when not counting down)."""
    now = now or timezone.now()
    rows = {breaker.system: breaker for breaker in Breaker.objects.all()}
    shown = [rows.get(system) or Breaker(system=system) for system in sorted(set(SYSTEMS) | set(rows))]
    cutoff = now.timestamp() - settings.BREAKER_WINDOW_SECONDS
    for breaker in shown:
        window = [entry for entry in breaker.window if entry[0] > cutoff]
        breaker.calls, breaker.failures = len(window), sum(f for _, f in window)
        counting_down = breaker.state == OPEN and breaker.open_until is not None
        breaker.remaining = max(0.0, (breaker.open_until - now).total_seconds()) if counting_down else None
        breaker.shown_state = "forced_open" if breaker.forced else breaker.state
    return shown
