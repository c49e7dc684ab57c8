from __future__ import annotations

import random
from types import SimpleNamespace

from jobs.retry import BackoffWithJitter


def test_the_bound_grows_exponentially_up_to_the_cap(settings):
    settings.RETRY_BASE_SECONDS, settings.RETRY_CAP_SECONDS = 1.0, 10.0
    strategy = BackoffWithJitter()
    assert [strategy.bound(n) for n in range(6)] == [1, 2, 4, 8, 10, 10]


def test_delays_are_jittered_within_the_bound(settings):
    settings.RETRY_BASE_SECONDS, settings.RETRY_CAP_SECONDS = 1.0, 60.0
    strategy = BackoffWithJitter(random.Random(7))
    for attempts in range(8):
        delays = [strategy.delay(attempts) for _ in range(200)]
        assert all(0 <= d <= strategy.bound(attempts) for d in delays)
        assert len({round(d, 6) for d in delays}) > 150  # full jitter: spread over the whole range
        # on average, later attempts wait longer (until the cap)
        assert sum(delays) / len(delays) > strategy.bound(attempts) / 4


def test_it_schedules_the_retry(settings):
    settings.RETRY_BASE_SECONDS, settings.RETRY_CAP_SECONDS = 0.5, 60.0
    decision = BackoffWithJitter(random.Random(1)).get_retry_decision(
        exception=RuntimeError("x"), job=SimpleNamespace(attempts=3)
    )
    assert decision is not None and decision.retry_at is not None


def test_it_gives_up_after_the_backstop():
    strategy = BackoffWithJitter()
    assert strategy.get_retry_decision(exception=RuntimeError("x"), job=SimpleNamespace(attempts=9)) is None
