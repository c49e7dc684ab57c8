"""Forking a recorded run from a step (issue 28, runs.forks), driven in the test process as the worker's job drives
it (engine.advance): what a fork reuses, shares and runs live, the refusals with nothing written, and its doors
(POST /api/runs/{id}/fork, the run page's form). With a real worker: tests/system/test_forks.py."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.test import Client
from procrastinate.contrib.django.models import ProcrastinateJob

from approvals.models import Approval
from core.models import ApiToken, AuditEntry
from demo import sandbox
from demo.models import SandboxCall
from runs import compensations, forks, submission
from runs.errors import ForkRefused
from runs.models import EXTERNAL_WORKFLOW, Receipt, Run, Step
from tests.engine_helpers import REFUND, drive, queued_jobs, support_parked_at_the_email

GATE = 3  # refund: classify, lookup_customer, draft_refund, approve_refund (the gate), issue_refund, notify_customer
REASON = "the policy now forbids this refund without a second look"


def _paid_refund(demo) -> Run:
    """A refund run to its end: approved by the reviewer, paid once, the customer told."""
    run = drive(submission.submit(workflow="refund", input=REFUND, created_by=demo["agent"])[0])
    Approval.objects.get(run=run).decide(demo["reviewer"], "approve")
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED, run.error
    return run


def _payments() -> int:
    """Refunds paid (a reversal is a payments call too: not counted)."""
    calls = SandboxCall.objects.filter(system="payments", applied=True)
    return calls.exclude(payload__has_key="reverses").count()


def _counts() -> tuple:
    """What a refused fork must leave as it was."""
    return (
        Run.objects.count(),
        Step.objects.count(),
        Approval.objects.count(),
        ProcrastinateJob.objects.count(),
        AuditEntry.objects.filter(action__in=("run.fork", "run.forked")).count(),
    )


def _sandbox_stats() -> dict:
    out = io.StringIO()
    call_command("sandbox_stats", stdout=out)
    return json.loads(out.getvalue())


# --- the promise: a fork from the gate after the payment pays nothing again -----------------------------------------


def test_a_fork_from_the_gate_after_the_payment_opens_a_new_card_and_pays_nothing_again(demo):
    original = _paid_refund(demo)
    assert _payments() == 1

    fork = forks.fork(original, GATE, REASON, demo["ops"])

    assert (fork.status, fork.cursor, fork.fork_of_id, fork.fork_from_step) == ("queued", GATE, original.id, GATE)
    assert fork.effects_of == original.id and fork.effects_root == original.id
    assert (fork.workflow, fork.workflow_version, fork.input, fork.tenant) == (
        original.workflow,
        original.workflow_version,
        original.input,
        original.tenant,
    )
    assert fork.created_by == demo["ops"] and fork.fork_reason == REASON and queued_jobs(fork) == 1
    copied = list(fork.steps.order_by("seq"))
    recorded = list(original.steps.order_by("seq"))[:GATE]
    assert [(s.seq, s.name, s.output, s.input_hash, s.status) for s in copied] == [
        (s.seq, s.name, s.output, s.input_hash, s.status) for s in recorded
    ]
    assert all(s.cost == 0 and s.tokens_in == 0 for s in copied)  # their cost is the original's
    entry = AuditEntry.objects.get(run_id=fork.id, action="run.fork")
    assert entry.actor == "ops"
    assert entry.data == {"fork_of": str(original.id), "from_step": GATE, "step": "approve_refund", "reason": REASON}
    assert AuditEntry.objects.get(run_id=original.id, action="run.forked").data["fork"] == str(fork.id)

    fork = drive(fork)
    assert fork.status == Run.Status.WAITING_HUMAN
    card = Approval.objects.get(run=fork)  # a new card, the fork's own
    assert card.status == "pending" and card.step_seq == GATE
    assert model_calls_of(fork) == 0  # the draft was reused, not asked of the model again

    card.decide(demo["reviewer"], "approve")
    fork = drive(fork)

    assert fork.status == Run.Status.SUCCEEDED, fork.error
    assert _payments() == 1  # the original's payment, found done by its receipt's key
    assert SandboxCall.objects.filter(system="email", applied=True).count() == 1
    assert _sandbox_stats()["duplicates"] == 0
    assert not Receipt.objects.filter(run=fork).exists()  # every effect it reached was the original's
    assert fork.result == original.result
    assert [s.name for s in fork.steps.order_by("seq")] == [s.name for s in original.steps.order_by("seq")]


def model_calls_of(run: Run) -> int:
    return SandboxCall.objects.filter(run_id=run.id, system="model").count()


def test_a_fork_of_a_fork_shares_the_first_runs_effects(demo):
    original = _paid_refund(demo)
    first = forks.fork(original, GATE, REASON, demo["ops"])
    drive(first)
    Approval.objects.get(run=first).decide(demo["reviewer"], "approve")
    first = drive(first)

    second = forks.fork(first, GATE, "once more", demo["ops"])

    assert second.effects_of == original.id
    drive(second)
    Approval.objects.get(run=second).decide(demo["reviewer"], "approve")
    assert drive(second).status == Run.Status.SUCCEEDED
    assert _payments() == 1 and _sandbox_stats()["duplicates"] == 0


# --- an agent's run ----------------------------------------------------------------------------------------------


def _support_parked_at_the_email(demo) -> Run:
    return support_parked_at_the_email(demo)


def _email_step(run: Run) -> Step:
    return run.steps.get(name__endswith=".send_email")


def test_an_agents_run_forked_from_its_email_opens_a_new_card_and_pays_nothing_again(demo):
    original = _support_parked_at_the_email(demo)
    assert _payments() == 1
    email = _email_step(original)

    fork = forks.fork(original, email.seq, "the email must be read again", demo["ops"])
    fork = drive(fork)

    assert fork.status == Run.Status.WAITING_HUMAN, fork.error
    card = Approval.objects.get(run=fork, status=Approval.Status.PENDING)
    assert card.step_seq == email.seq and card.proposed.get("subject")
    card.decide(demo["reviewer"], "approve")
    fork = drive(fork)
    assert fork.status == Run.Status.SUCCEEDED, fork.error
    assert _payments() == 1  # the refund before the email was reused, never paid again
    assert SandboxCall.objects.filter(system="email", applied=True).count() == 1

    # The original's email card, approved later, finds the email the fork sent by its key: not sent twice.
    Approval.objects.get(run=original, status=Approval.Status.PENDING).decide(demo["reviewer"], "approve")
    original = drive(original)
    assert original.status == Run.Status.SUCCEEDED, original.error
    assert SandboxCall.objects.filter(system="email", applied=True).count() == 1
    assert _sandbox_stats()["duplicates"] == 0


# --- refusals, nothing written -------------------------------------------------------------------------------------


def _refused(run: Run, from_step: int, match: str, reason: str = REASON, by=None):
    before = _counts()
    with pytest.raises(ForkRefused, match=match):
        forks.fork(run, from_step, reason, by)
    assert _counts() == before


def test_a_step_the_run_does_not_have_is_refused_naming_its_steps(demo):
    run = _paid_refund(demo)
    _refused(run, 6, r"has no step 6; its recorded steps are: 0 \(classify\), .*5 \(notify_customer\)")


def test_a_run_whose_record_still_moves_is_refused(demo):
    queued = submission.submit(workflow="refund", input=REFUND)[0]
    Step.objects.create(
        run=queued, seq=0, name="classify", kind="compute", input_hash="x", started_at=queued.created_at
    )
    _refused(queued, 0, "the run is queued: its record still moves")
    for status, owner in ((Run.Status.RUNNING, "a-job"), (Run.Status.COMPENSATING, "a-job")):
        Run.objects.filter(pk=queued.pk).update(status=status, owner=owner, undo_reason="cancelled")
        queued.refresh_from_db()
        _refused(queued, 0, f"the run is {status}")


def test_an_external_agents_run_is_refused(demo):
    run = Run.objects.create(workflow=EXTERNAL_WORKFLOW, workflow_version=1, input={}, status=Run.Status.EXTERNAL)
    _refused(run, 0, "external agent's run cannot be forked")


@pytest.mark.parametrize(
    ("reason", "match"), [("", "needs a reason"), ("   ", "needs a reason"), ("x" * 501, "too long")]
)
def test_a_bad_reason_is_refused(demo, reason, match):
    _refused(_paid_refund(demo), GATE, match, reason=reason)


def test_a_step_before_that_is_not_done_is_refused(demo):
    run = _paid_refund(demo)
    Step.objects.filter(run=run, seq=1).update(status=Step.Status.FAILED)
    _refused(run, GATE, r"step 1 \(lookup_customer, failed\) before step 3 is not done")


def test_a_version_no_longer_deployed_is_refused(demo):
    run = _paid_refund(demo)
    Run.objects.filter(pk=run.pk).update(workflow_version=99)
    run.refresh_from_db()
    _refused(run, GATE, "not deployed.*no version 99")


def _compensated_refund(demo) -> Run:
    """A refund paid, then its email failed for good; the refund reversed on a person's yes: compensated."""
    run = drive(submission.submit(workflow="refund", input={**REFUND, "faults": {"notify_customer": ["fatal"]}})[0])
    Approval.objects.get(run=run, kind="action").decide(demo["reviewer"], "approve")
    run = drive(run)
    for _ in range(2):  # undo it? then the reversal itself
        Approval.objects.get(run=run, kind="undo", status=Approval.Status.PENDING).decide(demo["reviewer"], "approve")
        run = drive(run)
    assert run.status == Run.Status.COMPENSATED, (run.status, run.error)
    return run


def test_a_fork_of_a_compensated_run_past_its_compensation_point_is_refused(demo):
    run = _compensated_refund(demo)
    assert forks.compensation_point(run) == (4, "issue_refund")
    _refused(run, 5, r"past its compensation point: its effect issue_refund \(step 4\) .*fork from step 4 or before")


def test_a_fork_before_the_compensation_point_makes_the_undone_effect_anew(demo):
    """The original's refund was reversed: its receipt is no longer there to share, so the fork pays under its own
    key (a new payment, not a duplicate), once its card is approved."""
    run = _compensated_refund(demo)
    fork = drive(forks.fork(run, GATE, REASON, demo["ops"]))
    Approval.objects.get(run=fork, kind="action").decide(demo["reviewer"], "approve")
    drive(fork)
    paid = Receipt.objects.get(run=fork, channel="payments")
    assert paid.key == f"{fork.id}:4:issue_refund" and paid.status == "done"
    assert _payments() == 2 and sandbox.stats()["duplicates"] == 0


def test_a_parked_undo_makes_its_effects_a_compensation_point(demo):
    original = _support_parked_at_the_email(demo)
    compensations.cancel_and_undo(original, demo["ops"])
    original = drive(original)  # parked on the reversal's card
    assert original.status == Run.Status.WAITING_HUMAN and original.undo_reason == "cancelled"
    email = _email_step(original)
    _refused(original, email.seq, "past its compensation point")


# --- the API ------------------------------------------------------------------------------------------------------


def bearer(user) -> dict:
    _, raw = ApiToken.issue(user)
    return {"Authorization": f"Bearer {raw}"}


def post_fork(client, run_id, headers: dict, body: dict):
    return client.post(
        f"/api/runs/{run_id}/fork", data=json.dumps(body), content_type="application/json", headers=headers
    )


def test_the_api_forks_a_run_201_and_get_shows_the_link_both_ways(client, demo):
    run = _paid_refund(demo)
    ops = bearer(demo["ops"])

    response = post_fork(client, run.id, ops, {"from_step": GATE, "reason": REASON})

    assert response.status_code == 201, response.content
    body = response.json()
    fork = Run.objects.get(fork_of=run)
    assert response["Location"] == f"/api/runs/{fork.id}"
    assert body["id"] == str(fork.id) and body["status"] == "queued"
    assert (body["fork_of"], body["fork_from_step"], body["fork_reason"]) == (str(run.id), GATE, REASON)
    assert body["steps_done"] == GATE and body["current_step"] == "approve_refund" and body["forks"] == []
    original = client.get(f"/api/runs/{run.id}", headers=ops).json()
    assert original["forks"] == [str(fork.id)] and original["fork_of"] is None and original["fork_reason"] == ""


def test_the_api_refuses_with_409_403_404_and_422_making_nothing(client, demo):
    run = _paid_refund(demo)
    before = _counts()
    ops = bearer(demo["ops"])
    missing = post_fork(client, run.id, ops, {"from_step": 42, "reason": REASON})
    assert missing.status_code == 409 and "has no step 42" in missing.json()["detail"]
    assert post_fork(client, run.id, bearer(demo["reviewer"]), {"from_step": GATE, "reason": "r"}).status_code == 403
    assert post_fork(client, run.id, bearer(demo["agent"]), {"from_step": GATE, "reason": "r"}).status_code == 403
    assert post_fork(client, run.id, bearer(demo["outsider"]), {"from_step": GATE, "reason": "r"}).status_code == 404
    unknown = "00000000-0000-0000-0000-000000000000"
    assert post_fork(client, unknown, ops, {"from_step": GATE, "reason": "r"}).status_code == 404
    for body in (
        {"from_step": -1, "reason": "r"},
        {"from_step": 1, "reason": ""},
        {"from_step": 1},
        {"reason": "r"},
        {"from_step": "1", "reason": "r"},  # the document says an integer: a string is not taken for one
        {"from_step": 1, "reason": 7},
    ):
        assert post_fork(client, run.id, ops, body).status_code == 422, body
    assert post_fork(client, run.id, ops, {"from_step": 1, "reason": "r", "extra": 1}).status_code == 422
    assert post_fork(client, run.id, ops, {"from_step": 1, "reason": "x" * 501}).status_code == 422
    assert _counts() == before


# --- the run page -------------------------------------------------------------------------------------------------


def page_of(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_run_page_forks_a_run_for_ops_and_shows_the_link(demo):
    run = _paid_refund(demo)
    client = page_of(demo["ops"])
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'data-testid="fork-form"' in html and 'value="3">#3 approve_refund' in html

    response = client.post(f"/runs/{run.pk}/fork", {"from_step": str(GATE), "reason": REASON}, follow=True)

    fork = Run.objects.get(fork_of=run)
    assert response.redirect_chain == [(f"/runs/{fork.pk}/", 302)]
    html = response.content.decode()
    assert 'data-testid="fork-of"' in html and f"/runs/{run.pk}/" in html and REASON in html
    assert "from step 3" in html
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'data-testid="forks"' in html and f"/runs/{fork.pk}/" in html


def test_the_run_page_says_why_a_fork_is_refused(demo):
    run = _paid_refund(demo)
    before = _counts()
    response = page_of(demo["ops"]).post(f"/runs/{run.pk}/fork", {"from_step": "9", "reason": "r"}, follow=True)
    assert response.redirect_chain == [(f"/runs/{run.pk}/", 302)]
    assert "Not forked: the run has no step 9" in response.content.decode()
    response = page_of(demo["ops"]).post(f"/runs/{run.pk}/fork", {"from_step": "", "reason": "r"}, follow=True)
    assert "Not forked: choose the step" in response.content.decode()
    assert _counts() == before


def test_no_fork_form_for_a_reviewer_who_cannot_post_one_either(demo):
    run = _paid_refund(demo)
    reviewer = page_of(demo["reviewer"])
    html = reviewer.get(f"/runs/{run.pk}/").content.decode()
    assert 'data-testid="fork-form"' not in html
    before = _counts()
    assert reviewer.post(f"/runs/{run.pk}/fork", {"from_step": "3", "reason": "r"}).status_code == 403
    assert _counts() == before
