"""Undo (runs.compensations) with the production web server and real worker processes: a run that fails for good
after two effects is undone in reverse order, each compensation once; the same while workers are SIGKILLed every
1-3 s; a person's "reject and undo" reverses a payment once, after their yes on the reversal's card; a compensation
that fails for good parks the run with a card, nothing lost.

Sizes of the chaos case: UNDO_CHAOS_RUNS (30), UNDO_CHAOS_SECONDS (40), UNDO_CHAOS_SETTLE_SECONDS (120)."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter

import pytest

from core.models import AuditEntry
from demo.models import SandboxCall
from jobs.models import DeadLetter
from runs.models import Receipt, Run
from tests.system.conftest import GRACEFUL_TIMEOUT, describe_runs, env_int, report, sandbox_stats
from tests.worker import wait_with_logs, worker_logs

CHAIN = {"customer_id": "cus_4242", "amount_cents": 700}
# The third step's note is refused by the CRM for good, after two effects: every time (a worker killed between a refused
# call and its failure's record calls again, and the sandbox's n-th call gets the n-th fault of the list).
FAILS_AT_THE_END = {"confirm": ["fatal"] * 10}

RUNS = env_int("UNDO_CHAOS_RUNS", 30)
SECONDS = env_int("UNDO_CHAOS_SECONDS", 40)
SETTLE_SECONDS = env_int("UNDO_CHAOS_SETTLE_SECONDS", 120)
SEED = env_int("CHAOS_SEED", 20240601)

# Faults that put the kills where they hurt: a slow or lost answer in an effect or in its compensation.
UNDO_FAULTS = [
    {},
    {"pay": ["latency:800"]},
    {"undo:pay": ["latency:1500"]},  # killed in the middle of the reversal: it must not reverse twice
    {"undo:note": ["latency:1000"]},
    {"undo:pay": ["timeout"]},  # reversed, then the answer is lost: reconciled by the payment system's lookup
    {"undo:pay": ["429"]},  # refused, not applied: retried with backoff
]


@pytest.fixture
def system_env() -> dict:
    return {"WORKFLOW_MODULES": "tests.workflows"}  # test_undo_chain


def _submit(system, run_input: dict, workflow: str = "test_undo_chain") -> str:
    response = system.agent.post("/api/runs", {"workflow": workflow, "input": run_input})
    assert response.status == 202, f"{response}\n{system.server.errors()}"
    system.submitted.append(response.body["id"])
    return response.body["id"]


def _settles_in(run_id: str, statuses, system, timeout: float = 60) -> Run:
    wait_with_logs(
        lambda: Run.objects.filter(pk=run_id, status__in=list(statuses)).exists(),
        f"run {run_id} to be {'/'.join(statuses)}",
        system.workers.all,
        timeout,
    )
    return Run.objects.get(pk=run_id)


def _applied(run_id, system_name: str, marker: str) -> int:
    return SandboxCall.objects.filter(run_id=run_id, system=system_name, applied=True, payload__has_key=marker).count()


def test_a_run_that_fails_for_good_after_two_effects_is_undone_once_in_reverse_order(system):
    run_id = _submit(system, {**CHAIN, "faults": FAILS_AT_THE_END})
    run = _settles_in(run_id, [Run.Status.COMPENSATED, Run.Status.FAILED, Run.Status.COMPENSATION_FAILED], system)
    assert run.status == Run.Status.COMPENSATED, f"{run.error}\n{worker_logs(system.workers.all)}"
    order = [
        d["step"]
        for d in AuditEntry.objects.filter(run_id=run_id, action="run.compensation")
        .order_by("id")
        .values_list("data", flat=True)
    ]
    assert order == ["note", "pay"]
    assert _applied(run_id, "payments", "reverses") == 1 and _applied(run_id, "crm", "removes") == 1
    assert DeadLetter.objects.filter(run_id=run_id).count() == 1
    body = system.ops.get(f"/api/runs/{run_id}").body
    assert body["status"] == "compensated" and body["result"]["reason"] == "failed"


def test_a_worker_killed_in_the_middle_of_a_reversal_reverses_once(system):
    """The reversal is applied, then its worker is SIGKILLed before the answer (a `hang`): the next owner finds
    the compensation's receipt pending and asks the payment system (its lookup), which says it happened."""
    run_id = _submit(system, {**CHAIN, "faults": {**FAILS_AT_THE_END, "undo:pay": ["hang"]}})
    wait_with_logs(lambda: _applied(run_id, "payments", "reverses") == 1, "the reversal", system.workers.all, 60)
    for worker in system.workers.alive:
        worker.kill(signal.SIGKILL)
        worker.wait(10)
    system.workers.start()
    run = _settles_in(run_id, [Run.Status.COMPENSATED, Run.Status.COMPENSATION_FAILED], system, timeout=90)
    assert run.status == Run.Status.COMPENSATED, run.error
    assert _applied(run_id, "payments", "reverses") == 1
    assert Receipt.objects.get(key__startswith="undo:", run_id=run_id, channel="payments").reconciled


def test_a_worker_sigtermed_during_a_slow_compensation_finishes_it_and_hands_the_rest_on(system):
    """SIGTERM while the note's removal is in a slow call: the worker lets that compensation finish, gives the run
    back to the queue before the next one (as between steps) and exits within its graceful timeout; another worker
    reverses the payment. Each compensation once."""
    run_id = _submit(system, {**CHAIN, "faults": {**FAILS_AT_THE_END, "undo:note": ["latency:2000"]}})
    wait_with_logs(
        lambda: Receipt.objects.filter(
            run_id=run_id, key__startswith="undo:", channel="crm", status="pending"
        ).exists(),
        "the note's removal to start",
        system.workers.all,
        60,
    )
    for worker in system.workers.alive:
        worker.kill(signal.SIGTERM)
    for worker in system.workers.all:
        worker.wait(GRACEFUL_TIMEOUT + 5)
    assert _applied(run_id, "crm", "removes") == 1  # finished by the worker that was stopping
    assert Run.objects.get(pk=run_id).status == Run.Status.QUEUED, worker_logs(system.workers.all)
    assert AuditEntry.objects.filter(run_id=run_id, action="run.retry", data__cause="shutdown").exists()
    system.workers.start()
    run = _settles_in(run_id, [Run.Status.COMPENSATED, Run.Status.COMPENSATION_FAILED], system)
    assert run.status == Run.Status.COMPENSATED, run.error
    assert _applied(run_id, "crm", "removes") == 1 and _applied(run_id, "payments", "reverses") == 1


def test_chaos_every_completed_effect_is_compensated_exactly_once(system):
    rng = random.Random(SEED)
    inputs = [
        {**CHAIN, "customer_id": f"cus_{5000 + i}", "faults": {**FAILS_AT_THE_END, **rng.choice(UNDO_FAULTS)}}
        for i in range(RUNS)
    ]
    submit_errors: list[str] = []

    def submit_all():
        for run_input in inputs:
            try:
                _submit(system, run_input)
            except AssertionError as exc:
                submit_errors.append(str(exc))
            time.sleep(SECONDS * 0.6 / RUNS)

    started = time.monotonic()
    submitter = threading.Thread(target=submit_all, name="submitter", daemon=True)
    submitter.start()
    kills = 0
    while time.monotonic() - started < SECONDS:
        time.sleep(rng.uniform(1, 3))
        working = [w for w in system.workers.all if w.ready]
        if not working:
            continue
        victim = rng.choice(working)
        victim.kill(signal.SIGKILL)
        kills += 1
        victim.wait(10)
        system.workers.start()
    submitter.join(SETTLE_SECONDS)
    run_ids = list(system.submitted)
    statuses = system.wait_for_runs(run_ids, timeout=SETTLE_SECONDS, until=[*Run.FINISHED, *Run.PARKED])
    reversals = Counter(
        str(r)
        for r in SandboxCall.objects.filter(system="payments", applied=True, payload__has_key="reverses").values_list(
            "run_id", flat=True
        )
    )
    removals = Counter(
        str(r)
        for r in SandboxCall.objects.filter(system="crm", applied=True, payload__has_key="removes").values_list(
            "run_id", flat=True
        )
    )
    paid = Counter(
        str(r)
        for r in SandboxCall.objects.filter(system="payments", applied=True, run_id__in=run_ids)
        .exclude(payload__has_key="reverses")
        .values_list("run_id", flat=True)
    )
    stats = sandbox_stats()
    report(
        "undo under chaos (SIGKILL)",
        runs=len(run_ids),
        sigkills=kills,
        statuses=dict(statuses),
        reversals=sum(reversals.values()),
        note_removals=sum(removals.values()),
        compensation_retries=AuditEntry.objects.filter(action="run.retry", run_id__in=run_ids).count(),
        sandbox=stats,
        total_s=time.monotonic() - started,
    )
    assert not submit_errors, submit_errors[:5]
    assert len(run_ids) == RUNS
    not_compensated = [r for r in run_ids if Run.objects.get(pk=r).status != Run.Status.COMPENSATED]
    assert not not_compensated, f"{dict(statuses)}\n{describe_runs(not_compensated[:5])}"
    # Every completed effect compensated exactly once; nothing paid twice; no duplicate anywhere.
    assert all(paid[r] == 1 for r in run_ids), {r: paid[r] for r in run_ids if paid[r] != 1}
    assert all(reversals[r] == 1 for r in run_ids), {r: reversals[r] for r in run_ids if reversals[r] != 1}
    assert all(removals[r] == 1 for r in run_ids), {r: removals[r] for r in run_ids if removals[r] != 1}
    assert stats["duplicates"] == 0, stats


def test_a_compensation_that_fails_for_good_parks_the_run_with_a_card(system):
    run_id = _submit(system, {**CHAIN, "faults": {**FAILS_AT_THE_END, "undo:pay": ["fatal"]}})
    run = _settles_in(run_id, [Run.Status.COMPENSATION_FAILED, Run.Status.COMPENSATED], system)
    assert run.status == Run.Status.COMPENSATION_FAILED and "400" in run.error
    cards = system.reviewer.get("/api/approvals?status=pending").body
    (card,) = [c for c in cards if c["run_id"] == run_id]
    assert card["kind"] == "undo_failed"
    # Nothing lost: the note was undone, the payment stands (its reversal was refused) and says so.
    assert _applied(run_id, "crm", "removes") == 1 and _applied(run_id, "payments", "reverses") == 0
    outcomes = [
        d["outcome"]
        for d in AuditEntry.objects.filter(run_id=run_id, action="run.compensation")
        .order_by("id")
        .values_list("data", flat=True)
    ]
    assert outcomes == ["done", "failed"]
    # A person says they reversed it by hand: the run ends compensated, the by-hand outcome recorded.
    response = system.reviewer.post(
        f"/api/approvals/{card['id']}/decision",
        {"decision": "reject", "comment": "reversed at the bank by hand", "version": card["version"]},
    )
    assert response.status == 200, response
    run = _settles_in(run_id, [Run.Status.COMPENSATED], system)
    assert [e["undo"] for e in run.result["effects"]] == ["by_hand", "done"]


def test_reject_and_undo_on_the_email_card_after_the_payment_reverses_it_once(system):
    """support_agent: it refunds an order, then asks to email the customer; the reviewer rejects the email with
    "reject and undo": the refund's reversal asks for a person's yes, then is made once."""
    response = system.agent.post(
        "/api/runs",
        {
            "workflow": "support_agent",
            "input": {"customer_id": "cus_1042", "message": "Refund ord_10421 please, 20 EUR", "order_id": "ord_10421"},
        },
    )
    assert response.status == 202, response
    run_id = response.body["id"]

    def pending():
        return [c for c in system.reviewer.get("/api/approvals?status=pending").body if c["run_id"] == run_id]

    decided: set[int] = set()
    for _ in range(3):
        (card,) = wait_with_logs(
            lambda: [c for c in pending() if c["id"] not in decided],
            "a card of the support run",
            system.workers.all,
            60,
        )
        if "subject" in card["proposed"]:
            break
        response = system.reviewer.post(
            f"/api/approvals/{card['id']}/decision", {"decision": "approve", "version": card["version"]}
        )
        assert response.status == 200, response
        decided.add(card["id"])
    assert "subject" in card["proposed"], card
    assert SandboxCall.objects.filter(run_id=run_id, system="payments", applied=True).count() == 1
    response = system.reviewer.post(
        f"/api/approvals/{card['id']}/decision",
        {"decision": "reject", "comment": "wrong order: undo the refund", "undo": True, "version": card["version"]},
    )
    assert response.status == 200, response
    (reversal,) = wait_with_logs(
        lambda: [c for c in pending() if c["kind"] == "undo"], "the reversal's card", system.workers.all, timeout=60
    )
    assert _applied(run_id, "payments", "reverses") == 0  # nothing before the person's yes
    response = system.reviewer.post(
        f"/api/approvals/{reversal['id']}/decision", {"decision": "approve", "version": reversal["version"]}
    )
    assert response.status == 200, response
    run = _settles_in(run_id, [Run.Status.COMPENSATED, Run.Status.COMPENSATION_FAILED], system)
    assert run.status == Run.Status.COMPENSATED, run.error
    assert _applied(run_id, "payments", "reverses") == 1
    assert not SandboxCall.objects.filter(run_id=run_id, system="email", applied=True).exists()
