"""Worker glue: keep the LISTEN/NOTIFY wake-ups that procrastinate 3.10's worker can drop.

The worker clears its "new job" event *after* each fetch. A job committed while a fetch that finds nothing
is running notifies, sets the event, and the clear right after erases it: the job then waits for the
fallback poll (WORKER_POLL_INTERVAL). A decided run must resume at once, so every worker started by this
app gets an event whose clear() cannot erase a notification that arrived since the previous clear(): at worst
one extra, empty fetch; never a lost wake-up.
"""

from __future__ import annotations

import asyncio


class NotificationLatch(asyncio.Event):
    def __init__(self) -> None:
        super().__init__()
        self._set_since_clear = False

    def set(self) -> None:
        self._set_since_clear = True
        super().set()

    def clear(self) -> None:
        if self._set_since_clear:
            # A notification came since the last clear(), maybe during the fetch this clear() follows, whose
            # snapshot may not include its job: stay set for one more fetch.
            self._set_since_clear = False
            return
        super().clear()


def on_app_ready(app) -> None:
    """PROCRASTINATE_ON_APP_READY: workers of this app wake up on every notification."""
    make_worker = app._worker

    def _worker(**options):
        worker = make_worker(**options)
        worker._new_job_event = NotificationLatch()  # procrastinate 3.10 has no hook for this event
        return worker

    app._worker = _worker
