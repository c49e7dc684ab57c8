"""The runs pages: /runs/ (filters, pagination), /runs/<id>/ (timeline, cards, decisions) and cancel."""

from __future__ import annotations

import re
import uuid

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.db import connection
from django.template.defaultfilters import floatformat
from django.test import Client
from django.test.utils import CaptureQueriesContext
from guardian.shortcuts import assign_perm

from approvals import sla
from approvals.models import Approval, Notification
from core.models import AuditEntry, Channel
from runs import submission
from runs.models import Run
from tests.engine_helpers import REFUND, SMALL_REFUND, drive

XSS = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'


@pytest.fixture
def world(db, alice, bob, carol, dave):
    """Bob reviews payments, Erin reviews email only, Frank starts runs, Dave has a run of his own."""
    call_command("demo_setup", verbosity=0)
    assign_perm("core.approve_channel", bob, Channel.objects.get(name="payments"))
    erin = User.objects.create_user("erin")
    assign_perm("core.approve_channel", erin, Channel.objects.get(name="email"))
    frank = User.objects.create_user("frank")
    parked = drive(submission.submit(workflow="refund", input={**REFUND, "reason": XSS}, created_by=frank)[0])
    assert parked.status == Run.Status.WAITING_HUMAN
    daves = drive(submission.submit(workflow="refund", input=SMALL_REFUND, created_by=dave)[0])
    assert daves.status == Run.Status.SUCCEEDED
    users = {"alice": alice, "bob": bob, "carol": carol, "dave": dave, "erin": erin, "frank": frank}
    return {"users": users, "parked": parked, "daves": daves}


def as_user(user) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


def listed(response) -> set[str]:
    html = response.content.decode()
    return {
        str(run.pk)
        for run in Run.objects.all()
        if f'data-run="{run.pk}"' in html  # one row per run
    }


VISIBLE = {
    # who: (sees the parked run with a payments card, sees Dave's own run)
    "alice": (True, True),  # admin
    "carol": (True, True),  # ops
    "bob": (True, False),  # reviewer of the card's channel
    "erin": (False, False),  # reviewer of another channel
    "frank": (True, False),  # started the parked run
    "dave": (False, True),  # outsider: only his own run
}


@pytest.mark.parametrize("who", VISIBLE)
def test_it_shows_each_user_the_runs_they_may_see(world, who):
    client = as_user(world["users"][who])
    sees_parked, sees_daves = VISIBLE[who]
    response = client.get("/runs/")
    assert response.status_code == 200
    expected = {str(world["parked"].pk)} if sees_parked else set()
    expected |= {str(world["daves"].pk)} if sees_daves else set()
    assert listed(response) == expected
    detail = client.get(f"/runs/{world['parked'].pk}/")
    assert detail.status_code == (200 if sees_parked else 404)
    assert client.get(f"/runs/{world['daves'].pk}/").status_code == (200 if sees_daves else 404)


def test_anonymous_is_sent_to_the_login_page(world):
    for url in ("/runs/", f"/runs/{world['parked'].pk}/"):
        response = Client().get(url)
        assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    response = Client().post(f"/runs/{world['parked'].pk}/cancel")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    assert Run.objects.get(pk=world["parked"].pk).status == Run.Status.WAITING_HUMAN


def test_an_unknown_run_is_404(world):
    assert as_user(world["users"]["alice"]).get("/runs/00000000-0000-0000-0000-000000000000/").status_code == 404


def test_filters_by_status_and_workflow(world):
    client = as_user(world["users"]["carol"])
    assert listed(client.get("/runs/?status=waiting_human")) == {str(world["parked"].pk)}
    assert listed(client.get("/runs/?status=succeeded")) == {str(world["daves"].pk)}
    assert listed(client.get("/runs/?status=failed")) == set()
    assert listed(client.get("/runs/?workflow=refund")) == {str(world["parked"].pk), str(world["daves"].pk)}
    assert listed(client.get("/runs/?workflow=nope")) == set()
    assert listed(client.get("/runs/?status=bogus")) == listed(client.get("/runs/"))  # ignored, not a 500


def test_it_pages_newest_first(world):
    for i in range(60):
        Run.objects.create(workflow="refund", workflow_version=1, input={"i": i}, tenant=f"t{i}")
    client = as_user(world["users"]["alice"])
    response = client.get("/runs/")
    first = response.content.decode()
    assert first.count("data-run=") == 50 and ">t59<" in first and 'rel="next"' in first
    older = response.context["older"]
    second = client.get("/runs/", {"before": older}).content.decode()
    assert second.count("data-run=") == 12 and 'rel="first"' in second and 'rel="next"' not in second
    assert not set(re.findall(r'data-run="([^"]+)"', first)) & set(re.findall(r'data-run="([^"]+)"', second))
    status_page = client.get("/runs/", {"status": "queued", "before": older}).content.decode()
    assert "status=queued" in status_page  # the filter is kept in the page links
    for bad in ("nonsense", "2026-01-01~not-a-uuid", "2026-01-01T00:00:00~" + str(uuid.uuid4())):
        assert client.get("/runs/", {"before": bad}).status_code == 200  # the first page, not a 500


def test_a_page_of_runs_costs_the_same_queries_however_many_there_are(world):
    client = as_user(world["users"]["bob"])
    client.get("/runs/")
    with CaptureQueriesContext(connection) as few:
        client.get("/runs/")
    for i in range(120):
        Run.objects.create(workflow="refund", workflow_version=1, input={"i": i}, tenant=f"t{i}")
    with CaptureQueriesContext(connection) as many:
        client.get("/runs/")
    assert len(many) == len(few)
    assert not any("COUNT(" in q["sql"] for q in many.captured_queries)


def test_the_run_page_shows_its_timeline_card_and_decisions(world):
    run = world["parked"]
    card = Approval.objects.get(run=run)
    card.decide(world["users"]["bob"], "reject", comment="Wrong customer", reason="wrong_recipient")
    run = drive(run)
    html = as_user(world["users"]["bob"]).get(f"/runs/{run.pk}/").content.decode()
    for name in ("classify", "lookup_customer", "draft_refund", "approve_refund"):
        assert name in html
    step = run.steps.get(name="classify")
    assert f"{floatformat(step.latency_ms, 1)} ms" in html  # rounded as the template rounds (half up)
    assert f"{step.tokens_in}/{step.tokens_out} tokens" in html
    assert "<details><summary>output</summary>" in html
    assert f'href="/approvals/{card.pk}/"' in html
    assert "Wrong customer" in html and "wrong_recipient" in html and ">bob<" in html
    assert "Result" in html and "rejected" in html
    assert "Cancel run" not in html  # finished, and Bob is neither ops nor the creator


def test_the_run_page_shows_a_failed_steps_error(world):
    run = world["daves"]
    Run.objects.filter(pk=run.pk).update(error="RuntimeError: the CRM said no")
    run.steps.filter(name="classify").update(error="Retryable: 429 from the model")
    html = as_user(world["users"]["dave"]).get(f"/runs/{run.pk}/").content.decode()
    assert "the CRM said no" in html and "429 from the model" in html


def test_everything_is_escaped(world):
    run = world["parked"]
    card = Approval.objects.get(run=run)
    card.decide(world["users"]["bob"], "reject", comment=XSS)
    client = as_user(world["users"]["alice"])
    for url in ("/runs/", f"/runs/{run.pk}/"):
        html = client.get(url).content.decode()
        assert "<script>alert(1)" not in html and "<img src=x" not in html
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_ops_cancel_a_parked_run_from_its_page(world):
    run = world["parked"]
    client = as_user(world["users"]["carol"])
    assert "Cancel run" in client.get(f"/runs/{run.pk}/").content.decode()
    response = client.post(f"/runs/{run.pk}/cancel", follow=True)
    assert response.redirect_chain == [(f"/runs/{run.pk}/", 302)]
    assert "Run cancelled." in response.content.decode()
    run.refresh_from_db()
    assert run.status == Run.Status.CANCELLED
    assert Approval.objects.get(run=run).status == "cancelled"
    entry = AuditEntry.objects.get(action="run.cancel")
    assert entry.actor == "carol" and entry.run_id == run.pk
    assert "Cancel run" not in response.content.decode()
    client.post(f"/runs/{run.pk}/cancel")  # again: nothing more happens
    assert AuditEntry.objects.filter(action="run.cancel").count() == 1


def test_the_creator_may_cancel_their_run(world):
    run = world["parked"]
    response = as_user(world["users"]["frank"]).post(f"/runs/{run.pk}/cancel")
    assert response.status_code == 302
    assert Run.objects.get(pk=run.pk).status == Run.Status.CANCELLED


@pytest.mark.parametrize(("who", "status"), [("bob", 403), ("erin", 404), ("dave", 404)])
def test_others_may_not_cancel(world, who, status):
    run = world["parked"]
    client = as_user(world["users"][who])
    if status == 403:
        assert "Cancel run" not in client.get(f"/runs/{run.pk}/").content.decode()
    assert client.post(f"/runs/{run.pk}/cancel").status_code == status
    assert Run.objects.get(pk=run.pk).status == Run.Status.WAITING_HUMAN
    assert not AuditEntry.objects.filter(action="run.cancel").exists()


def test_cancel_is_post_only(world):
    response = as_user(world["users"]["carol"]).get(f"/runs/{world['parked'].pk}/cancel")
    assert response.status_code == 405


def test_the_run_page_shows_an_escalation_and_a_failed_notification(world, settings):
    settings.NOTIFY_BACKENDS = ["email"]
    leads = Group.objects.create(name="payments-leads")
    Channel.objects.filter(name="payments").update(escalation_policy="escalate", escalation_group=leads)
    card = Approval.objects.get(run=world["parked"])
    sla.apply_sla(card.pk, card.due_at + card.channel.sla)
    Notification.objects.update(status="failed", attempts=6, last_error="SMTPConnectError: <refused>")
    html = as_user(world["users"]["carol"]).get(f"/runs/{world['parked'].pk}/").content.decode()
    assert "escalated to payments-leads" in html
    assert "sla.escalate via email to payments-leads" in html
    assert 'class="notification-status">failed</span> after 6 attempts' in html
    assert "SMTPConnectError: &lt;refused&gt;" in html
