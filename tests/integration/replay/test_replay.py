"""Replay (runs.replay): a recorded run on the code deployed now, fed back from its record, calling nothing."""

from __future__ import annotations

import dataclasses

import pytest

from approvals.models import Approval
from demo import model as demo_model
from demo import sandbox
from demo import workflows as demo_workflows
from demo.models import SandboxCall
from runs import replay as replays
from runs import submission
from runs.models import Receipt, Run, Step
from tests.engine_helpers import REFUND, drive

SUPPORT = {"customer_id": "cus_1042", "message": "Refund ord_10421 please, 20 EUR", "order_id": "ord_10421"}


def _finished_support_run(demo) -> Run:
    run = drive(submission.submit(workflow="support_agent", input=SUPPORT)[0])
    for _ in range(6):
        card = Approval.objects.filter(run=run, status=Approval.Status.PENDING).first()
        if card is None:
            break
        card.decide(demo["reviewer"], "approve")
        run = drive(run)
    assert run.status == Run.Status.SUCCEEDED, (run.status, run.result)
    return run


@pytest.fixture
def counted_calls(monkeypatch):
    """Counts every call that reaches the demo's model and sandbox systems (they still run)."""
    calls = []

    def counting(cls, name):
        real = getattr(cls, name)

        def spy(self, *args, **kwargs):
            calls.append(f"{cls.__name__}.{name}")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)

    counting(demo_model.ScriptedModel, "chat")
    counting(demo_model.ScriptedModel, "complete")
    counting(sandbox._System, "_call")
    return calls


def test_a_recorded_support_agent_run_replays_identically_calling_nothing(demo, counted_calls):
    run = _finished_support_run(demo)
    steps = Step.objects.filter(run=run).count()
    sandbox_rows, receipts = SandboxCall.objects.count(), Receipt.objects.count()
    counted_calls.clear()

    report = replays.replay(run)

    assert report.identical, report.summary()
    assert len(report.steps) == steps
    assert counted_calls == [] and report.calls == 0
    # Every model answer, read, recorded value and effect the run drew came from its record (6 turns, 2 reads, the
    # refund's orders, 3 effects), gates from their cards.
    tapes = [entry for tape in Step.objects.filter(run=run).values_list("tape", flat=True) for entry in tape or []]
    assert sum(s.fed for s in report.steps) == sum(e["call"] != "gate" for e in tapes) == 12
    assert (SandboxCall.objects.count(), Receipt.objects.count()) == (sandbox_rows, receipts)


def test_a_changed_prompt_diverges_at_the_first_turn(demo, monkeypatch, counted_calls):
    run = _finished_support_run(demo)
    monkeypatch.setattr(demo_workflows, "SUPPORT_PROMPT", demo_workflows.SUPPORT_PROMPT + " Be brief.")
    counted_calls.clear()

    report = replays.replay(run)

    assert not report.identical
    assert (report.divergence.seq, report.divergence.step) == (0, "support_agent.turn1")
    assert report.divergence.reason == "asks model.chat differently"
    assert counted_calls == []


def test_a_refund_replays_identically_and_a_changed_gate_proposal_diverges_at_the_gate(demo, monkeypatch):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    Approval.objects.get(run=run, status=Approval.Status.PENDING).decide(demo["reviewer"], "approve")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert replays.replay(run).identical

    gate = demo_workflows.refund.steps[3]
    original = gate.fn

    def drafts_more(ctx):
        ctx.outputs = {**ctx.outputs, "draft_refund": {**ctx.outputs["draft_refund"]}}
        draft = ctx.outputs["draft_refund"]
        draft["refund"] = {**draft["refund"], "amount_cents": draft["refund"]["amount_cents"] - 1}
        return original(ctx)

    steps = list(demo_workflows.refund.steps)
    steps[3] = dataclasses.replace(gate, fn=drafts_more)
    monkeypatch.setattr(demo_workflows.refund, "steps", steps)
    report = replays.replay(run)
    assert (report.divergence.step, report.divergence.reason) == (
        "approve_refund",
        "proposes something else than the card a person decided",
    )


def test_a_running_run_is_refused(demo):
    run = submission.submit(workflow="refund", input=REFUND)[0]
    with pytest.raises(replays.NotReplayable, match="the run is queued"):
        replays.replay(run)
