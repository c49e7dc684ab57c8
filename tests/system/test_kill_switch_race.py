"""Ops engage the email kill switch through the API in the middle of a burst of emails.

From the moment the switch commits no email starts: an email whose receipt was written before the switch
(already past the check, in flight) may still arrive, none other does. Every run that had not reached its
email parks as `paused` on the switch, as do runs submitted while it is engaged; releasing it lets them
finish, one email each.

Sizes: KILL_SWITCH_RUNS (40).
"""

from __future__ import annotations

import time

from django.utils import timezone

from demo.models import SandboxCall
from jobs.models import DeadLetter
from runs.models import Receipt, Run
from tests.system.conftest import describe_runs, effects_per_run, env_int, jobs_doing, report, sandbox_stats
from tests.worker import wait_until

RUNS = env_int("KILL_SWITCH_RUNS", 40)
ENGAGE_AFTER_EMAILS = max(1, RUNS // 8)
ARRIVALS = 5


def refund(i: int) -> dict:
    run_input = {"customer_id": f"cus_{4000 + i}", "amount_cents": 500 + i, "currency": "EUR", "reason": "Late"}
    if i % 3 == 0:
        run_input["faults"] = {"notify_customer": ["latency:500"]}  # a slow mail server: emails in flight
    return run_input


def emails() -> int:
    return SandboxCall.objects.filter(system="email", applied=True).count()


def test_no_email_starts_after_the_email_kill_switch_commits(system):
    run_ids = [system.submit(refund(i)) for i in range(RUNS)]
    wait_until(lambda: emails() >= ENGAGE_AFTER_EMAILS, timeout=30, interval=0.01, message="the first emails")

    before = timezone.now()
    response = system.ops.post("/api/channels/email/kill-switch", {"engaged": True, "reason": "bad template"})
    committed = timezone.now()  # the switch had committed when the answer came
    assert response.status == 200, response
    assert response.body["engaged"] is True and response.body["changed"] is True
    emails_at_switch = emails()
    # Runs that arrive while the switch is engaged pay, then park before their email.
    arrivals = [system.submit(refund(RUNS + i)) for i in range(ARRIVALS)]
    run_ids += arrivals

    # Every run either sent its email (in flight at the switch, or before) or parks on the switch.
    parked = system.wait_for_runs(run_ids, timeout=30, until=[Run.Status.SUCCEEDED, Run.Status.PAUSED])
    time.sleep(1)  # nothing more arrives while the switch stays engaged
    emails_while_engaged = emails()
    late = list(
        Receipt.objects.filter(channel="email", created_at__gt=committed).values_list("key", "created_at", "run_id")
    )
    in_flight = list(
        SandboxCall.objects.filter(system="email", created_at__gt=committed).values_list("idempotency_key", flat=True)
    )
    paused = list(Run.objects.filter(pk__in=run_ids, status=Run.Status.PAUSED).values_list("pk", "paused_switch"))
    emails_of_paused_runs = effects_per_run([str(pk) for pk, _ in paused], "email")
    arrivals_paused = Run.objects.filter(pk__in=arrivals, status=Run.Status.PAUSED).count()

    released = system.ops.post("/api/channels/email/kill-switch", {"engaged": False, "reason": "template fixed"})
    assert released.status == 200, released
    finished = system.wait_for_runs(run_ids, timeout=60)
    stats = sandbox_stats()
    report(
        "email kill switch race",
        runs=len(run_ids),
        runs_submitted_while_engaged=ARRIVALS,
        emails_before_the_switch=emails_at_switch,
        emails_in_flight_after_the_switch=len(in_flight),
        emails_while_engaged=emails_while_engaged,
        receipts_after_the_switch=len(late),
        switch_request_ms=(committed - before).total_seconds() * 1000,
        runs_paused=len(paused),
        runs_paused_in_engage_answer=response.body["runs_paused"],
        statuses_while_engaged=dict(parked),
        statuses_after_release=dict(finished),
        sandbox=stats,
    )

    assert late == [], "email receipts written after the kill switch had committed"
    # What arrived after the switch had started before it: its receipt was written before the switch.
    assert Receipt.objects.filter(key__in=in_flight, created_at__lte=committed).count() == len(in_flight)
    assert sum(parked.values()) == len(run_ids), describe_runs(
        Run.objects.filter(pk__in=run_ids).exclude(status__in=["succeeded", "paused"]).values_list("pk", flat=True)
    )
    assert paused, "the switch came after every email: the burst was too short to race it"
    assert {switch for _, switch in paused} == {"email"}
    assert emails_while_engaged == parked[Run.Status.SUCCEEDED]
    assert set(emails_of_paused_runs.values()) == {0}
    assert arrivals_paused == ARRIVALS

    assert finished == {Run.Status.SUCCEEDED: len(run_ids)}, describe_runs(
        Run.objects.filter(pk__in=run_ids).exclude(status="succeeded").values_list("pk", flat=True)
    )
    assert set(effects_per_run(run_ids, "email").values()) == {1}
    assert set(effects_per_run(run_ids, "payments").values()) == {1}
    assert stats["duplicates"] == 0
    assert jobs_doing() == []
    assert not DeadLetter.objects.exists()
