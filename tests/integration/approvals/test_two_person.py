"""The two-person rule: a channel with required_approvals = 2 needs two different people before the run resumes."""

from __future__ import annotations

import json

import pytest

from approvals.errors import NotAllowed, SecondApproverNeeded
from approvals.models import Approval, Decision
from core.models import ApiToken, AuditEntry, Channel
from demo import sandbox
from demo.models import SandboxCall
from runs import submission
from runs.models import Run
from tests.engine_helpers import REFUND, drive, queued_jobs


@pytest.fixture
def demo(demo):
    """The demo's users; payments needs two people."""
    Channel.objects.filter(name="payments").update(required_approvals=2)
    return demo


def parked() -> tuple[Run, Approval]:
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    assert run.status == Run.Status.WAITING_HUMAN
    return run, Approval.objects.get(run=run)


def test_a_first_approval_leaves_the_run_parked(demo):
    run, card = parked()
    jobs = queued_jobs(run)  # the run's first job, which drive() ran without taking it off the queue
    card.decide(demo["reviewer"], "approve", comment="looks right", version=1)
    card.refresh_from_db()
    run.refresh_from_db()
    assert card.status == "pending" and card.decided_at is None and card.version == 2
    assert run.status == Run.Status.WAITING_HUMAN and queued_jobs(run) == jobs
    assert Decision.objects.get().actor == demo["reviewer"]
    entry = AuditEntry.objects.get(action="approval.approve")
    assert entry.data["approvals"] == 1 and entry.data["required"] == 2


def test_a_second_approval_by_another_person_resumes_the_run(demo, rita):
    run, card = parked()
    card.decide(demo["reviewer"], "approve", version=1)
    card.decide(rita, "approve", version=2)
    card.refresh_from_db()
    assert card.status == "approved" and card.decided_at is not None
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert sandbox.stats()["channels"]["payments"] == 1
    gate = run.steps.get(name="approve_refund")
    assert gate.output["by"] == "reviewer, rita"


def test_the_same_person_twice_is_refused(demo):
    run, card = parked()
    card.decide(demo["reviewer"], "approve")
    with pytest.raises(SecondApproverNeeded, match="different person"):
        card.decide(demo["reviewer"], "approve")
    # Their own edit restarts the count with them as its one approver: still nobody else's yes.
    card.decide(demo["reviewer"], "edit", payload=card.proposed)
    with pytest.raises(SecondApproverNeeded):
        card.decide(demo["reviewer"], "approve")
    card.refresh_from_db()
    run.refresh_from_db()
    assert card.status == "pending" and Decision.objects.count() == 2
    assert run.status == Run.Status.WAITING_HUMAN


def test_a_reject_by_anyone_ends_it(demo, rita):
    run, card = parked()
    card.decide(demo["reviewer"], "approve")
    card.decide(demo["reviewer"], "reject", comment="on second thought, no")  # even the first approver
    card.refresh_from_db()
    assert card.status == "rejected"
    run = drive(run)
    assert run.result["outcome"] == "rejected" and sandbox.stats()["channels"]["payments"] == 0


def test_an_edit_then_an_approval_executes_the_edit(demo, rita):
    run, card = parked()
    edited = {**card.proposed, "refund": {**card.proposed["refund"], "amount_cents": 3_000}}
    card.decide(demo["reviewer"], "edit", payload=edited)
    card.decide(rita, "approve")
    card.refresh_from_db()
    assert card.status == "edited"
    drive(run)

    payment = SandboxCall.objects.get(system="payments")
    assert payment.payload["amount_cents"] == 3_000


def test_a_one_approval_channel_is_unchanged(demo):
    Channel.objects.filter(name="payments").update(required_approvals=1)
    run, card = parked()
    card.decide(demo["reviewer"], "approve")
    card.refresh_from_db()
    assert card.status == "approved"


def test_nobody_decides_a_card_of_a_run_they_started(demo):
    run, _ = submission.submit(workflow="refund", input=REFUND, created_by=demo["reviewer"])
    run = drive(run)
    card = Approval.objects.get(run=run)
    with pytest.raises(NotAllowed, match="someone else"):
        card.decide(demo["reviewer"], "approve")
    assert not Decision.objects.exists()


def test_the_api_refuses_the_same_person_twice_with_409(demo, client):
    run, card = parked()
    _, raw = ApiToken.issue(demo["reviewer"])

    def decide(version):
        return client.post(
            f"/api/approvals/{card.pk}/decision",
            data=json.dumps({"decision": "approve", "comment": "", "version": version}),
            content_type="application/json",
            headers={"Authorization": f"Bearer {raw}"},
        )

    assert decide(1).status_code == 200
    second = decide(2)
    assert second.status_code == 409
    assert "different person" in second.json()["detail"]
