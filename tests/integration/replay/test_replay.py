"""Replay (runs.replay): a recorded run on the code deployed now, fed back from its record, calling nothing."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command

from approvals.models import Approval
from demo import model as demo_model
from demo import sandbox
from demo import workflows as demo_workflows
from demo.models import SandboxCall
from runs import forks, submission
from runs import replay as replays
from runs.models import Receipt, Run, Step
from tests import replay_workflows
from tests.engine_helpers import REFUND, SUPPORT, approve_until, drive


def _finished_support_run(demo) -> Run:
    run = approve_until(submission.submit(workflow="support_agent", input=SUPPORT)[0], demo["reviewer"])
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


def test_the_command_replays_one_run_and_a_period(demo):
    run = _finished_support_run(demo)
    out = io.StringIO()
    call_command("replay", str(run.id), stdout=out)
    assert f"run {run.id} (recorded on v1) on support_agent v1: replays identically (12 steps)" in out.getvalue()

    out = io.StringIO()
    call_command("replay", "--workflow", "support_agent", "--since", "1h", "--json", stdout=out)
    batch = json.loads(out.getvalue())
    assert (batch["runs"], batch["identical"], batch["diverged"]) == (1, 1, 0)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((), "give either a RUN_ID, or --workflow"),
        (("00000000-0000-0000-0000-000000000000",), "no run 00000000"),
        (("not-a-uuid",), "no run not-a-uuid"),
        (("--workflow", "refund"), "--workflow needs --since"),
        (("--workflow", "refund", "--since", "yesterday"), "since: 'yesterday' is neither an age"),
        (("--workflow", "refund", "--since", "1h"), "no run of refund was created between"),
        (("--workflow", "nope", "--since", "1h"), "unknown workflow 'nope'"),
        (("--workflow", "refund", "--since", "1h", "--on-version", "9"), "has no version 9"),
    ],
)
def test_the_commands_bad_input_is_a_clear_error(db, args, error):
    with pytest.raises(CommandError, match=re.escape(error)):
        call_command("replay", *args, stdout=io.StringIO())


# --- what a step drew, versions, effects, the end ------------------------------------------------------------------


def _support_agent_stage():
    return next(s for s in demo_workflows.support.steps if s.name == "support_agent")


def _with_prompt(monkeypatch, version: str, shim: bool) -> None:
    """The support agent's prompt reworded, its prompt version `version`; `shim`: declared compatible."""
    monkeypatch.setattr(demo_workflows, "SUPPORT_PROMPT", demo_workflows.SUPPORT_PROMPT + " Be brief.")
    stage = _support_agent_stage()
    agent = dataclasses.replace(stage.agent, prompt_version=version)
    steps = [dataclasses.replace(s, agent=agent) if s is stage else s for s in demo_workflows.support.steps]
    monkeypatch.setattr(demo_workflows.support, "steps", steps)
    monkeypatch.setattr(demo_workflows.support, "shims", [])
    if shim:
        demo_workflows.support.compatible("support_agent", prompt_version="support-1")


def test_a_new_prompt_version_is_marked_and_diverges_unless_declared_compatible(demo, monkeypatch):
    run = _finished_support_run(demo)
    _with_prompt(monkeypatch, "support-2", shim=False)
    report = replays.replay(run)
    assert (report.divergence.seq, report.divergence.reason) == (0, "asks model.chat differently")
    assert report.divergence.replayed["changed"][0]["index"] == 0  # the system prompt, shown as it is now
    assert report.divergence.replayed["changed"][0]["content"].endswith("Be brief.")

    _with_prompt(monkeypatch, "support-2", shim=True)
    report = replays.replay(run)
    assert report.identical, report.summary()
    assert all(s.shimmed and s.versions == {"prompt_version": ["support-1", "support-2"]} for s in report.steps)
    assert [s.asked_differently for s in report.steps if s.kind == "compute"][0]


def test_a_shim_is_declared_on_a_step_with_a_known_version():
    with pytest.raises(ValueError, match="no step or agent stage 'nope'"):
        demo_workflows.support.compatible("nope", prompt_version="1")
    with pytest.raises(ValueError, match="unknown version code_version"):
        demo_workflows.support.compatible("support_agent", code_version="1")


def test_the_time_ids_and_recorded_values_a_run_drew_are_fed_back(db):
    run = drive(submission.submit(workflow="test_replay_drawn", input={})[0])
    assert run.status == Run.Status.SUCCEEDED
    SandboxCall.objects.create(system="crm", operation="later", run_id=run.id, payload={})  # the world moved on
    report = replays.replay(run)
    assert report.identical, report.summary()
    assert [s.fed for s in report.steps] == [3, 1]


def test_an_effect_that_would_send_something_else_diverges(db, monkeypatch):
    run = drive(submission.submit(workflow="test_replay_drawn", input={})[0])
    note = replay_workflows.drawn.steps[1]

    def says_more(ctx):
        return ctx.effect(lambda key: {"id": key}, preview={"text": "something else"})

    monkeypatch.setattr(
        replay_workflows.drawn, "steps", [replay_workflows.drawn.steps[0], dataclasses.replace(note, fn=says_more)]
    )
    report = replays.replay(run)
    assert (report.divergence.step, report.divergence.reason) == ("note", "asks effect differently")
    assert report.divergence.replayed["preview"] == {"text": "something else"}


def test_a_step_that_writes_to_the_database_is_refused_and_nothing_is_written(db):
    run = drive(submission.submit(workflow="test_replay_writes", input={})[0])
    assert run.status == Run.Status.SUCCEEDED
    before = SandboxCall.objects.count()
    report = replays.replay(run)
    assert (report.divergence.seq, report.divergence.step) == (0, "count_on_the_side")
    assert report.divergence.reason.startswith("writes to the database: cannot execute INSERT in a read-only")
    assert SandboxCall.objects.count() == before


def test_code_that_goes_on_after_the_run_ended_diverges_at_the_new_step(db, monkeypatch):
    run = drive(submission.submit(workflow="test_replay_drawn", input={})[0])
    extra = dataclasses.replace(replay_workflows.drawn.steps[0], name="afterwards")
    monkeypatch.setattr(replay_workflows.drawn, "steps", [*replay_workflows.drawn.steps, extra])
    report = replays.replay(run)
    assert (report.divergence.seq, report.divergence.step) == (2, "afterwards")
    assert report.divergence.reason == "the run ended here; the code now goes on to afterwards"


def test_a_run_recorded_before_tapes_says_so(demo):
    run = _finished_support_run(demo)
    Step.objects.filter(run=run).update(tape=None)
    report = replays.replay(run)
    assert report.divergence.seq == 0
    assert "its record holds nothing it drew: recorded before replay" in report.divergence.reason


def test_a_parked_run_replays_its_done_steps(demo):
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    assert run.status == Run.Status.WAITING_HUMAN
    report = replays.replay(run)
    assert report.identical and [s.name for s in report.steps] == [
        "classify",
        "lookup_customer",
        "draft_refund",
    ]


def test_an_external_run_and_an_undeployed_version_are_refused(demo):
    run = _finished_support_run(demo)
    Run.objects.filter(pk=run.pk).update(workflow_version=7)
    run.refresh_from_db()
    with pytest.raises(replays.NotReplayable, match="has no version 7"):
        replays.replay(run)
    Run.objects.filter(pk=run.pk).update(workflow="external")
    run.refresh_from_db()
    with pytest.raises(replays.NotReplayable, match="external agent's run"):
        replays.replay(run)


# --- a candidate with the live model (evaluate) --------------------------------------------------------------------


def test_a_live_replay_asks_the_model_again_and_counts_its_cost(demo, counted_calls):
    run = _finished_support_run(demo)
    sandbox_rows = SandboxCall.objects.count()
    counted_calls.clear()
    report = replays.replay(run, live=True)
    assert report.identical, report.summary()
    turns = Step.objects.filter(run=run, name__contains=".turn", kind="compute").count()
    assert counted_calls == ["ScriptedModel.chat"] * turns == ["ScriptedModel.chat"] * report.calls
    assert report.live_usage == report.recorded_usage  # the same questions, the same scripted answers
    assert SandboxCall.objects.count() == sandbox_rows  # what the model client wrote is rolled back


def test_a_live_replay_of_a_longer_prompt_costs_more_and_a_batch_sums_it(demo, monkeypatch):
    run = _finished_support_run(demo)
    _with_prompt(monkeypatch, "support-2", shim=False)
    report = replays.replay(run, live=True)
    assert report.identical and all(
        s.asked_differently for s in report.steps if ".turn" in s.name and s.kind == "compute"
    )
    assert report.live_usage["tokens_in"] > report.recorded_usage["tokens_in"]

    batch = replays.replay_many("support_agent", run.created_at, run.created_at + timedelta(seconds=1), live=True)
    assert (batch.runs, batch.identical, batch.calls) == (1, 1, report.calls)
    assert batch.live_usage == report.live_usage


def test_a_fork_replays_identically_its_copied_gates_from_its_originals_cards(demo):
    original = drive(submission.submit(workflow="refund", input=REFUND)[0])
    Approval.objects.get(run=original).decide(demo["reviewer"], "approve")
    original = drive(original)
    fork = drive(forks.fork(original, 4, "pay again? no: the receipts say it was paid", demo["ops"]))
    assert fork.status == Run.Status.SUCCEEDED, fork.error
    report = replays.replay(fork)
    assert report.identical, report.summary()
    assert [s.name for s in report.steps] == [s.name for s in Step.objects.filter(run=original).order_by("seq")]
