from __future__ import annotations

import pytest
from django.core.management import call_command

from approvals.models import Approval
from runs import sandbox
from runs.models import Run
from tests.engine_helpers import REFUND
from tests.worker import wait_until

pytestmark = pytest.mark.slow


def test_a_real_worker_parks_and_finishes_a_refund(start_worker, bob):
    call_command("demo_setup", verbosity=0)
    start_worker()
    run, _ = Run.submit(workflow="refund", input=REFUND)
    wait_until(lambda: Run.objects.get(pk=run.pk).status == Run.Status.WAITING_HUMAN, message="the gate")
    Approval.objects.get(run=run).decide(bob, "approve")
    wait_until(lambda: Run.objects.get(pk=run.pk).status == Run.Status.SUCCEEDED, message="the run to finish")
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}
