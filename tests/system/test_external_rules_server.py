"""An external agent under every rule, against the production web server (issue 24, defects 1-4): the agent, the
reviewers and ops talk to the console only over HTTP with their tokens. The deadline case runs with no worker at
all: nothing but the decision itself can apply the card's expiry. Each case answered "go" on the code before the
one door of cards and effects."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from guardian.shortcuts import assign_perm

from approvals.models import Approval, ApprovalPolicy, PolicyStage
from core.models import Channel
from tests.system.conftest import Api, _token
from tests.system.test_external_agents import ARGUMENTS, ask, digest

pytestmark = pytest.mark.slow


def decide(api: Api, card_id: int, decision: str = "approve"):
    (card,) = [c for c in api.get("/api/approvals?status=all").body if c["id"] == card_id]
    return api.post(f"/api/approvals/{card_id}/decision", {"decision": decision, "version": card["version"]})


def consume(system, request: dict, arguments=ARGUMENTS):
    return system.agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(arguments)})


def status(system, request: dict) -> str:
    return system.agent.get(f"/api/approval-requests/{request['id']}").body["status"]


def test_a_two_person_policy_holds_for_an_external_request(system):
    policy = ApprovalPolicy.objects.create(name="two-people", channel=Channel.objects.get(name="payments"))
    PolicyStage.objects.create(policy=policy, name="two", quorum=2, channel_approvers=True)
    request = ask(system, "policy-1")
    assert decide(system.reviewer, request["card_id"]).status == 200
    assert status(system, request) == "pending"
    refused = consume(system, request)
    assert refused.status == 409 and refused.body["error"] == "not_approved", refused
    assert decide(system.second_reviewer, request["card_id"]).status == 200
    assert status(system, request) == "approved"
    assert consume(system, request).body["go"] is True


def test_a_cancelled_runs_approval_is_refused(system):
    request = ask(system, "cancel-1")
    assert decide(system.reviewer, request["card_id"]).status == 200
    assert system.ops.post(f"/api/runs/{request['run_id']}/cancel", {}).status == 200
    refused = consume(system, request)
    assert refused.status == 409 and refused.body["error"] == "run_ended", refused


def test_a_late_approval_is_refused_with_no_worker_running(system):
    system.workers.stop_all()
    request = ask(system, "late-1", expires_in=60)
    # 65 seconds on: the card's deadline is in the past, and no timer job could have run.
    Approval.objects.filter(pk=request["card_id"]).update(due_at=timezone.now() - timedelta(seconds=5))
    late = decide(system.reviewer, request["card_id"])
    assert late.status == 409 and late.body["error"] == "expired", late
    assert status(system, request) == "expired"
    assert consume(system, request).status == 409


def test_approval_never_follows_shadow_mode_and_a_superuser_needs_the_grant(system):
    crm = Channel.objects.get(name="crm")
    admin = Api(system.url, _token("admin"), "admin")
    assign_perm("core.request_channel", User.objects.get(username="admin"), crm)
    never = {"channel": "crm", "action": "add_note", "arguments": {"text": "hi"}, "approval": "never"}
    refused = admin.post("/api/approval-requests", {**never, "idempotency_key": "su-1"})
    assert refused.status == 403, refused

    assign_perm("core.act_unreviewed", User.objects.get(username="agent"), crm)
    Channel.objects.filter(pk=crm.pk).update(shadow=True)
    request = ask(system, "never-1", **never)
    go = consume(system, request, {"text": "hi"})
    assert go.status == 200 and go.body["go"] is False and go.body["shadow"] is True, go
