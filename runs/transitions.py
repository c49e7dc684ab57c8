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
    # Undo (runs.compensations): what a run did is compensated in reverse order, by a job that owns it (as
    # `running`), or by an external agent that runs the approved compensations itself (an external run).
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"  # every compensation ran, or a person took one over by hand
    COMPENSATION_FAILED = "compensation_failed"  # parked: a compensation failed for good; a card asks a person


FINISHED = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.COMPENSATED)
PARKED = (RunStatus.WAITING_HUMAN, RunStatus.PAUSED, RunStatus.COMPENSATION_FAILED)
OWNED = (RunStatus.RUNNING, RunStatus.COMPENSATING)  # a job drives it (an external agent, for an external run)


class Transition(NamedTuple):
    sources: tuple[RunStatus, ...]  # the states the run may leave this way
    target: RunStatus


_QUEUED, _RUNNING, _FAILED = RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.FAILED
_COMPENSATING = RunStatus.COMPENSATING

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
    "park": Transition(OWNED, RunStatus.WAITING_HUMAN),  # for a person's decision
    "pause": Transition(OWNED, RunStatus.PAUSED),  # for a kill switch or a budget card
    "fail": Transition(OWNED, _FAILED),  # to the dead-letter queue
    "retry_later": Transition(OWNED, _QUEUED),  # the job retries the step (or compensation) after a backoff
    "release": Transition(OWNED, _QUEUED),  # back to the queue with a new job (shutdown, a wait)
    # Undo (runs.compensations), the owner's: the run's undo begins (its `undo_reason` says why), a new owner
    # takes over an undo whose owner's session ended, the undo ends, or a compensation failed for good.
    "start_undo": Transition((_RUNNING,), _COMPENSATING),
    "take_over_undo": Transition((_COMPENSATING,), _COMPENSATING),
    "compensated": Transition((_COMPENSATING,), RunStatus.COMPENSATED),
    "compensation_failed": Transition((_COMPENSATING,), RunStatus.COMPENSATION_FAILED),
    # Others':
    "recover": Transition(OWNED, _QUEUED),  # the recovery sweep: its owner's session ended
    "resume": Transition(PARKED, _QUEUED),  # a decision, or the release of its kill switch
    "requeue_failed": Transition((_FAILED,), _QUEUED),  # the dead-letter queue's requeue
    # a person (a running run: its owner stops; an external run: its agent's session ends)
    "cancel": Transition((_QUEUED, *PARKED, RunStatus.EXTERNAL), RunStatus.CANCELLED),
    # a person's cancel and undo of a run no job drives (a running one: its owner undoes it)
    "undo": Transition((_QUEUED, RunStatus.WAITING_HUMAN, RunStatus.PAUSED), _QUEUED),
    # an external agent's run: its approved compensations are for its agent to run (external.undo)
    "undo_external": Transition((RunStatus.EXTERNAL,), _COMPENSATING),
    "external_compensated": Transition((_COMPENSATING,), RunStatus.COMPENSATED),
}
