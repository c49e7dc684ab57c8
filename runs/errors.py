"""What the engine raises, and what a step raises to tell the engine what went wrong: a leaf any layer may import
(workflow authors get these from `runs.workflow`, docs/workflows.md#errors).

Anything a step raises that is not one of these is treated as Retryable (bounded), because an unknown error from
a model or a network library is more often transient than not."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runs.gates import ApprovalRequest


# Errors a step may raise.


class Retryable(Exception):
    """Transport errors, 429/5xx, timeouts: retried with exponential backoff and jitter."""


class Fatal(Exception):
    """Validation, 4xx, refusals: never retried; the run goes to the dead-letter queue."""


class Ambiguous(Exception):
    """A write that may or may not have happened: never retried blindly."""


class Wait(Exception):
    """The step cannot run yet and was not attempted (an external system's circuit breaker is open, the
    tenant is over its token rate): the engine gives the run back to the queue for `delay` seconds, without
    counting an attempt or recording a failure (runs.breakers.BreakerOpen, runs.ratelimit.Throttled)."""

    def __init__(self, reason: str, delay: float):
        super().__init__(reason)
        self.reason = reason
        self.delay = delay


class Stop(Exception):
    """Raised inside a step to end the run as cancelled with `result` (a person stopped it from a budget card)."""

    def __init__(self, result: dict):
        super().__init__(result.get("outcome", "stopped"))
        self.result = result


class Park(Exception):
    """Raised inside a step to park the run: for a person's decision (with `request`) or a kill switch (with
    `kill_switch_channel`, the channel whose effect it stopped)."""

    def __init__(
        self,
        reason: str,
        request: ApprovalRequest | None = None,
        paused: bool = False,
        kill_switch_channel: str | None = None,
        seq: int | None = None,
    ):
        super().__init__(reason)
        self.reason = reason
        self.request = request
        self.paused = paused
        self.kill_switch_channel = kill_switch_channel
        self.seq = seq  # the card's step, when not the one at the run's cursor (a compensation's: its effect's)


class UndoRefused(Exception):
    """An undo that cannot be done as asked (nothing to undo, a compensation past its deadline, a run that is not
    in a state to be undone): nothing was done; the message says why (runs.compensations)."""


class ForkRefused(Exception):
    """A fork that cannot be made as asked (runs.forks): a step the run does not have, a run whose record still moves
    or whose effects were undone past that step, a bad reason. Nothing was written; the message says why."""


# Errors of submitting a run.


class InvalidInput(ValueError):
    """A run's input (or an edit of a proposal) that its schema refuses: `errors` is a list of {loc, msg}."""

    def __init__(self, errors: list[dict]):
        super().__init__("; ".join(f"{e['loc']}: {e['msg']}" for e in errors))
        self.errors = errors


class UnknownWorkflow(LookupError):
    pass


class IdempotencyConflict(Exception):
    pass


# Errors of a run's state change (runs.models.Run's compare-and-swap methods).


class TransitionRefused(Exception):
    """A run's state change whose compare-and-swap changed no row: the run is no longer in a state it may
    leave that way, or the caller no longer owns it. The caller must stop acting for the run."""


class OwnershipLost(TransitionRefused):
    """The job no longer owns the run: another job took it over, or it was finished or cancelled meanwhile."""
