"""Workflows that do nothing, the baselines of bench/throughput.py.

Registered when a process starts with WORKFLOW_MODULES=bench.noop_workflow (the bench sets it for the worker
and for the process that submits the runs). Their steps return at once, so a run of them costs only what the
engine and Procrastinate add: the job fetch, claiming the run, one checkpoint transaction per step, finishing.

* `bench_noop`: one step. Per-run overhead.
* `bench_noop6`: six steps, the refund demo's shape without its work (no model, no tools, no receipts).
"""

from __future__ import annotations

from runs.workflow import Workflow, register

noop = register(Workflow("bench_noop", description="One compute step that does nothing (bench baseline)."))


@noop.compute
def nothing(ctx):
    return {}


noop6 = register(Workflow("bench_noop6", description="Six compute steps that do nothing (bench baseline)."))

for _i in range(6):
    noop6.compute(lambda ctx: {}, name=f"nothing_{_i}")


# `bench_slow`: one step that sleeps BENCH_SLOW_STEP_SECONDS (default 60), the mid-step target of
# bench/worker_life.py's recovery case (a worker SIGKILLed while it runs).
slow = register(Workflow("bench_slow", description="One compute step that sleeps (bench recovery target)."))


@slow.compute
def sleep_a_while(ctx):
    import os
    import time

    time.sleep(float(os.environ.get("BENCH_SLOW_STEP_SECONDS", "60")))
    return {}


# `bench_noop5`: five empty steps, the engine side of bench/throughput_workers.py.
noop5 = register(Workflow("bench_noop5", description="Five compute steps that do nothing (bench)."))

for _i in range(5):
    noop5.compute(lambda ctx: {}, name=f"nothing_{_i}")


# The baseline of bench/throughput_workers.py: plain Procrastinate, one job per run doing the same five step
# writes the cheapest durable way, each one INSERT in its own transaction (no engine, no Run row, no owner).
PLAIN_TABLE = "bench_plain_step"


def _plain_task():
    from procrastinate.contrib.django import app

    @app.task(name="bench_plain_run", queue="agent", pass_context=False)
    def bench_plain_run(run: int) -> None:
        from django.db import connection, transaction

        for seq in range(5):
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(
                    f"INSERT INTO {PLAIN_TABLE} (run, seq, output) VALUES (%s, %s, '{{}}'::jsonb)", [run, seq]
                )

    return bench_plain_run


bench_plain_run = _plain_task()
