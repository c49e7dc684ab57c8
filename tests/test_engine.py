from __future__ import annotations

import pytest
from django.core.management import call_command

from approvals.models import Approval
from runs import sandbox
from runs.models import Run
from tests.engine_helpers import REFUND, SMALL_REFUND, drive, model_calls, queued_jobs


@pytest.fixture
def demo(db):
    call_command("demo_setup", verbosity=0)


def test_a_refund_parks_for_approval_then_pays_once(demo, bob):
    run, created = Run.submit(workflow="refund", input=REFUND)
    assert created and run.status == Run.Status.QUEUED and queued_jobs(run) == 1
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN
    card = Approval.objects.get(run=run)
    assert card.status == "pending" and card.proposed["refund"]["amount_cents"] == 12_500
    assert sandbox.stats()["channels"]["payments"] == 0

    card.decide(bob, "approve")
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}
    assert list(run.steps.values_list("status", flat=True)) == ["done"] * 6
    assert model_calls(run) == 2


def test_a_small_refund_is_approved_by_itself(demo):
    run, _ = Run.submit(workflow="refund", input=SMALL_REFUND)
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert not Approval.objects.exists()
