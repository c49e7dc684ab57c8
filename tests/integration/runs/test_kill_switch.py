"""Kill switches: per channel and global, on the engine, the channels page and the API (issue #5). With real
workers: tests/system/test_kill_switch_workers.py."""

from __future__ import annotations

import threading
import time

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import Count
from django.test import Client
from guardian.shortcuts import assign_perm

from core.models import GLOBAL_SWITCH, ApiToken, AuditEntry, Channel, GlobalKillSwitch, ReasonRequired, Role
from demo import sandbox
from demo.models import SandboxCall
from runs import engine, ownership, submission
from runs.models import Receipt, Run
from runs.workflow import Park
from tests.engine_helpers import REFUND, SMALL_REFUND, drive, queued_jobs
from tests.worker import wait_until


@pytest.fixture
def ops(demo):
    return demo["ops"]


def channel(name: str) -> Channel:
    return Channel.objects.select_related("kill_switch_by").get(name=name)


def switch_entries(action: str = "kill_switch.") -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(action__startswith=action).order_by("id"))


def emails_per_run() -> dict:
    rows = SandboxCall.objects.filter(system="email").values_list("run_id").annotate(n=Count("id"))
    return dict(rows)


def submit(n: int, payload=SMALL_REFUND) -> list[Run]:
    return [submission.submit(workflow="refund", input={**payload, "customer_id": f"cus_{i}"})[0] for i in range(n)]


# --- the engine ----------------------------------------------------------------------------------------------


def test_engaging_email_parks_runs_at_notify_customer_while_payments_go_through(demo, ops):
    assert channel("email").engage_kill_switch(ops, "bad template in the refund email")
    runs = [drive(run) for run in submit(3)]
    for run in runs:
        assert run.status == Run.Status.PAUSED and run.paused_switch == "email"
        assert run.steps.order_by("-seq").first().name == "notify_customer"
        assert run.pause_reason == "kill switch engaged on email: bad template in the refund email"
    assert sandbox.stats() == {"channels": {"payments": 3, "email": 0, "crm": 3}, "duplicates": 0}
    assert Run.paused_by("email").count() == 3


def test_releasing_finishes_the_paused_runs_with_exactly_one_email_each(demo, ops):
    channel("email").engage_kill_switch(ops, "bad template")
    runs = [drive(run) for run in submit(3)]

    email = channel("email")
    assert email.release_kill_switch(ops, "template fixed")
    for run in runs:
        run.refresh_from_db()
        assert (run.status, run.paused_switch, run.pause_reason) == (Run.Status.QUEUED, "", "")
        assert queued_jobs(run) == 1  # deferred in the release's transaction: nobody has to requeue them
    runs = [drive(run) for run in runs]
    assert {run.status for run in runs} == {Run.Status.SUCCEEDED}
    assert emails_per_run() == {run.id: 1 for run in runs}
    assert sandbox.stats()["duplicates"] == 0
    assert Run.paused_by(email.switch_key).count() == 0


def test_engage_and_release_are_audited_with_the_reason(demo, ops):
    email = channel("email")
    email.engage_kill_switch(ops, "bad template")
    drive(submit(1)[0])
    email.release_kill_switch(ops, "template fixed")
    engage, release = switch_entries()
    assert (engage.action, engage.actor, engage.actor_type, engage.channel, engage.target) == (
        "kill_switch.engage",
        "ops",
        "human",
        "email",
        "channel:email",
    )
    assert engage.data == {"reason": "bad template"}
    assert release.action == "kill_switch.release"
    assert release.data == {"reason": "template fixed", "resumed_runs": 1}
    assert list(AuditEntry.verify_chain()) == []


def test_the_switch_shows_who_changed_it_last_and_why(demo, ops):
    email = channel("email")
    email.engage_kill_switch(ops, "bad template")
    stored = channel("email")
    assert (stored.kill_switch_engaged, stored.kill_switch_reason, stored.kill_switch_by) == (True, "bad template", ops)
    engaged_at = stored.kill_switch_at
    email.release_kill_switch(ops, "fixed")
    stored = channel("email")
    assert (stored.kill_switch_engaged, stored.kill_switch_reason) == (False, "fixed")
    assert stored.kill_switch_at > engaged_at
    assert (email.kill_switch_engaged, email.kill_switch_reason) == (False, "fixed")  # the instance is refreshed


def test_engaging_an_engaged_switch_changes_nothing(demo, ops):
    email = channel("email")
    assert email.engage_kill_switch(ops, "first") is True
    assert channel("email").engage_kill_switch(demo["admin"], "second") is False
    stored = channel("email")
    assert (stored.kill_switch_reason, stored.kill_switch_by) == ("first", ops)
    assert len(switch_entries()) == 1
    assert channel("crm").release_kill_switch(ops, "was never engaged") is False
    assert len(switch_entries()) == 1


@pytest.mark.parametrize("reason", ["", "   ", None, "x" * 501])
def test_a_reason_is_required(demo, ops, reason):
    with pytest.raises(ReasonRequired):
        channel("email").engage_kill_switch(ops, reason)
    with pytest.raises(ReasonRequired):
        GlobalKillSwitch.load().engage_kill_switch(ops, reason)
    assert not channel("email").kill_switch_engaged and not GlobalKillSwitch.load().kill_switch_engaged
    assert switch_entries() == []


def test_a_reason_is_required_to_release_too(demo, ops):
    channel("email").engage_kill_switch(ops, "bad template")
    with pytest.raises(ReasonRequired):
        channel("email").release_kill_switch(ops, " ")
    assert channel("email").kill_switch_engaged
    assert len(switch_entries()) == 1


def test_releasing_resumes_only_the_runs_that_switch_paused(demo, ops, bob):
    channel("payments").engage_kill_switch(ops, "payment provider incident")
    channel("email").engage_kill_switch(ops, "bad template")
    at_payment = drive(submit(1)[0])
    assert (at_payment.status, at_payment.paused_switch) == (Run.Status.PAUSED, "payments")
    channel("payments").release_kill_switch(ops, "provider is back")
    at_email = drive(at_payment)
    assert (at_email.status, at_email.paused_switch) == (Run.Status.PAUSED, "email")

    budget = drive(submission.submit(workflow="refund", input=SMALL_REFUND, cost_limit=0)[0])
    assert budget.status == Run.Status.PAUSED and budget.paused_switch == ""  # paused by its budget, not a switch
    channel("payments").engage_kill_switch(ops, "again")
    channel("payments").release_kill_switch(ops, "fine")
    assert Run.objects.get(pk=at_email.pk).status == Run.Status.PAUSED
    assert Run.objects.get(pk=budget.pk).status == Run.Status.PAUSED


def test_new_runs_are_still_accepted_while_a_switch_is_engaged(demo, ops):
    channel("email").engage_kill_switch(ops, "bad template")
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    assert run.status == Run.Status.WAITING_HUMAN  # work before the effect goes on: the card is waiting


def test_a_release_between_the_check_and_the_park_does_not_strand_the_run(demo, ops):
    """The effect saw the switch in its receipt's transaction; the run parks in another one. If the release
    committed in between, it found nothing to resume: parking must notice and queue the run instead."""
    run = submit(1)[0]
    Run.objects.filter(pk=run.pk).update(status=Run.Status.RUNNING, owner="its-worker")
    run.refresh_from_db()  # the owner's copy
    with ownership.hold(run.pk):  # as its owner parks: under the run's lock
        engine._park(run, 5, Park("kill switch engaged on email: gone", paused=True, kill_switch_channel="email"))
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED and queued_jobs(run) == 1
    assert drive(run).status == Run.Status.SUCCEEDED


# --- the global switch -----------------------------------------------------------------------------------------


def test_the_global_switch_stops_every_channel(demo, ops):
    switch = GlobalKillSwitch.load()
    assert switch.engage_kill_switch(ops, "incident: stop everything")
    runs = [drive(run) for run in submit(2)]
    for run in runs:
        assert (run.status, run.paused_switch) == (Run.Status.PAUSED, GLOBAL_SWITCH)
        assert run.pause_reason == "global kill switch engaged (stops payments): incident: stop everything"
    assert sandbox.stats()["channels"] == {"payments": 0, "email": 0, "crm": 2}  # reads go on, effects stop
    assert Run.paused_by(switch.switch_key).count() == 2 and Run.paused_by("payments").count() == 0

    assert switch.release_kill_switch(ops, "all clear")
    runs = [drive(run) for run in runs]
    assert {run.status for run in runs} == {Run.Status.SUCCEEDED}
    assert sandbox.stats() == {"channels": {"payments": 2, "email": 2, "crm": 2}, "duplicates": 0}
    engage, release = switch_entries()
    assert (engage.action, engage.target, engage.channel, engage.data) == (
        "kill_switch.engage",
        "kill_switch:global",
        "",
        {"reason": "incident: stop everything"},
    )
    assert release.data == {"reason": "all clear", "resumed_runs": 2}


def test_releasing_the_global_switch_leaves_channel_switches_in_force(demo, ops):
    GlobalKillSwitch.load().engage_kill_switch(ops, "incident")
    channel("email").engage_kill_switch(ops, "bad template")
    run = drive(submit(1)[0])
    assert run.paused_switch == GLOBAL_SWITCH
    GlobalKillSwitch.load().release_kill_switch(ops, "incident over")
    run = drive(run)
    assert (run.status, run.paused_switch) == (Run.Status.PAUSED, "email")
    assert sandbox.stats()["channels"] == {"payments": 1, "email": 0, "crm": 1}
    channel("email").release_kill_switch(ops, "fixed")
    assert drive(run).status == Run.Status.SUCCEEDED


def test_without_the_global_switch_row_effects_go_on_and_load_brings_it_back(demo, ops):
    GlobalKillSwitch.objects.all().delete()  # what a transactional test's flush does to the migration's row
    with transaction.atomic():
        assert Channel.killed_for_effects("email") is None  # nothing to lock: the lock is advisory
    assert GlobalKillSwitch.load().engage_kill_switch(ops, "incident")
    with transaction.atomic():
        assert Channel.killed_for_effects("email").switch == GlobalKillSwitch.load().switch_key


# --- the locking discipline --------------------------------------------------------------------------------


def _in_thread(fn) -> threading.Thread:
    def run():
        try:
            fn()
        finally:
            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("which", ["email", "global"])
def test_an_engage_waits_for_effects_past_the_check_and_stops_every_later_one(transactional_db, which):
    """An effect that has checked the switch and not yet committed its receipt goes through; the engage
    commits after it, and from then on no effect starts."""
    call_command("demo_setup", verbosity=0)
    ops = User.objects.get(username="ops")
    run = submission.submit(workflow="refund", input=SMALL_REFUND)[0]
    checked, finish, engaged = threading.Event(), threading.Event(), threading.Event()

    def effect_in_flight():
        with transaction.atomic():
            assert Channel.killed_for_effects("email") is None
            Receipt.objects.create(key="in-flight", run=run, step_seq=5, channel="email")
            checked.set()
            finish.wait(10)

    def engage():
        switch = GlobalKillSwitch.load() if which == "global" else Channel.objects.get(name="email")
        switch.engage_kill_switch(ops, "stop")
        engaged.set()

    effect = _in_thread(effect_in_flight)
    assert checked.wait(10)
    flip = _in_thread(engage)
    time.sleep(0.3)
    assert not engaged.is_set(), "the engage must wait for the effect that is past its check"
    finish.set()
    effect.join(10)
    assert engaged.wait(10)
    flip.join(10)

    receipt = Receipt.objects.get(key="in-flight")
    switch = GlobalKillSwitch.load() if which == "global" else Channel.objects.get(name="email")
    assert receipt.created_at < switch.kill_switch_at  # it started before the switch; it may finish
    with transaction.atomic():
        killed = Channel.killed_for_effects("email")
    assert killed is not None and killed.switch == (GLOBAL_SWITCH if which == "global" else "email")


def test_an_effect_already_under_way_completes_and_none_starts_after(transactional_db):
    """The email call is slow: the switch engages while it is in the air. It completes (exactly once);
    the next run's email does not start."""
    call_command("demo_setup", verbosity=0)
    ops = User.objects.get(username="ops")
    slow = submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {"notify_customer": ["latency:800"]}})[
        0
    ]
    worker = _in_thread(lambda: drive(slow))
    wait_until(lambda: Receipt.objects.filter(run=slow, channel="email").exists(), timeout=10, interval=0.01)
    channel("email").engage_kill_switch(ops, "stop the emails")
    later = drive(submit(1)[0])
    worker.join(10)
    slow.refresh_from_db()
    assert slow.status == Run.Status.SUCCEEDED and later.status == Run.Status.PAUSED
    assert emails_per_run() == {slow.id: 1}


# --- the channels page ----------------------------------------------------------------------------------------


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def post(user, name: str | None, action: str, reason: str | None, htmx: bool = True):
    url = "/channels/kill-switch/" if name is None else f"/channels/{name}/kill-switch/"
    data = {"action": action, **({} if reason is None else {"reason": reason})}
    return client_for(user).post(url, data, headers={"HX-Request": "true"} if htmx else {})


def test_it_lists_every_channel_with_its_state_for_ops(demo, ops):
    channel("email").engage_kill_switch(ops, "bad template")
    drive(submit(1)[0])
    response = client_for(ops).get("/channels/")
    assert response.status_code == 200
    page = response.content.decode()
    for name in ("payments", "email", "crm"):
        assert f'id="channel-{name}"' in page
    assert 'id="switch-global"' in page
    assert 'data-state="engaged"' in page and "bad template" in page
    assert 'data-summary="engaged">1 of 3 channel switches engaged' in page
    assert "1 run paused by kill switches" in page
    assert page.count('name="reason"') == 4  # ops may flip every demo channel and the global switch


def test_the_row_shows_the_runs_its_switch_paused(demo, ops):
    channel("email").engage_kill_switch(ops, "bad template")
    for run in submit(2):
        drive(run)
    response = client_for(ops).get("/channels/")
    assert response.context["channels"][1].name == "email" and response.context["channels"][1].paused_runs == 2


def test_ops_without_operate_channel_see_it_read_only(demo, carol):
    response = client_for(carol).get("/channels/")
    assert response.status_code == 200
    page = response.content.decode()
    assert 'id="channel-email"' in page
    assert page.count('name="reason"') == 1  # only the global switch: carol is ops
    assert page.count(">read-only<") == 3


def test_an_admin_sees_it_and_a_superuser_may_flip_everything(demo, alice):
    page = client_for(alice).get("/channels/").content.decode()
    assert page.count('name="reason"') == 4
    admin_only = User.objects.create_user("adam")
    admin_only.groups.add(Group.objects.get(name=Role.ADMIN))
    page = client_for(admin_only).get("/channels/").content.decode()
    assert page.count('name="reason"') == 0 and page.count(">read-only<") == 4


def test_someone_who_operates_one_channel_sees_only_that_one(demo):
    olga = User.objects.create_user("olga")
    assign_perm("core.operate_channel", olga, channel("crm"))
    page = client_for(olga).get("/channels/").content.decode()
    assert 'id="channel-crm"' in page and 'id="channel-email"' not in page
    assert page.count('name="reason"') == 1  # crm's; not the global switch
    assert post(olga, "crm", "engage", "crm migration").status_code == 200
    assert post(olga, "email", "engage", "not mine").status_code == 404
    assert post(olga, None, "engage", "not ops").status_code == 403
    assert [e.channel for e in switch_entries()] == ["crm"]


@pytest.mark.parametrize("user", ["bob", "dave"])
def test_reviewers_and_outsiders_get_404(demo, user, request):
    someone = request.getfixturevalue(user)
    assert client_for(someone).get("/channels/").status_code == 404
    assert post(someone, "email", "engage", "let me").status_code == 404
    assert post(someone, None, "engage", "let me").status_code == 404
    assert not channel("email").kill_switch_engaged and not GlobalKillSwitch.load().kill_switch_engaged
    assert switch_entries() == []


def test_the_demo_reviewer_gets_404_too(demo):
    assert client_for(demo["reviewer"]).get("/channels/").status_code == 404


def test_ops_without_operate_channel_get_403_and_nothing_changes(demo, carol):
    response = post(carol, "email", "engage", "I am ops")
    assert response.status_code == 403
    assert not channel("email").kill_switch_engaged
    assert switch_entries() == []


def test_an_unknown_channel_is_404(demo, ops):
    assert post(ops, "fax", "engage", "nope").status_code == 404


def test_engaging_from_the_page_returns_the_row_and_an_event(demo, ops):
    response = post(ops, "email", "engage", "bad template")
    assert response.status_code == 200
    assert response.headers["HX-Trigger-After-Settle"] == '{"kill-switch-changed": {}}'
    row = response.content.decode()
    assert row.strip().startswith('<tr id="channel-email"') and 'data-state="engaged"' in row
    assert "bad template" in row and 'value="release"' in row
    assert channel("email").kill_switch_engaged
    [entry] = switch_entries()
    assert (entry.actor, entry.data) == ("ops", {"reason": "bad template"})

    response = post(ops, "email", "release", "fixed")
    assert response.status_code == 200 and 'data-state="released"' in response.content.decode()
    assert not channel("email").kill_switch_engaged


def test_a_click_on_a_stale_row_changes_nothing_and_shows_the_current_state(demo, ops, alice):
    channel("email").engage_kill_switch(alice, "someone was faster")
    response = post(ops, "email", "engage", "me too")
    assert response.status_code == 200 and "HX-Trigger-After-Settle" not in response.headers
    assert "someone was faster" in response.content.decode()
    assert len(switch_entries()) == 1


@pytest.mark.parametrize("reason", [None, "", "   "])
def test_the_page_requires_a_reason(demo, ops, reason):
    response = post(ops, "email", "engage", reason)
    assert response.status_code == 422
    row = response.content.decode()
    assert "Give a reason" in row and 'aria-invalid="true"' in row and 'data-state="released"' in row
    assert not channel("email").kill_switch_engaged
    assert switch_entries() == []


def test_without_javascript_it_redirects_or_shows_the_error_on_the_page(demo, ops):
    response = post(ops, "email", "engage", "bad template", htmx=False)
    assert response.status_code == 302 and response.url == "/channels/"
    response = post(ops, "email", "release", " ", htmx=False)
    assert response.status_code == 422
    assert "<h1>Channels and kill switches</h1>" in response.content.decode()
    assert "Give a reason" in response.content.decode()
    assert channel("email").kill_switch_engaged


def test_ops_flip_the_global_switch_from_the_page(demo, ops):
    response = post(ops, None, "engage", "incident")
    assert response.status_code == 200 and 'id="switch-global"' in response.content.decode()
    assert GlobalKillSwitch.load().kill_switch_engaged
    page = client_for(ops).get("/channels/").content.decode()
    assert "The global kill switch is engaged" in page
    assert post(ops, None, "release", "over").status_code == 200
    assert not GlobalKillSwitch.load().kill_switch_engaged


def test_an_admin_who_is_not_ops_may_not_flip_the_global_switch(demo):
    adam = User.objects.create_user("adam")
    adam.groups.add(Group.objects.get(name=Role.ADMIN))
    assert post(adam, None, "engage", "admin").status_code == 403
    assert not GlobalKillSwitch.load().kill_switch_engaged


def test_the_summary_partial_refreshes_on_the_event(demo, ops):
    channel("email").engage_kill_switch(ops, "bad template")
    response = client_for(ops).get("/channels/", headers={"HX-Request": "true", "HX-Target": "switch-summary"})
    body = response.content.decode().strip()
    assert body.startswith('<p id="switch-summary"') and "1 of 3 channel switches engaged" in body
    assert 'hx-trigger="kill-switch-changed from:body"' in body


def test_django_admin_shows_the_global_switch_read_only(demo, alice, ops):
    GlobalKillSwitch.load().engage_kill_switch(ops, "incident")
    client = client_for(alice)
    assert "incident" in client.get("/admin/core/globalkillswitch/").content.decode()
    assert client.get("/admin/core/globalkillswitch/1/change/").status_code == 200
    response = client.post("/admin/core/globalkillswitch/1/change/", {"kill_switch_engaged": ""})
    assert response.status_code == 403 and GlobalKillSwitch.load().kill_switch_engaged


def test_the_page_is_a_get_and_the_flip_a_post(demo, ops):
    assert client_for(ops).get("/channels/email/kill-switch/").status_code == 405
    assert client_for(ops).post("/channels/").status_code == 405


# --- the API -------------------------------------------------------------------------------------------------


def bearer(user) -> dict:
    return {"Authorization": f"Bearer {ApiToken.issue(user)[1]}"}


def api(user, path: str, body: dict | None, token: bool = True):
    headers = bearer(user) if token else {}
    return Client().post(f"/api{path}", body, content_type="application/json", headers=headers)


def test_the_api_engages_and_releases_a_channel(demo, ops):
    response = api(ops, "/channels/email/kill-switch", {"engaged": True, "reason": "bad template"})
    assert response.status_code == 200
    state = response.json()
    assert {k: state[k] for k in ("channel", "engaged", "reason", "by", "runs_paused", "changed")} == {
        "channel": "email",
        "engaged": True,
        "reason": "bad template",
        "by": "ops",
        "runs_paused": 0,
        "changed": True,
    }
    assert state["at"]
    run = drive(submit(1)[0])
    assert run.status == Run.Status.PAUSED

    again = api(ops, "/channels/email/kill-switch", {"engaged": True, "reason": "still bad"}).json()
    assert (again["changed"], again["reason"], again["runs_paused"]) == (False, "bad template", 1)

    released = api(ops, "/channels/email/kill-switch", {"engaged": False, "reason": "fixed"}).json()
    assert (released["engaged"], released["changed"], released["runs_paused"]) == (False, True, 0)
    assert drive(run).status == Run.Status.SUCCEEDED
    assert [e.action for e in switch_entries()] == ["kill_switch.engage", "kill_switch.release"]


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"engaged": True}, None),
        ({"engaged": True, "reason": ""}, "a reason is required"),
        ({"engaged": True, "reason": "  "}, "a reason is required"),
        ({"engaged": True, "reason": "x" * 501}, None),
        ({"reason": "no state"}, None),
    ],
)
def test_the_api_requires_a_reason_and_a_state(demo, ops, body, detail):
    response = api(ops, "/channels/email/kill-switch", body)
    assert response.status_code == 422 and response.json()["error"] == "invalid"
    if detail:
        assert response.json()["detail"] == detail
    assert not channel("email").kill_switch_engaged and switch_entries() == []


@pytest.mark.parametrize(
    ("user", "path", "status"),
    [
        ("carol", "/channels/email/kill-switch", 403),  # ops without operate_channel on email
        ("bob", "/channels/email/kill-switch", 404),
        ("dave", "/channels/email/kill-switch", 404),
        ("bob", "/kill-switch", 404),
        ("dave", "/kill-switch", 404),
    ],
)
def test_the_api_refuses_those_who_may_not_and_nothing_changes(demo, request, user, path, status):
    response = api(request.getfixturevalue(user), path, {"engaged": True, "reason": "let me"})
    assert response.status_code == status
    assert response.json()["error"] == {403: "forbidden", 404: "not_found"}[status]
    assert not Channel.objects.filter(kill_switch_engaged=True).exists()
    assert not GlobalKillSwitch.load().kill_switch_engaged
    assert switch_entries() == []


def test_the_api_answers_404_for_an_unknown_channel_and_401_without_a_token(demo, ops):
    assert api(ops, "/channels/fax/kill-switch", {"engaged": True, "reason": "x"}).status_code == 404
    assert api(ops, "/channels/email/kill-switch", {"engaged": True, "reason": "x"}, token=False).status_code == 401


def test_the_api_flips_the_global_switch_for_ops_only(demo, ops, carol):
    adam = User.objects.create_user("adam")
    adam.groups.add(Group.objects.get(name=Role.ADMIN))
    assert api(adam, "/kill-switch", {"engaged": True, "reason": "admin"}).status_code == 403
    response = api(carol, "/kill-switch", {"engaged": True, "reason": "incident"})
    assert response.status_code == 200
    assert response.json() | {"at": None} == {
        "channel": None,
        "engaged": True,
        "reason": "incident",
        "by": "carol",
        "at": None,
        "runs_paused": 0,
        "changed": True,
    }
    assert drive(submit(1)[0]).paused_switch == GLOBAL_SWITCH
    released = api(carol, "/kill-switch", {"engaged": False, "reason": "over"}).json()
    assert (released["engaged"], released["runs_paused"]) == (False, 0)
    assert Run.objects.get().status == Run.Status.QUEUED


def test_the_api_is_in_the_openapi_schema(demo):
    paths = Client().get("/api/openapi.json").json()["paths"]
    assert "post" in paths["/api/channels/{name}/kill-switch"] and "post" in paths["/api/kill-switch"]
