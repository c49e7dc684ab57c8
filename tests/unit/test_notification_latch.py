from __future__ import annotations

import asyncio

from procrastinate.contrib.django import app

from jobs.worker import NotificationLatch


def test_a_notification_during_a_fetch_survives_the_clear_after_it():
    latch = NotificationLatch()
    latch.clear()  # the worker clears before its first fetch
    latch.set()  # a job is committed and notified while the fetch runs
    latch.clear()  # the fetch found nothing (its snapshot predates the job); the worker clears
    assert latch.is_set()  # so the worker fetches once more instead of sleeping until the next poll


def test_without_a_new_notification_the_clear_clears():
    latch = NotificationLatch()
    latch.set()
    latch.clear()  # the extra fetch
    latch.clear()
    assert not latch.is_set()


def test_a_plain_event_would_lose_it():
    event = asyncio.Event()
    event.set()
    event.clear()
    assert not event.is_set()  # the bug being worked around


def test_workers_of_the_app_use_the_latch():
    worker = app._worker(queues=["nothing"])
    assert isinstance(worker._new_job_event, NotificationLatch)
