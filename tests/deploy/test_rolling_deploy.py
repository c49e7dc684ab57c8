"""The deploy, proven (issue 26): compose.yaml's stack under load while a new release rolls out, and a worker
container SIGKILLed mid-payment. What each case measured is printed (`make test-deploy` shows it) and recorded in
docs/RELIABILITY.md."""

from __future__ import annotations

import random
import threading
import time

from tests.deploy.stack import Stack

RUNS = 40
GATED_CENTS = 2500  # over AUTO_APPROVE_CENTS (2000): each refund waits for the reviewer


def refund(i: int, latency_ms: int) -> dict:
    return {
        "workflow": "refund",
        "idempotency_key": f"deploy-{i}",
        "input": {
            "customer_id": f"deploy-{i}",
            "amount_cents": GATED_CENTS + i,
            "currency": "EUR",
            "reason": "the rolling deploy test",
            # The payment itself takes this long: a worker stopping mid-payment is the case that matters.
            "faults": {"issue_refund": [f"latency:{latency_ms}"]},
        },
    }


def submit(stack: Stack, body: dict) -> str:
    """A run's id, submitted as a careful client does: again with the same key after a failed attempt."""
    for _ in range(20):
        answer = stack.call("POST", "/api/runs", body)
        if answer.status in (200, 202):
            return answer.body["id"]
        time.sleep(1)
    raise AssertionError(f"run {body['idempotency_key']} not accepted: {answer}")


class Reviewer(threading.Thread):
    """Approves every pending card through the API, as it appears, until stopped."""

    def __init__(self, stack: Stack):
        super().__init__(daemon=True, name="reviewer")
        self.stack = stack
        self.stop = threading.Event()
        self.approved: set[int] = set()

    def run(self):
        while not self.stop.is_set():
            answer = self.stack.call("GET", "/api/approvals?status=pending", user="reviewer")
            for card in answer.body if answer.status == 200 else []:
                if card["id"] in self.approved:
                    continue
                decided = self.stack.call(
                    "POST",
                    f"/api/approvals/{card['id']}/decision",
                    {"decision": "approve", "version": card["version"]},
                    user="reviewer",
                )
                if decided.status == 200:
                    self.approved.add(card["id"])
            self.stop.wait(0.5)


def statuses(stack: Stack, run_ids: list[str]) -> dict[str, str]:
    found = {}
    for run_id in run_ids:
        answer = stack.call("GET", f"/api/runs/{run_id}", record=False)
        found[run_id] = answer.body["status"] if answer.status == 200 else f"HTTP {answer.status}"
    return found


def all_succeeded(stack: Stack, run_ids: list[str]) -> bool:
    return set(statuses(stack, run_ids).values()) == {"succeeded"}


def failed_requests(stack: Stack) -> list:
    return [a for a in stack.answers if a.status == 0 or a.status >= 500]


def test_a_rolling_deploy_under_load_loses_nothing_and_pays_each_refund_once(stack: Stack):
    before = stack.sandbox()
    reviewer = Reviewer(stack)
    reviewer.start()
    latencies = random.Random(26).choices(range(2_000, 20_001), k=RUNS)
    run_ids: list[str] = []
    try:
        for i, latency in enumerate(latencies):
            run_ids.append(submit(stack, refund(i, latency)))
            time.sleep(0.25)
        # The roll starts while payments are in flight on both workers.
        stack.wait(lambda: list(statuses(stack, run_ids).values()).count("running") >= 4, "payments in flight", 120)
        started = time.monotonic()
        rolled = stack.rollout(stack.images["RELEASE_2"])
        roll_seconds = time.monotonic() - started
        assert rolled.returncode == 0, f"rollout failed:\n{rolled.stdout}\n{rolled.stderr}"
        stack.wait(lambda: all_succeeded(stack, run_ids), f"all {RUNS} runs succeeded", 300)
    finally:
        reviewer.stop.set()
        reviewer.join(10)
    after = stack.sandbox()

    # Every run succeeded, and paid exactly once.
    assert after["duplicates"] == 0
    assert after["channels"]["payments"] - before["channels"]["payments"] == RUNS
    assert after["channels"]["email"] - before["channels"]["email"] == RUNS
    # No job left running, the audit chain whole.
    assert stack.sql("SELECT count(*) FROM procrastinate_jobs WHERE status = 'doing'") == "0"
    stack.manage("audit_verify")
    # The release is everywhere, its migration applied.
    release_2 = stack.images["RELEASE_2"]
    for service in ("web", "worker"):
        assert [stack.image_of(c) for c in stack.containers(service)] == [release_2, release_2], service
    assert (
        stack.sql(
            "SELECT count(*) FROM information_schema.columns WHERE table_name = 'runs_run' "
            "AND column_name = 'deploy_release'"
        )
        == "1"
    )
    # No request failed: the roll keeps a web replica up, and HAProxy sends a request that could not connect to
    # a stopping replica on to another.
    failed = failed_requests(stack)
    # Steps taken up again: a payment that outlived its worker's graceful timeout, recovered by another worker.
    recovered = int(stack.sql("SELECT count(*) FROM runs_step WHERE attempt > 1"))
    print(
        f"\nrolling deploy: {RUNS} runs, {len(reviewer.approved)} cards approved, {len(stack.answers)} requests, "
        f"{len(failed)} failed; rollout {roll_seconds:.0f} s; steps taken up again after their worker stopped: "
        f"{recovered}; payments +{after['channels']['payments'] - before['channels']['payments']}, "
        f"duplicates {after['duplicates']}\n{rolled.stderr}"
    )
    assert failed == [], failed[:10]


def test_a_worker_container_sigkilled_mid_payment_is_recovered_and_pays_once(stack: Stack):
    """`podman kill` (SIGKILL) of the worker container paying a refund: another worker's stalled-job sweep takes
    the run up within the stalled bound, the receipt path finds the payment's idempotency key, and it pays once."""
    before = stack.sandbox()
    reviewer = Reviewer(stack)
    reviewer.start()
    try:
        run_id = submit(stack, refund(1000, 15_000))

        def paying():
            answer = stack.call("GET", f"/api/runs/{run_id}", record=False)
            if answer.body["current_step"] != "issue_refund" or answer.body["status"] != "running":
                return None
            # The run's job now: the worker that logged its start is the one paying.
            job_id = stack.sql(
                f"SELECT id FROM procrastinate_jobs WHERE status = 'doing' AND args->>'run_id' = '{run_id}'"
            )
            started = f"Starting job advance_run[{job_id}]"
            holders = [c for c in stack.containers("worker") if job_id and started in stack.logs(c)]
            return holders[0] if len(holders) == 1 else None

        holder = stack.wait(paying, "the refund's payment in flight on one worker", 120)
        killed_job = stack.sql(
            f"SELECT id FROM procrastinate_jobs WHERE status = 'doing' AND args->>'run_id' = '{run_id}'"
        )
        time.sleep(2)  # well inside the 15 s payment
        stack.podman("kill", "--signal", "KILL", holder)
        killed_at = time.monotonic()

        def taken_up_again():
            # A job of the run's other than the killed one, started by the surviving worker.
            return stack.sql(
                f"SELECT count(*) FROM procrastinate_jobs WHERE args->>'run_id' = '{run_id}' AND id > {killed_job} "
                "AND status IN ('doing', 'succeeded')"
            ) != "0" or all_succeeded(stack, [run_id])

        stack.wait(taken_up_again, "the run taken up again after the kill", 120)
        reclaimed_in = time.monotonic() - killed_at
        stack.wait(lambda: all_succeeded(stack, [run_id]), "the run succeeded after the kill", 180)
        recovered_in = time.monotonic() - killed_at
    finally:
        reviewer.stop.set()
        reviewer.join(10)
    after = stack.sandbox()
    assert after["duplicates"] == 0
    assert after["channels"]["payments"] - before["channels"]["payments"] == 1
    assert stack.sql("SELECT count(*) FROM procrastinate_jobs WHERE status = 'doing'") == "0"
    # The bound: the sweep sees the dead worker's job after STALLED_AFTER_SECONDS without a heartbeat (it sweeps
    # every 10 s), then the payment runs again from the start (15 s), answered by its idempotency key.
    bound = float(stack.settings["STALLED_AFTER_SECONDS"]) + 10 + 15 + 10
    print(
        f"\nSIGKILL mid-payment: the run taken up again {reclaimed_in:.1f} s after the kill, succeeded after "
        f"{recovered_in:.1f} s (bound {bound:.0f} s); payments +1, duplicates {after['duplicates']}"
    )
    assert recovered_in < bound
