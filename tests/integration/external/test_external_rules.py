"""An external agent's request under every rule of the engine's door (issue 24, defects 2, 3, 4 and 9), through the
API: a cancelled run's approval is never used; a deadline holds when no timer job ran; `approval: never` follows
shadow mode and needs an explicit grant (never superuser alone); an approval nobody used in time goes stale.
Each of these tests failed on the code before the one door (the status it saw is said by each)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.utils import timezone
from guardian.shortcuts import assign_perm

from approvals.models import Approval
from core.models import AuditEntry, Channel
from external.models import ActionRequest
from runs.models import Receipt, ShadowEffect
from tests.integration.external.test_external_requests import REFUND, Api, ask, decide, digest, nothing_written


@pytest.fixture
def agent(client, demo):
    return Api(client, demo["agent"])


@pytest.fixture
def reviewer(client, demo):
    return Api(client, demo["reviewer"])


def consume(agent, request, arguments=REFUND):
    return agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(arguments)})


def test_an_approved_request_of_a_cancelled_run_never_says_go(agent, reviewer, demo, client):
    """Was: 200 go: true after the cancel."""
    request = ask(agent)[1]
    assert decide(reviewer, request["card_id"], "approve")[0] == 200
    assert Api(client, demo["ops"]).post(f"/api/runs/{request['run_id']}/cancel", {})[0] == 200
    code, body = consume(agent, request)
    assert code == 409 and body["error"] == "run_ended", body
    assert nothing_written(request["id"])


def test_a_decision_after_expires_in_is_refused_and_the_request_reads_expired_with_no_worker(agent, reviewer):
    """No worker and no timer job run here: `expires_in` 60 s, decided 65 s later (the deadline moved into the
    past stands for the time passed). Was: the decision 200, the request `approved`, consume `go`."""
    request = ask(agent, expires_in=60)[1]
    past = timezone.now() - timedelta(seconds=5)
    Approval.objects.filter(pk=request["card_id"]).update(due_at=past)
    ActionRequest.objects.filter(pk=request["id"]).update(expires_at=past)
    code, body = decide(reviewer, request["card_id"], "approve")
    assert code == 409 and body["error"] == "expired", body
    assert Approval.objects.get(pk=request["card_id"]).status == Approval.Status.EXPIRED
    assert AuditEntry.objects.filter(action="sla.expire", approval_id=request["card_id"]).count() == 1
    assert agent.get(f"/api/approval-requests/{request['id']}")[1]["status"] == "expired"
    assert consume(agent, request)[0] == 409 and nothing_written(request["id"])


def test_a_get_past_the_deadline_says_expired_never_pending(agent):
    """Was: `pending` until a worker ran the card's timer."""
    request = ask(agent, expires_in=60)[1]
    past = timezone.now() - timedelta(seconds=1)
    Approval.objects.filter(pk=request["card_id"]).update(due_at=past)
    assert agent.get(f"/api/approval-requests/{request['id']}")[1]["status"] == "expired"


def test_approval_never_on_a_shadow_channel_is_recorded_not_run(agent, demo):
    """Was: go: true, shadow: false."""
    crm = Channel.objects.get(name="crm")
    assign_perm("core.act_unreviewed", demo["agent"], crm)
    Channel.objects.filter(pk=crm.pk).update(shadow=True)
    status, request = ask(agent, key="note", channel="crm", action="add_note", arguments={"text": "hi"}, schema=None,
                          display=None, approval="never")  # fmt: skip
    assert status == 202
    code, go = consume(agent, request, {"text": "hi"})
    assert code == 200 and go["go"] is False and go["shadow"] is True, go
    assert ShadowEffect.objects.filter(key=f"external:{request['id']}").exists()


def test_a_superuser_token_does_not_hold_act_unreviewed_unless_granted(client, demo):
    """Was: 202 (Django grants a superuser every permission)."""
    admin = demo["admin"]
    assert admin.is_superuser
    crm = Channel.objects.get(name="crm")
    assign_perm("core.request_channel", admin, crm)
    api = Api(client, admin)
    fields = {"channel": "crm", "action": "add_note", "arguments": {"t": 1}, "schema": None, "display": None}
    code, body = ask(api, key="su", approval="never", **fields)
    assert code == 403 and "act_unreviewed" in body["detail"], body
    # An explicit grant, to a group of theirs, on the channel: now it may.
    group = Group.objects.create(name="unreviewed-agents")
    admin.groups.add(group)
    assign_perm("core.act_unreviewed", group, crm)
    assert ask(api, key="su2", approval="never", **fields)[0] == 202


def test_an_approval_not_consumed_in_time_goes_stale(agent, reviewer, settings):
    """Was: consumed weeks later all the same."""
    settings.APPROVAL_CONSUME_WITHIN = 3600
    request = ask(agent)[1]
    assert decide(reviewer, request["card_id"], "approve")[0] == 200
    Approval.objects.filter(pk=request["card_id"]).update(decided_at=timezone.now() - timedelta(seconds=3601))
    code, body = consume(agent, request)
    assert code == 409 and body["error"] == "stale", body
    assert nothing_written(request["id"])
    # Within the window it is used once, as always.
    Approval.objects.filter(pk=request["card_id"]).update(decided_at=timezone.now() - timedelta(seconds=60))
    assert consume(agent, request)[0] == 200
    assert Receipt.objects.filter(key=f"external:{request['id']}").count() == 1
