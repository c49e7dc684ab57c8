"""Exponential backoff with full jitter and a cap (procrastinate's RetryStrategy has neither)."""

from __future__ import annotations

import random

from django.conf import settings
from procrastinate.retry import BaseRetryStrategy, RetryDecision


class BackoffWithJitter(BaseRetryStrategy):
    """Retry after a delay drawn uniformly from [0, min(cap, base * 2**attempts)].

    The engine decides whether a failure is retried (it fails the run once attempts run out, and never
    raises for a Fatal error); this strategy only says when. Base and cap are read from settings when
    a decision is made, so they can be tuned per deployment and in tests."""

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def bound(self, attempts: int) -> float:
        return min(settings.RETRY_CAP_SECONDS, settings.RETRY_BASE_SECONDS * 2**attempts)

    def delay(self, attempts: int) -> float:
        return self.rng.uniform(0, self.bound(attempts))

    # A backstop for errors outside any step (the database down while the engine records a failure): the
    # engine itself gives up after RUN_MAX_ATTEMPTS, so only those reach this many.
    MAX_JOB_ATTEMPTS = 10

    def get_retry_decision(self, *, exception: BaseException, job) -> RetryDecision | None:
        if job.attempts + 1 >= self.MAX_JOB_ATTEMPTS:
            return None
        return RetryDecision(retry_in={"seconds": self.delay(job.attempts)})
