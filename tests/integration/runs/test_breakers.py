"""Circuit breakers per external system: they open after failures, hold calls back (the steps wait, re-queued,
no attempt counted), let one probe through after the cool-down, and close on its success; ops can force them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.utils import timezone
from procrastinate.contrib.django.models import ProcrastinateJob

from core.models import ApiToken, AuditEntry
from demo import sandbox
from demo.models import SandboxCall
from runs import breakers, submission
from runs.models import Breaker, Receipt, Run, Step
from runs.workflow import Ambiguous, Retryable
from tests.engine_helpers import SMALL_REFUND, drive
from tests.integration.console.test_metrics import scrape
from tests.worker import wait_until


@pytest.fixture(autouse=True)
def _sensitive_breakers(settings):
    settings.BREAKER_MIN_CALLS = 3
    settings.BREAKER_FAILURES = 3
    settings.BREAKER_FAILURE_RATE = 0.5
    settings.BREAKER_COOLDOWN_SECONDS = 30


def _submit(faults: dict | None = None) -> Run:
    return submission.submit(workflow="refund", input={**SMALL_REFUND, **({"faults": faults} if faults else {})})[0]


def _calls(system: str, run: Run | None = None) -> int:
    calls = SandboxCall.objects.filter(system=system)
    return (calls.filter(run_id=run.id) if run else calls).count()


def _breaker(system: str) -> Breaker:
    return Breaker.objects.get(system=system)


def _trip(system: str, step: str) -> list[Run]:
    """Three runs whose first call of `step` fails with a 503: the third failure opens `system`'s breaker."""
    failing = []
    for _ in range(3):
        run = _submit({step: ["5xx"]})
        with pytest.raises(Retryable):
            drive(run)
        failing.append(run)
    return failing


def _cool_down_over(system: str) -> None:
    Breaker.objects.filter(system=system).update(open_until=timezone.now() - timedelta(seconds=1))


def _job(run: Run) -> ProcrastinateJob:
    return ProcrastinateJob.objects.get(lock=f"run:{run.id}", status="todo")


def _take_job(run: Run) -> Run:
    """Drive the run as its waiting job would: in-process drives do not take the job from the queue, whose
    queueing lock would then refuse the job a wait defers."""
    ProcrastinateJob.objects.filter(lock=f"run:{run.id}").delete()
    return drive(run)


def test_it_opens_after_failures_stops_calls_probes_and_closes(demo):
    _trip("crm", "lookup_customer")
    assert _breaker("crm").state == "open" and _calls("crm") == 3

    # Open: the step that needs the CRM waits; the CRM is not called.
    waiting = _take_job(_submit())
    assert waiting.status == Run.Status.QUEUED and waiting.attempt == 0 and waiting.error == ""
    assert _calls("crm", waiting) == 0 and _calls("crm") == 3
    assert not Step.objects.filter(run=waiting, name="lookup_customer").exists()  # no failure recorded
    assert _breaker("crm").held_back == 1
    # ... and its job comes back when the cool-down ends, not at once.
    job = _job(waiting)
    assert job.scheduled_at >= timezone.now() + timedelta(seconds=25)

    # Again while open: still no call.
    assert drive(waiting).status == Run.Status.QUEUED and _calls("crm") == 3

    # After the cool-down one probe goes through; its success closes the breaker and the run goes on.
    _cool_down_over("crm")
    waiting = drive(waiting)
    assert waiting.status == Run.Status.SUCCEEDED
    assert _calls("crm", waiting) == 1
    breaker = _breaker("crm")
    assert breaker.state == "closed" and breaker.window == []
    assert dict(waiting.steps.values_list("name", "attempt"))["lookup_customer"] == 1


def test_a_failed_probe_opens_it_again(demo):
    _trip("crm", "lookup_customer")
    _cool_down_over("crm")
    probe = _submit({"lookup_customer": ["5xx"]})
    with pytest.raises(Retryable):
        drive(probe)
    breaker = _breaker("crm")
    assert breaker.state == "open" and breaker.open_until > timezone.now() + timedelta(seconds=25)
    assert "503" in breaker.last_error


def test_while_a_probe_is_out_the_others_wait(demo):
    _trip("crm", "lookup_customer")
    Breaker.objects.filter(system="crm").update(state="half_open", probe_started_at=timezone.now())
    run = drive(_submit())
    assert run.status == Run.Status.QUEUED and _calls("crm", run) == 0
    # A probe that never comes back (its worker died in the call) is given to the next call after its timeout.
    Breaker.objects.filter(system="crm").update(probe_started_at=timezone.now() - timedelta(hours=1))
    assert drive(run).status == Run.Status.SUCCEEDED
    assert _breaker("crm").state == "closed"


def test_few_failures_or_a_low_rate_do_not_open_it(demo, settings):
    settings.BREAKER_FAILURE_RATE = 0.6
    for _ in range(3):
        assert drive(_submit()).status == Run.Status.SUCCEEDED
    for _ in range(2):
        with pytest.raises(Retryable):
            drive(_submit({"lookup_customer": ["5xx"]}))
    assert _breaker("crm").state == "closed"  # 2 failures: fewer than BREAKER_FAILURES
    with pytest.raises(Retryable):
        drive(_submit({"lookup_customer": ["5xx"]}))
    assert _breaker("crm").state == "closed"  # 3 of 6 calls: under the rate of 0.6
    with pytest.raises(Retryable):
        drive(_submit({"lookup_customer": ["5xx"]}))
    assert _breaker("crm").state == "closed"  # 4 of 7
    with pytest.raises(Retryable):
        drive(_submit({"lookup_customer": ["5xx"]}))
    assert _breaker("crm").state == "open"  # 5 of 8


def test_a_refusal_is_an_answer_not_an_outage(demo):
    for _ in range(4):
        drive(_submit({"lookup_customer": ["fatal"]}))
    assert _breaker("crm").state == "closed"
    assert [f for _, f in _breaker("crm").window] == [0, 0, 0, 0]


def test_a_run_that_waited_on_the_payments_breaker_pays_once(demo):
    _trip("payments", "issue_refund")
    paying = drive(_submit())
    assert paying.status == Run.Status.QUEUED and paying.attempt == 0
    assert not Receipt.objects.filter(run=paying).exists()  # checked before its receipt was written
    assert _calls("payments", paying) == 0

    _cool_down_over("payments")
    paying = drive(paying)
    assert paying.status == Run.Status.SUCCEEDED
    assert _calls("payments", paying) == 1 and _breaker("payments").state == "closed"
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 4}, "duplicates": 0}


def test_a_breaker_that_refuses_inside_the_call_leaves_no_receipt(demo, monkeypatch):
    """The check before the receipt saw a probe due, and another worker took the probe meanwhile: the guard
    in the call holds it back, and the receipt this attempt wrote goes (nothing was sent)."""
    breakers.force("payments", open=True, by=_ops(), reason="provider incident")
    monkeypatch.setattr(breakers, "check", lambda system: None)
    run = drive(_submit())
    assert run.status == Run.Status.QUEUED and run.attempt == 0
    assert not Receipt.objects.filter(run=run).exists() and _calls("payments") == 0


def test_a_pending_receipt_is_kept_while_the_run_waits(demo):
    run = _submit({"issue_refund": ["timeout"]})
    with pytest.raises(Ambiguous):
        drive(run)
    receipt = Receipt.objects.get(run=run, channel="payments")
    assert receipt.status == "pending"
    breakers.force("payments", open=True, by=_ops(), reason="provider incident")
    run = drive(run, attempts=1)
    assert run.status == Run.Status.QUEUED
    receipt.refresh_from_db()
    assert receipt.status == "pending"  # still there, to be reconciled

    breakers.force("payments", open=False, by=_ops(), reason="provider is back")
    run = drive(run, attempts=1)
    assert run.status == Run.Status.SUCCEEDED
    assert Receipt.objects.get(run=run, channel="payments").reconciled
    assert sandbox.stats()["channels"]["payments"] == 1 and sandbox.stats()["duplicates"] == 0


def test_the_model_has_its_breaker_too(demo):
    _trip("model", "classify")
    run = drive(_submit())
    assert run.status == Run.Status.QUEUED and _calls("model", run) == 0


def test_a_tool_wraps_its_own_calls(demo):
    calls = []

    @breakers.guard("ledger")
    def post_entry():
        calls.append(1)
        raise Retryable("ledger: 503")

    for _ in range(3):
        with pytest.raises(Retryable):
            post_entry()
    with pytest.raises(breakers.BreakerOpen) as held:
        post_entry()
    assert len(calls) == 3 and held.value.delay >= 25
    assert "ledger" in breakers.known_systems()


# Ops


def _ops():
    return User.objects.get(username="ops")


def _forced_entries() -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(action__startswith="breaker.").order_by("id"))


def test_ops_force_it_open_and_closed_from_the_dashboard_audited(demo, client):
    client.force_login(_ops())
    response = client.post("/dashboard/breakers/", {"system": "email", "action": "open", "reason": "bounce storm"})
    assert response.status_code == 302 and response["Location"] == "/dashboard/"
    breaker = _breaker("email")
    assert breaker.state == "open" and breaker.forced and breaker.changed_by == "ops"
    page = client.get("/dashboard/").content.decode()
    assert 'data-breaker="email" data-breaker-state="forced_open"' in page

    # Held open: no probe, whatever the time.
    _cool_down_over("email")
    run = drive(_submit())
    assert run.status == Run.Status.QUEUED and _calls("email") == 0

    client.post("/dashboard/breakers/", {"system": "email", "action": "close", "reason": "provider fixed it"})
    assert _breaker("email").state == "closed"
    (opened, closed) = _forced_entries()
    assert (opened.action, opened.actor, opened.target) == ("breaker.force_open", "ops", "breaker:email")
    assert opened.data == {"system": "email", "before": "closed", "after": "forced_open", "reason": "bounce storm"}
    assert closed.action == "breaker.force_closed" and closed.data["reason"] == "provider fixed it"
    assert drive(run).status == Run.Status.SUCCEEDED and _calls("email") == 1


def test_a_reason_is_required(demo, client):
    client.force_login(_ops())
    response = client.post("/dashboard/breakers/", {"system": "email", "action": "open", "reason": "  "})
    assert response.status_code == 422 and b"reason" in response.content
    assert not Breaker.objects.filter(state="open").exists() and not _forced_entries()


@pytest.mark.parametrize(("user", "status"), [("reviewer", 404), ("outsider", 404), ("admin_only", 403)])
def test_others_may_not_force_it_and_nothing_changes(demo, client, user, status):
    if user == "admin_only":
        person = User.objects.create_user("ada")
        person.groups.add(Group.objects.get(name="admin"))
    else:
        person = User.objects.get(username=user)
    client.force_login(person)
    response = client.post("/dashboard/breakers/", {"system": "payments", "action": "open", "reason": "x"})
    assert response.status_code == status
    _, raw = ApiToken.issue(person)
    response = client.post(
        "/api/breakers/payments",
        {"state": "open", "reason": "x"},
        content_type="application/json",
        headers={"Authorization": f"Bearer {raw}"},
    )
    assert response.status_code == status
    assert not Breaker.objects.filter(state="open").exists() and not _forced_entries()


def test_the_api_forces_it_and_is_idempotent(demo, client):
    _, raw = ApiToken.issue(_ops())
    headers = {"Authorization": f"Bearer {raw}"}

    def post(state):
        return client.post(
            "/api/breakers/crm",
            {"state": state, "reason": "maintenance"},
            content_type="application/json",
            headers=headers,
        )

    first, again = post("open"), post("open")
    assert first.status_code == 200 and first.json()["state"] == "forced_open" and first.json()["changed"]
    assert again.status_code == 200 and not again.json()["changed"]
    assert post("closed").json()["state"] == "closed"
    assert [e.action for e in _forced_entries()] == ["breaker.force_open", "breaker.force_closed"]
    assert (
        client.post(
            "/api/breakers/nowhere", {"state": "open", "reason": "x"}, content_type="application/json", headers=headers
        ).status_code
        == 404
    )
    listed = client.get("/api/breakers", headers=headers).json()
    assert {b["system"] for b in listed} == {"model", "payments", "email", "crm"}


def test_metrics_and_dashboard_show_each_breaker(demo, client):
    _trip("crm", "lookup_customer")
    metrics = scrape(client, REMOTE_ADDR="127.0.0.1")
    assert metrics("hitl_breaker_state", system="crm", state="open") == 1
    assert metrics("hitl_breaker_state", system="crm", state="closed") == 0
    assert metrics("hitl_breaker_state", system="payments", state="closed") == 1
    assert metrics("hitl_breaker_window_failures", system="crm") == 0  # the window restarts when it opens
    client.force_login(_ops())
    page = client.get("/dashboard/").content.decode()
    assert 'data-breaker="crm" data-breaker-state="open"' in page
    assert 'data-signal="circuit-breakers" data-state="alert"' in page
    assert 'id="force-breaker"' in page


# With real worker processes


def test_a_run_that_waited_on_a_breaker_finishes_with_one_payment(start_worker, transactional_db):
    call_command("demo_setup", verbosity=0)
    ops = _ops()
    breakers.force("payments", open=True, by=ops, reason="provider incident")
    worker = start_worker(BREAKER_COOLDOWN_SECONDS="1")
    run = _submit()
    wait_until(lambda: Breaker.objects.get(system="payments").held_back >= 1, message="the run to wait")
    run.refresh_from_db()
    assert run.status in (Run.Status.QUEUED, Run.Status.RUNNING) and _calls("payments") == 0
    assert not Receipt.objects.filter(run=run, channel="payments").exists()

    breakers.force("payments", open=False, by=ops, reason="provider is back")
    wait_until(lambda: Run.objects.get(pk=run.pk).status == Run.Status.SUCCEEDED, timeout=30, message="success")
    assert sandbox.stats() == {"channels": {"payments": 1, "email": 1, "crm": 1}, "duplicates": 0}
    assert Step.objects.get(run=run, name="issue_refund").attempt == 1
    assert "step waits" in worker.log()
