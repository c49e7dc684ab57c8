"""In Chromium: ops replay a finished refund on the code deployed now from its page (it replays identically, 0 calls),
fork it from its gate with a reason (the fork's page says whose fork it is, and its new card waits), and read the
evaluations page, where a candidate rule saved by `manage.py evaluate` is listed. The engine is driven in the test
process (tests.engine_helpers.drive)."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from playwright.sync_api import expect

from approvals.models import Approval
from demo.models import SandboxCall
from runs import submission
from runs.models import Run
from tests.conftest import log_in, set_production_password
from tests.engine_helpers import REFUND, approve_until


@pytest.fixture
def ops(reviewer):
    user = User.objects.get(username="ops")
    set_production_password(user)
    return user


def test_ops_replay_fork_and_read_an_evaluation(console_server, page, reviewer, ops):
    run = approve_until(submission.submit(workflow="refund", input=REFUND)[0], reviewer)
    assert run.status == Run.Status.SUCCEEDED
    calls = SandboxCall.objects.count()
    log_in(page, console_server, "ops")
    page.goto(f"{console_server.url}/runs/{run.pk}/")

    page.get_by_test_id("replay").click()

    expect(page.get_by_test_id("replay-summary")).to_contain_text("refund v1: replays identically (6 steps)")
    expect(page.get_by_test_id("replay-summary")).to_contain_text("0 calls made outside")
    assert SandboxCall.objects.count() == calls

    form = page.get_by_test_id("fork-form")
    form.locator("select").select_option("3")  # approve_refund, the gate
    form.locator("input[name=reason]").fill("the new policy wants a second look at refunds")
    form.locator("button[type=submit]").click()

    expect(page.get_by_test_id("fork-of")).to_contain_text("from step 3: the new policy wants a second look")
    fork = Run.objects.get(fork_of=run)
    assert page.url.endswith(f"/runs/{fork.pk}/")

    call_command("evaluate", "--auto-approve-under", "20000", "--since", "1h", stdout=io.StringIO())
    page.goto(f"{console_server.url}/evaluations/")
    expect(page.locator("tr.evaluation-row")).to_have_count(1)
    page.locator("tr.evaluation-row a").click()
    expect(page.locator("[data-figure=dangerous]")).to_have_text("0")
    assert not Approval.objects.filter(run=fork).exists()  # its job has not run: the card comes when it does
