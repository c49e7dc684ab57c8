"""A worker's life: recovery after a SIGKILL mid-step, and its memory over thousands of runs.

    .venv/bin/python bench/worker_life.py [--memory-runs 1000,10000] [--skip-recovery] [--skip-memory]

A new embedded PostgreSQL in a temporary folder (EMBEDDED_PGDATA), migrated and seeded here; runs are submitted
in this process (runs.submission.submit, as the API does); workers are the production command, `manage.py worker`, with
DATABASE_CONN_MAX_AGE=300 and WORKFLOW_MODULES=bench.noop_workflow.

* recovery: two workers; a `bench_slow` run (one step that sleeps) is taken by one of them, which is SIGKILLed
  once the step is running. Measured: from the SIGKILL until the other worker owns the run (Run.owner changes
  to a token of another job), with the production defaults (STALLED_AFTER_SECONDS 30, STALLED_SWEEP_SECONDS 10,
  WORKER_HEARTBEAT_INTERVAL 10) unless the environment sets them. The bound (docs/DESIGN-NOTES.md, "Recovery
  bound after a SIGKILL"): the run's lock is free at once, the recovery sweep runs every STALLED_SWEEP_SECONDS
  and its job is taken at worst at the next poll: S + P = 11 s plus a claim. Baseline, in the same run: the
  time the same worker takes to pick up a newly submitted run (the floor of "another worker takes it").
* memory: one worker; `bench_noop` runs (one empty step) in batches of 500; the worker's RSS (psutil) after
  the first batch (baseline), then after each size in --memory-runs. Goal: no growth beyond noise.

Prints a table and `BENCH_JSON {...}` lines for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


T0 = time.monotonic()


def progress(what: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {what}", file=sys.stderr, flush=True)


def start_worker(env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "manage.py", "worker"],
        cwd=ROOT,
        env=env,
        stdout=open(log, "ab"),  # noqa: SIM115 - the child keeps it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    sys.exit(f"timed out after {timeout:.0f} s waiting for {what}")


def recovery(env: dict, tmp: Path) -> dict:
    from django.contrib.auth.models import User
    from procrastinate.contrib.django.models import ProcrastinateWorker

    from runs import submission  # after django.setup(): it imports the models
    from runs.models import Run

    agent = User.objects.get(username="agent")
    env = {**env, "BENCH_SLOW_STEP_SECONDS": "600"}
    workers = [start_worker(env, tmp / f"recovery-{i}.log") for i in range(2)]
    try:
        wait_until(lambda: ProcrastinateWorker.objects.count() >= 2, 120, "two worker heartbeats")
        progress("two workers up")
        # Baseline: a new run picked up by a live worker (submission to owned).
        started = time.perf_counter()
        probe = submission.submit(workflow="bench_noop", input={"i": -1}, created_by=agent)[0]
        wait_until(lambda: Run.objects.get(pk=probe.pk).status == "succeeded", 60, "the probe run")
        pickup = time.perf_counter() - started

        run = submission.submit(workflow="bench_slow", input={"i": 0}, created_by=agent)[0]
        owner = wait_until(lambda: Run.objects.get(pk=run.pk).owner, 60, "a worker to take the slow run")
        time.sleep(0.5)  # in the step's sleep
        victim = next(
            (w for w in workers if any(str(w.pid) in part for part in owner.split("/"))),
            None,
        )
        if victim is None:  # the owner token names the worker by host:pid:start; fall back to the job's lock
            victim = workers[0]
            for worker in workers:
                if f":{worker.pid}:" in owner:
                    victim = worker
        progress("killing the slow run's worker")
        os.killpg(victim.pid, signal.SIGKILL)
        killed = time.perf_counter()
        victim.wait()

        def resumed():
            now = Run.objects.get(pk=run.pk).owner
            return now and now != owner

        wait_until(resumed, 300, "another worker to resume the run", interval=0.1)
        seconds = time.perf_counter() - killed
        from django.conf import settings

        return {
            "bench": "recovery",
            "seconds": round(seconds, 2),
            "baseline_pickup_s": round(pickup, 3),
            "stalled_after_s": settings.STALLED_AFTER_SECONDS,
            "sweep_s": settings.STALLED_SWEEP_SECONDS,
            "heartbeat_s": settings.PROCRASTINATE_WORKER_DEFAULTS["update_heartbeat_interval"],
            "owner_named_victim": f":{victim.pid}:" in owner,
        }
    finally:
        for worker in workers:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()


def memory(env: dict, tmp: Path, sizes: list[int]) -> dict:
    from django.contrib.auth.models import User
    from django.db import transaction

    from runs.models import Run

    agent = User.objects.get(username="agent")
    # The recovery case's run is still in its (slow) step: here it finishes at once instead of holding the worker.
    worker = start_worker({**env, "BENCH_SLOW_STEP_SECONDS": "0"}, tmp / "memory.log")
    proc = psutil.Process(worker.pid)
    done = 0
    batch = 500
    rss = {}
    started = time.perf_counter()
    try:

        def run_batch(n: int) -> None:
            from runs import submission  # after django.setup(): it imports the models

            nonlocal done
            with transaction.atomic():
                for i in range(n):
                    submission.submit(
                        workflow="bench_noop", input={"i": done + i}, created_by=agent, tenant=f"m{done + i}"
                    )
            done += n
            wait_until(
                lambda: Run.objects.filter(workflow="bench_noop", status="succeeded").count() >= done,
                600,
                f"{done} runs",
                interval=0.2,
            )

        first = min(batch, sizes[0])
        run_batch(first)
        rss[done] = proc.memory_info().rss
        for size in sizes:
            while done < size:
                run_batch(min(batch, size - done))
            rss[done] = proc.memory_info().rss
        seconds = time.perf_counter() - started
    finally:
        stop(worker)
    baseline = rss[first]
    return {
        "bench": "memory",
        "rss_mib": {str(k): round(v / 2**20, 1) for k, v in rss.items()},
        "baseline_runs": first,
        "growth_mib": round((rss[max(rss)] - baseline) / 2**20, 1),
        "runs_per_s": round(done / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-runs", default="1000,10000")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-worker-life-"))
    if not os.environ.get("BENCH_KEEP_TMP"):
        # Registered before Django starts the embedded server, so it runs after the server's own stop handler.
        atexit.register(shutil.rmtree, tmp, True)
    os.environ.pop("DATABASE_URL", None)
    os.environ["EMBEDDED_PGDATA"] = str(tmp / "pgdata")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    os.environ["LOG_LEVEL"] = "WARNING"
    os.environ["WORKFLOW_MODULES"] = "bench.noop_workflow"
    import django
    from django.conf import settings
    from django.core.management import call_command

    django.setup()
    progress("migrating")
    call_command("migrate", verbosity=0)
    call_command("demo_setup", verbosity=0)
    progress("migrated")
    env = {
        **os.environ,
        "DATABASE_URL": settings.DATABASE_URL,
        "DATABASE_CONN_MAX_AGE": "300",
        "PYTHONUNBUFFERED": "1",
        "LOG_LEVEL": os.environ.get("BENCH_WORKER_LOG_LEVEL", "WARNING"),
    }
    try:
        if not args.skip_recovery:
            r = recovery(env, tmp)
            print(
                f"recovery: SIGKILL mid-step -> another worker owns the run after {r['seconds']:.1f} s "
                f"(STALLED_AFTER_SECONDS {r['stalled_after_s']:g}, sweep every {r['sweep_s']:g} s, heartbeat "
                f"{r['heartbeat_s']:g} s); baseline: a new run taken and finished in {r['baseline_pickup_s']:.3f} s"
            )
            print("BENCH_JSON " + json.dumps(r))
        if not args.skip_memory:
            progress("memory")
            m = memory(env, tmp, [int(s) for s in args.memory_runs.split(",")])
            print(
                "memory: worker RSS "
                + ", ".join(f"{mib} MiB after {runs} runs" for runs, mib in m["rss_mib"].items())
                + f"; growth since the first batch {m['growth_mib']:+.1f} MiB ({m['runs_per_s']} runs/s)"
            )
            print("BENCH_JSON " + json.dumps(m))
    finally:
        from django.db import connections

        connections.close_all()
        if os.environ.get("BENCH_KEEP_TMP"):
            print(f"kept {tmp}")


if __name__ == "__main__":
    main()
