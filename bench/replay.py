"""Replay of a 50-step run on the deployed code (runs.replay), against the time the run took to execute.

    .venv/bin/python bench/replay.py [--database pg15|embedded] [--steps 50] [--repeat 20]

Runs on a new database (bench_replay_<pid> on the machine's PostgreSQL 15 over TCP, or an embedded one), dropped at
the end. A workflow of `--steps` steps, in threes: a model call (the demo's scripted model, `classify`), a CRM read,
a CRM note (an effect, through its receipt); it runs once through the engine in this process (engine.advance, the
worker's job), and that time is the baseline. Then `replay()` of the finished run, `--repeat` times: every answer
from the record, no call. Prints p50 and max of the replay's wall time, the run's own time, and the figure the issue
asks for (under 1 s).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.inbox import setup_django  # noqa: E402


def long_workflow(steps: int):
    from runs.workflow import Workflow, register

    workflow = register(Workflow(f"bench_replay_{steps}"))
    for i in range(steps):
        kind = ("compute", "read", "effect")[i % 3]
        if kind == "compute":
            workflow.compute(name=f"think{i}")(
                lambda ctx, i=i: ctx.model.complete("classify", reason=f"step {i}: damaged", amount_cents=100 + i)
            )
        elif kind == "read":
            workflow.read(name=f"look{i}")(lambda ctx: ctx.tools.crm.get_customer("cus_1042"))
        else:

            def note(ctx, i=i):
                text = f"step {i}: {ctx.outputs[f'think{i - 2}']['category']}"
                crm = ctx.tools.crm
                return ctx.effect(
                    lambda key: crm.add_note(customer_id="cus_1042", text=text, idempotency_key=key),
                    preview={"text": text},
                )

            workflow.effect("crm", name=f"note{i}")(note)
    return workflow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database", choices=("pg15", "embedded"), default="pg15")
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    setup_django(args.database, args.pg_url, name="replay")

    from runs import engine, submission
    from runs import replay as replays
    from runs.models import Run

    workflow = long_workflow(args.steps)
    run = submission.submit(workflow=workflow.name, input={})[0]
    started = time.perf_counter()
    engine.advance(run.id, engine.JobInfo())
    executed = time.perf_counter() - started
    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED, (run.status, run.error)

    times = []
    for _ in range(args.repeat + 1):
        report = replays.replay(run)
        assert report.identical and len(report.steps) == args.steps and report.calls == 0, report.summary()
        times.append(report.ms)
    times = times[1:]  # the first warms the workflow's imports and the connection
    p50, worst = statistics.median(times), max(times)
    print(f"database: {args.database}; a {args.steps}-step run, {sum(s.fed for s in report.steps)} recorded answers")
    print(f"  executed once by the engine:   {executed * 1000:8.1f} ms")
    print(f"  replayed ({args.repeat} times): p50 {p50:8.1f} ms, max {worst:8.1f} ms, 0 calls")
    print(f"  goal: a 50-step replay under 1 s: {'met' if worst < 1000 else 'NOT met'}")


if __name__ == "__main__":
    main()
