"""A job whose database session is cut while it works (a PostgreSQL restart or failover, a partition,
`pg_terminate_backend`) loses the run's lock with its session. Django opens a new session for the job's next
statement, and the run still names the job as its owner: a token is not a lock. These tests cut the session of
the job that drives a run, with a real `pg_terminate_backend`, in the middle of a model turn and in the middle of
an effect, with real worker processes and the recovery sweep every 2 s, and check that the job writes nothing
more, that the run's next owner resumes it, and that every effect happens once.

The test agent of tests.agent_workflows counts every model call and tool call (SandboxCall rows); its `note`
tool has a lookup, as a CRM would, so a successor reconciles a note it finds pending instead of writing it again.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from django.db import connection

import tests.agent_workflows  # noqa: F401 - registers test_agent in this process too
from core.models import AuditEntry
from demo.models import SandboxCall
from runs import ownership
from runs.models import Run
from tests.system.conftest import describe_runs, jobs_doing
from tests.worker import settles_as, wait_with_logs

SETTLE = 60
LOST = "lost ownership of the run"


@pytest.fixture
def system_env() -> dict:
    return {
        "WORKFLOW_MODULES": "tests.agent_workflows",
        "AGENT_MODEL": "tests.agent_workflows.ScriptedChat",
        "STALLED_SWEEP_SECONDS": "2",
    }


def submit(system, *turns, **run_input) -> Run:
    run_id = system.submit(
        {"message": "my order never came", "script": list(turns), **run_input}, workflow="test_agent"
    )
    return Run.objects.get(pk=run_id)


def model_turns(run: Run) -> Counter:
    return Counter(SandboxCall.objects.filter(run_id=run.id, system="model").values_list("payload__turn", flat=True))


def calls(run: Run, system: str) -> list[SandboxCall]:
    return list(SandboxCall.objects.filter(run_id=run.id, system=system).order_by("pk"))


def steps(run: Run) -> list[tuple[str, str, int]]:
    return list(run.steps.order_by("seq").values_list("name", "status", "attempt"))


def owner_backend(run: Run) -> int | None:
    """The PostgreSQL backend (pid) whose session holds the run's lock: the session of the job driving it."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted"
            " AND classid = %s::bigint::oid AND objid = %s::bigint::oid",
            [word & 0xFFFFFFFF for word in ownership.key(run.pk)],  # as pg_locks shows them: unsigned
        )
        row = cursor.fetchone()
    return row[0] if row else None


def cut_session(system, run: Run) -> None:
    pid = owner_backend(run)
    assert pid is not None, describe_runs([run.id])
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        assert cursor.fetchone()[0], f"backend {pid} was not terminated"


def retry_causes(run: Run) -> list[str]:
    """The run's audited retries: the sweep's `owner_gone` is expected; a retry the old job scheduled for its own
    failed write (written from a session without the lock) is not."""
    return [e.data["cause"] for e in AuditEntry.objects.filter(action="run.retry", run_id=run.id).order_by("pk")]


def lost_ownership(system) -> list[str]:
    return [line for worker in system.workers.all for line in worker.log().splitlines() if LOST in line]


def test_a_job_whose_session_is_cut_in_a_model_turn_writes_nothing_more_and_the_note_is_written_once(system):
    """The measured defect: the session is cut 0.2 s before a slow model turn answers, whose answer is a note
    (slow to be applied: still in flight when a successor would look it up). Before the fix, the old job
    reconnected, checkpointed the turn and sent the note; its successor found the pending receipt, looked the
    note up while it was still in flight, and sent it again: two notes."""
    answer_after = 3.0
    run = submit(
        system,
        {"calls": [["note", {"text": "customer asked for a refund"}]], "sleep": answer_after},
        {"answer": "Noted."},
        slow={"helper.turn1.1.note": 6},
    )
    wait_with_logs(lambda: model_turns(run)[1] == 1, "the model to be asked for turn 1", system.workers.all)
    asked_at = time.monotonic()
    time.sleep(max(0.0, asked_at + answer_after - 0.2 - time.monotonic()))
    cut_session(system, run)

    settles_as(run, Run.Status.SUCCEEDED, system.workers.all, timeout=SETTLE)
    assert [c.payload["text"] for c in calls(run, "crm")] == ["customer asked for a refund"], describe_runs([run.id])
    # The old job's turn was refused at its checkpoint, so its successor asked the model again.
    assert model_turns(run) == {1: 2, 2: 1}
    assert steps(run) == [
        ("helper.turn1", "done", 2),
        ("helper.turn1.1.note", "done", 1),
        ("helper.turn2", "done", 1),
        ("helper", "done", 1),
        ("after", "done", 1),
    ]
    assert retry_causes(run) == ["owner_gone"]
    assert lost_ownership(system), system.workers.logs()
    assert jobs_doing() == []


def test_a_job_whose_session_is_cut_in_an_effect_writes_nothing_more_and_its_successor_reconciles_it(system):
    """The session is cut while a note is being written (applied, its answer slow to come back). The old job's
    completion of the receipt is refused, so it does not go on into the next turn; its successor finds the
    pending receipt, looks the note up (it was applied) and completes it: one note, each turn asked once.
    Before the fix, the old job recorded the failure of its cut write from a new session and queued the run for
    a retry of its own (an audited `run.retry` of the tool), racing the sweep's recovery."""
    answer_after = 3.0
    run = submit(
        system,
        {"calls": [["note", {"text": "customer asked for a refund"}]]},
        {"calls": [["note", {"text": "and was refunded"}]], "sleep": 3},
        {"answer": "Noted."},
        hang={"helper.turn1.1.note": answer_after},
    )
    wait_with_logs(lambda: len(calls(run, "crm")) == 1, "the first note to be applied", system.workers.all)
    applied_at = time.monotonic()
    time.sleep(max(0.0, applied_at + answer_after - 0.2 - time.monotonic()))  # cut 0.2 s before it answers
    cut_session(system, run)

    settles_as(run, Run.Status.SUCCEEDED, system.workers.all, timeout=SETTLE)
    assert [c.payload["text"] for c in calls(run, "crm")] == ["customer asked for a refund", "and was refunded"]
    # Before the fix the old job completed the receipt from a new session and went on into turn 2 while its
    # successor did the same: turn 2 was asked twice.
    assert model_turns(run) == {1: 1, 2: 1, 3: 1}, describe_runs([run.id])
    note = run.steps.get(name="helper.turn1.1.note")
    assert (note.status, note.attempt) == ("done", 2) and note.output["result"][
        "id"
    ] == f"crm_{calls(run, 'crm')[0].pk}"
    assert run.receipts.get(key__endswith="helper.turn1.1.note").reconciled
    assert retry_causes(run) == ["owner_gone"]
    assert lost_ownership(system), system.workers.logs()
    assert jobs_doing() == []
