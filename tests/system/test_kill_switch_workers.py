"""Kill switches with real workers: a switch parks each run's email, and its release finishes each run with one
email; no email starts after an engage commits (the switches in process: tests/integration/runs/test_kill_switch.py)."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.core.management import call_command

from demo import sandbox
from runs import submission
from runs.models import Receipt, Run
from tests.engine_helpers import SMALL_REFUND
from tests.integration.runs.test_kill_switch import channel, emails_per_run, submit
from tests.worker import wait_until


def test_with_real_workers_email_parks_and_release_finishes_each_run_with_one_email(start_worker):
    call_command("demo_setup", verbosity=0)
    ops = User.objects.get(username="ops")
    channel("email").engage_kill_switch(ops, "bad template")
    start_worker()
    start_worker()
    runs = submit(6)
    wait_until(
        lambda: Run.objects.filter(status=Run.Status.PAUSED, paused_switch="email").count() == 6,
        message="every run to pause at notify_customer",
    )
    assert sandbox.stats() == {"channels": {"payments": 6, "email": 0, "crm": 6}, "duplicates": 0}

    channel("email").release_kill_switch(ops, "template fixed")
    wait_until(lambda: Run.objects.filter(status=Run.Status.SUCCEEDED).count() == 6, message="every run to finish")
    assert emails_per_run() == {run.id: 1 for run in runs}
    assert sandbox.stats() == {"channels": {"payments": 6, "email": 6, "crm": 6}, "duplicates": 0}


def test_with_real_workers_no_email_starts_after_the_engage_commits(start_worker):
    """Runs reach their email at different moments (the model is slow for some, the email system for
    others) while three workers run them; the switch engages in the middle of it."""
    call_command("demo_setup", verbosity=0)
    ops = User.objects.get(username="ops")
    for _ in range(3):
        start_worker()
    runs = [
        submission.submit(
            workflow="refund",
            input={
                **SMALL_REFUND,
                "customer_id": f"cus_{i}",
                "faults": {"classify": [f"latency:{(i % 6) * 60}"], "notify_customer": [f"latency:{(i % 4) * 80}"]},
            },
        )[0]
        for i in range(24)
    ]
    wait_until(lambda: Receipt.objects.filter(channel="email").count() >= 3, message="some emails to start")
    channel("email").engage_kill_switch(ops, "stop the emails now")
    engaged_at = channel("email").kill_switch_at
    wait_until(
        lambda: not Run.objects.exclude(status__in=[Run.Status.PAUSED, Run.Status.SUCCEEDED]).exists(),
        message="every run to finish or pause",
    )
    assert all(r.created_at < engaged_at for r in Receipt.objects.filter(channel="email"))
    sent = emails_per_run()
    succeeded = set(Run.objects.filter(status=Run.Status.SUCCEEDED).values_list("id", flat=True))
    paused = set(Run.objects.filter(status=Run.Status.PAUSED, paused_switch="email").values_list("id", flat=True))
    assert succeeded | paused == {run.id for run in runs}
    assert set(sent) == succeeded and set(sent.values()) <= {1}  # nothing for a paused run, never two
    assert paused, "the switch engaged after every run had sent its email: the test proved nothing"

    channel("email").release_kill_switch(ops, "fixed")
    wait_until(lambda: Run.objects.filter(status=Run.Status.SUCCEEDED).count() == 24, message="every run to finish")
    assert emails_per_run() == {run.id: 1 for run in runs}
    assert sandbox.stats()["duplicates"] == 0
