from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from guardian.models import UserObjectPermission

from approvals.models import Approval
from core.models import Channel
from runs.models import Run
from tests.engine_helpers import drive


def _state():
    return {
        "users": sorted(User.objects.values_list("username", "password", "is_superuser", "is_staff", "is_active")),
        "memberships": sorted(User.groups.through.objects.values_list("user__username", "group__name")),
        "groups": sorted(Group.objects.values_list("name", flat=True)),
        "channels": sorted(Channel.objects.values_list("name", "required_approvals", "kill_switch_engaged")),
        "object_perms": sorted(
            UserObjectPermission.objects.values_list("user__username", "permission__codename", "object_pk")
        ),
    }


def test_it_creates_the_demo_users_and_channels(db):
    call_command("demo_setup", verbosity=0)
    assert set(Channel.objects.values_list("name", flat=True)) == {"payments", "email", "crm"}
    reviewer, ops, admin, outsider = (User.objects.get(username=n) for n in ("reviewer", "ops", "admin", "outsider"))
    for channel in Channel.objects.all():
        assert reviewer.has_perm("core.approve_channel", channel)
        assert not reviewer.has_perm("core.operate_channel", channel)
        assert ops.has_perm("core.operate_channel", channel)
        assert not ops.has_perm("core.approve_channel", channel)
        assert not outsider.has_perm("core.approve_channel", channel)
    assert admin.is_superuser and admin.groups.filter(name="admin").exists()
    assert reviewer.check_password("demo")
    assert User.objects.filter(username="agent").exists()


def test_running_it_twice_gives_the_same_state(db):
    call_command("demo_setup", verbosity=0)
    first = _state()
    call_command("demo_setup", verbosity=0)
    assert _state() == first


def test_it_restores_a_changed_demo_password(db, settings):
    call_command("demo_setup", verbosity=0)
    settings.DEMO_PASSWORD = "another"
    call_command("demo_setup", verbosity=0)
    assert User.objects.get(username="reviewer").check_password("another")


def test_outside_development_it_refuses_the_default_password(db, settings):
    settings.DEVELOPMENT = False
    with pytest.raises(CommandError, match="set DEMO_PASSWORD to a password of your own"):
        call_command("demo_setup", verbosity=0)
    assert not User.objects.filter(username="reviewer").exists()


def test_outside_development_it_runs_with_a_password_of_the_operators(db, settings):
    """A stack's demo (compose.yaml with DEMO_ENABLED=1): the users get the operator's password, not 'demo'."""
    settings.DEVELOPMENT = False
    settings.DEMO_PASSWORD = "the operator's own"
    call_command("demo_setup", verbosity=0)
    reviewer = User.objects.get(username="reviewer")
    assert reviewer.check_password("the operator's own") and not reviewer.check_password("demo")


def test_ops_can_reach_the_dead_letter_queue_in_admin(client, db):
    call_command("demo_setup", verbosity=0)
    client.force_login(User.objects.get(username="ops"))
    assert client.get("/admin/jobs/deadletter/").status_code == 200
    assert client.get("/admin/core/channel/").status_code == 403  # staff, but not an admin


def test_the_make_run_seed_has_both_demo_workflows_with_cards_in_the_inbox(client, db):
    """What `serve` (make run) seeds a new database with: refund and support_agent runs, whose cards a reviewer
    finds in the inbox once the worker has driven them."""
    call_command("demo_setup", verbosity=0)
    call_command("demo_traffic", runs=8, seed=1, workflow="all", verbosity=0)
    assert sorted(Run.objects.values_list("workflow", flat=True)) == ["refund"] * 4 + ["support_agent"] * 4
    for run in Run.objects.all():
        drive(run)
    agent_runs = Run.objects.filter(workflow="support_agent")
    assert set(agent_runs.values_list("status", flat=True)) == {Run.Status.WAITING_HUMAN}  # a refund or an email
    cards = Approval.objects.filter(workflow="support_agent", status="pending")
    assert cards.count() == 4 and {c.rule_id for c in cards} <= {"tool:refund_order", "tool:send_email"}
    client.force_login(User.objects.get(username="reviewer"))
    inbox = client.get("/").content.decode()
    for card in cards:
        assert f"/approvals/{card.pk}/" in inbox


def test_demo_traffic_submits_refunds_by_default(db):
    call_command("demo_traffic", runs=3, seed=2, no_gates=True, verbosity=0)
    assert set(Run.objects.values_list("workflow", flat=True)) == {"refund"}
