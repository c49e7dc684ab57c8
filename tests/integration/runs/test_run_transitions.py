"""A run's transition graph is one table (runs.transitions.TRANSITIONS), which the compare-and-swap methods of Run
take their states from: each, run against the database, leaves only the states of its transition. That the methods
and the SQL statements take their states from the table: tests/unit/test_run_transitions.py."""

from __future__ import annotations

import pytest
from django.utils import timezone

from runs.errors import TransitionRefused
from runs.models import Run
from runs.transitions import FINISHED, OWNED, TRANSITIONS, RunStatus


def _run_in(status: str) -> Run:
    return Run.objects.create(
        workflow="refund",
        workflow_version=1,
        input={},
        status=status,
        owner="job-a" if status in OWNED else "",
        finished_at=timezone.now() if status in FINISHED else None,
    )


def _changes_into(target: str) -> dict:
    """What the database's constraints ask of a run in `target` (Run's methods write the same)."""
    return {
        "owner": "job-b" if target in OWNED else "",
        "finished_at": timezone.now() if target in FINISHED else None,
    }


@pytest.mark.parametrize("name", sorted(TRANSITIONS))
def test_a_compare_and_swap_leaves_only_the_states_of_its_transition(db, name):
    sources, target = TRANSITIONS[name]
    for status in RunStatus.values:
        run = _run_in(status)
        if status in sources:
            run._swap(name, **_changes_into(target))
            assert Run.objects.get(pk=run.pk).status == target == run.status
        else:
            with pytest.raises(TransitionRefused):
                run._swap(name, **_changes_into(target))
            assert Run.objects.get(pk=run.pk).status == status, f"{name} moved a {status} run"
