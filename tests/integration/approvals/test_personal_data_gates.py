"""A workflow's gate whose proposal model marks personal data (`x-pii`): its card keeps references, asked again
(a resumed run) it is the same card, and the decision comes back to the engine with references (issue 29)."""

from __future__ import annotations

import base64
import json
import os

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from pydantic import BaseModel, ConfigDict, Field

from approvals.models import Approval
from core import pii
from core.models import PiiValue
from runs import submission
from runs.gates import ApprovalRequest, Display
from runs.models import Run
from runs.workflow import Workflow, register
from tests.engine_helpers import drive

EMAIL = "jane.doe@example.com"


class Notice(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"x-pii-subject": "customer_id"})

    customer_id: str
    to: str = Field(pattern=r"^[^@\s]+@[^@\s]+$", json_schema_extra={"x-pii": True})
    amount_cents: int


pii_gate = register(Workflow("test_pii_gate"))


@pii_gate.gate("payments", proposal=Notice, editable=("amount_cents",), display=Display(headline="to"))
def tell_the_customer(ctx):
    return ctx.gate(proposed={"customer_id": "cus_3", "to": EMAIL, "amount_cents": 10}, summary=f"Write to {EMAIL}")


@pytest.fixture
def parked(db, settings):
    settings.PII_KEYS = base64.b64encode(os.urandom(32)).decode()
    call_command("demo_setup", verbosity=0)
    run, _ = submission.submit(workflow="test_pii_gate", input={}, created_by=User.objects.get(username="agent"))
    run = drive(run)
    assert run.status == Run.Status.WAITING_HUMAN
    return run


def test_the_gates_card_keeps_references_and_a_resumed_run_finds_it_again(parked):
    card = Approval.objects.get(run=parked)
    row = Approval.objects.filter(pk=card.pk).values().get()
    assert EMAIL not in json.dumps(row, default=str)
    ref = card.proposed["to"]
    assert pii.open(ref) == EMAIL and card.headline == ref and card.summary == f"Write to {ref}"
    assert card.args_hash == ApprovalRequest(channel="payments", proposed=card.proposed).args_hash()
    # The run's job again (a retry, a recovery): the gate asks again with the clear value; it is the same card.
    Run.objects.filter(pk=parked.pk).update(status=Run.Status.QUEUED)
    drive(Run.objects.get(pk=parked.pk))
    assert list(Approval.objects.filter(run=parked).values_list("pk", "status")) == [(card.pk, "pending")]
    assert PiiValue.objects.count() == 1


def test_an_approval_resumes_the_run_with_references(parked):
    card = Approval.objects.get(run=parked)
    card.decide(User.objects.get(username="reviewer"), "approve", version=card.version)
    run = drive(Run.objects.get(pk=parked.pk))
    assert run.status == Run.Status.SUCCEEDED
    step = run.steps.get(name="tell_the_customer")
    assert step.output["payload"]["to"] == card.proposed["to"] and EMAIL not in json.dumps(step.output)


def test_an_edit_resumes_the_run_with_references(parked):
    card = Approval.objects.get(run=parked)
    edited = {**card.proposed, "amount_cents": 5}
    card.decide(User.objects.get(username="reviewer"), "edit", payload=edited, version=card.version, comment="less")
    run = drive(Run.objects.get(pk=parked.pk))
    assert run.status == Run.Status.SUCCEEDED
