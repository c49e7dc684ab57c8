"""A run's states and the one table of the transitions between them, like viewflow's
`@status.transition(source=..., target=...)`. The compare-and-swap methods of runs.models.Run take a transition
by name and read its states here (Run._swap); the SQL statements that move a run (runs/sql/queries.sql) have
their status conditions and targets written from it (runs.sql), and tests/unit/test_run_transitions.py checks
the statements and the methods against it (tests/integration/runs/test_run_transitions.py, the methods run against
the database). A leaf: any layer may import it."""

from __future__ import annotations

from typing import NamedTuple

from django.db import models


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    WAITING_HUMAN = "waiting_human"
    PAUSED = "paused"  # parked by a kill switch or the cost limit
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # in the dead-letter queue
    CANCELLED = "cancelled"
    # Driven by an agent outside the console, which asks for approvals over the API (external.models): the
    # engine never takes it (no transition but the cancel leaves it); it ends only when it is cancelled.
    EXTERNAL = "external"


FINISHED = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)
PARKED = (RunStatus.WAITING_HUMAN, RunStatus.PAUSED)


class Transition(NamedTuple):
    sources: tuple[RunStatus, ...]  # the states the run may leave this way
    target: RunStatus


_QUEUED, _RUNNING, _FAILED = RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.FAILED

TRANSITIONS: dict[str, Transition] = {
    # Run.claim, by the job that holds the run's lock (runs.ownership), the row locked:
    "start": Transition((_QUEUED,), _RUNNING),  # a free slot of its tenant (the claim's start statement)
    "wait_for_slot": Transition((_QUEUED,), _QUEUED),  # no free slot: it waits without a job for one
    "take_over": Transition((_RUNNING,), _RUNNING),  # the previous owner's session ended: a new owner
    "cancel_queued": Transition((_QUEUED,), RunStatus.CANCELLED),  # a cancel requested before it started
    # The owner's, from the session that holds the run's lock:
    "checkpoint": Transition((_RUNNING,), _RUNNING),  # a step is done: the cursor moves past it
    "succeed": Transition((_RUNNING,), RunStatus.SUCCEEDED),  # Run.finish, or the last step's checkpoint
    "stop": Transition((_RUNNING,), RunStatus.CANCELLED),  # a cancel seen by the owner, or a person's stop
    "park": Transition((_RUNNING,), RunStatus.WAITING_HUMAN),  # for a person's decision
    "pause": Transition((_RUNNING,), RunStatus.PAUSED),  # for a kill switch or a budget card
    "fail": Transition((_RUNNING,), _FAILED),  # to the dead-letter queue
    "retry_later": Transition((_RUNNING,), _QUEUED),  # the job retries the step after a backoff
    "release": Transition((_RUNNING,), _QUEUED),  # back to the queue with a new job (shutdown, a wait)
    # Others':
    "recover": Transition((_RUNNING,), _QUEUED),  # the recovery sweep: its owner's session ended
    "resume": Transition(PARKED, _QUEUED),  # a decision, or the release of its kill switch
    "requeue_failed": Transition((_FAILED,), _QUEUED),  # the dead-letter queue's requeue
    # a person (a running run: its owner stops; an external run: its agent's session ends)
    "cancel": Transition((_QUEUED, *PARKED, RunStatus.EXTERNAL), RunStatus.CANCELLED),
}
