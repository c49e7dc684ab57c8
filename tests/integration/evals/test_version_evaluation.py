"""Evaluating a candidate workflow or prompt version (evals.versions, issue 28 item 3): the recorded support_agent
runs of a period replayed on a version 2 whose prompt is reworded, with the recorded answers (they diverge at the
first turn: the model was asked something else) and with the model asked again (the same answers, a longer prompt:
identical, and the tokens and cost it adds); the command, the API and the page; bad input with nothing saved."""

from __future__ import annotations

import dataclasses
import io
import json
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from core.models import AuditEntry
from demo import workflows as demo_workflows
from evals.errors import CandidateInvalid, EmptyPeriod
from evals.models import Evaluation
from runs import submission
from runs import workflow as workflows
from runs.models import Run
from tests.engine_helpers import SUPPORT, approve_until
from tests.integration.runs.test_undo_api import bearer


def _finished(demo, customer: str) -> Run:
    run = submission.submit(workflow="support_agent", input={**SUPPORT, "customer_id": customer})[0]
    run = approve_until(run, demo["reviewer"])
    assert run.status == Run.Status.SUCCEEDED, run.error
    return run


@pytest.fixture
def recorded(demo):
    """Two finished support_agent runs and one still queued (not replayable), then a version 2 deployed whose
    prompt says one sentence more (prompt_version support-2)."""
    runs = [_finished(demo, "cus_1042"), _finished(demo, "cus_2077")]
    queued = submission.submit(workflow="support_agent", input=SUPPORT)[0]
    return runs, queued


@pytest.fixture
def version_2(monkeypatch):
    v1 = demo_workflows.support
    stage = next(s for s in v1.steps if s.name == "support_agent")

    def opening(ctx):
        messages = stage.fn(ctx)
        return [{**messages[0], "content": messages[0]["content"] + " Always thank the customer."}, *messages[1:]]

    agent = dataclasses.replace(stage.agent, prompt_version="support-2")
    v2 = workflows.Workflow(
        "support_agent",
        version=2,
        input_schema=v1.input_schema,
        steps=[dataclasses.replace(stage, fn=opening, agent=agent)],
    )
    monkeypatch.setitem(workflows._registry["support_agent"], 2, v2)
    return v2


def _period():
    now = timezone.now()
    return now - timedelta(hours=1), now + timedelta(seconds=1)


def test_with_the_recorded_answers_every_run_diverges_at_the_first_turn(demo, recorded, version_2):
    evaluation = Evaluation.of_version({"workflow": "support_agent", "version": 2}, *_period())
    f = evaluation.figures
    assert (f["runs"], f["identical"], f["diverged"], f["unreplayable_runs"]) == (2, 0, 2, 1)
    assert f["diverged_at"] == {"support_agent.turn1": 2}
    assert f["reasons"] == {"asks model.chat differently": 2}
    assert f["unreplayable"] == {"the run is queued": 1}
    assert f["versions_changed"] == 2 and f["changed_proposals"] == 0 and f["calls"] == 0
    assert "delta" not in f
    assert {e["run"] for e in f["examples"]} == {str(r.id) for r in recorded[0]}
    assert evaluation.pk is None  # saved by the caller (save_audited), not here


def test_with_the_live_model_the_runs_replay_and_the_longer_prompt_costs_more(demo, recorded, version_2):
    evaluation = Evaluation.of_version({"workflow": "support_agent", "version": 2, "model": "live"}, *_period())
    f = evaluation.figures
    assert (f["runs"], f["identical"], f["diverged"]) == (2, 2, 0)
    turns = sum(r.steps.filter(name__contains=".turn", kind="compute").count() for r in recorded[0])
    assert f["calls"] == turns
    recorded_tokens = sum(r.tokens_in for r in Run.objects.filter(pk__in=[r.pk for r in recorded[0]]))
    assert f["recorded_usage"]["tokens_in"] == recorded_tokens
    # " Always thank the customer." is 27 characters in every turn's request: about 6 tokens more a turn.
    assert f["delta"]["tokens_in"] == f["live_usage"]["tokens_in"] - recorded_tokens > 0
    assert f["delta"]["tokens_out"] == 0 and float(f["delta"]["cost"]) > 0
    assert evaluation.headline["cost_delta"] == f["delta"]["cost"]


def test_the_command_saves_it_and_prints_where_runs_diverge(demo, recorded, version_2):
    out = io.StringIO()
    call_command("evaluate", "--workflow", "support_agent", "--candidate-version", "2", "--since", "1h", stdout=out)
    text = out.getvalue()
    assert "Runs replayed: 2; identical: 0; diverged: 2; not replayable: 1" in text
    assert "  diverged at support_agent.turn1: 2" in text
    evaluation = Evaluation.objects.get()
    assert (evaluation.kind, evaluation.name) == ("version", "support_agent v2, model replayed")
    assert evaluation.candidate == {"workflow": "support_agent", "version": 2, "model": "replayed"}
    assert AuditEntry.objects.filter(action="evaluation.create", target=f"evaluation:{evaluation.pk}").exists()


@pytest.mark.parametrize(
    ("candidate", "error"),
    [
        ({"workflow": "nope", "version": 2}, "$.workflow: unknown workflow 'nope'"),
        ({"workflow": "support_agent", "version": 9}, "$.version: workflow 'support_agent' has no version 9"),
        ({"workflow": "support_agent", "version": "2"}, "$.version: a version number"),
        ({"workflow": "support_agent", "version": 2, "model": "gpt"}, "$.model: 'gpt' is not one of replayed, live"),
        ({"workflow": "support_agent", "version": 2, "extra": 1}, "$.extra: unknown key"),
    ],
)
def test_a_bad_candidate_is_refused_naming_its_path(demo, version_2, candidate, error):
    with pytest.raises(CandidateInvalid) as refused:
        Evaluation.of_version(candidate, *_period())
    assert any(e.startswith(error) for e in refused.value.errors), refused.value.errors


def test_an_empty_period_is_refused_and_nothing_is_saved(demo, recorded, version_2):
    with pytest.raises(EmptyPeriod, match="no run of support_agent created between .* can be replayed"):
        Evaluation.of_version(
            {"workflow": "support_agent", "version": 2}, timezone.now(), timezone.now() + timedelta(1)
        )
    with pytest.raises(CommandError, match="can be replayed"):
        call_command(
            "evaluate",
            "--workflow",
            "support_agent",
            "--candidate-version",
            "2",
            "--since",
            "3h",
            "--until",
            "2h",
            stdout=io.StringIO(),
        )
    with pytest.raises(CommandError, match="needs --candidate-version"):
        call_command("evaluate", "--workflow", "support_agent", "--since", "1h", stdout=io.StringIO())
    assert not Evaluation.objects.exists()


def test_the_api_and_the_page(demo, recorded, version_2):
    client = Client()
    body = {"candidate": {"workflow": "support_agent", "version": 2, "model": "live"}, "since": "1h"}
    response = client.post(
        "/api/evaluations", json.dumps(body), content_type="application/json", headers=bearer(demo["ops"])
    )
    assert response.status_code == 201, response.content
    created = response.json()
    assert created["kind"] == "version" and created["headline"]["identical"] == 2
    bad = {**body, "candidate": {"workflow": "support_agent", "version": 9}}
    response = client.post(
        "/api/evaluations", json.dumps(bad), content_type="application/json", headers=bearer(demo["ops"])
    )
    assert response.status_code == 400 and Evaluation.objects.count() == 1

    client.force_login(demo["ops"])
    page = client.get(f"/evaluations/{created['id']}/").content.decode()
    assert 'data-figure="identical">2<' in page and "cost" in page
    listing = client.get("/evaluations/").content.decode()
    assert f'data-version="{created["id"]}">2 of 2 runs replay identically' in listing
