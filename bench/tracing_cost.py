"""What traces cost the engine's step throughput (core.tracing, docs/observability.md), in one run of the bench:

    .venv/bin/python bench/tracing_cost.py [--database pg15|embedded] [--runs 1000] [--workers 1] [--rounds 2]

Batches of bench/throughput_workers.py (runs of 5 no-op compute steps, `bench_noop5`, on freshly started production
workers, `manage.py worker`), in one database and one process, alternated `--rounds` times (off and on swapping places
every round) so that a drift of the machine touches each alike; the medians are compared:
* plain: plain Procrastinate doing the same five writes (the baseline of throughput_workers.py);
* off: the engine with no OTEL_* variable (tracing off, as deployed by default);
* on: the engine exporting every step's `run.step` span over OTLP/HTTP (BatchSpanProcessor, the SDK's defaults) to
  a receiver in this process, which decodes each export and counts its spans (a collector's work, not the worker's).
A batch's workers start with its environment, so `off` and `on` differ only by OTEL_EXPORTER_OTLP_ENDPOINT.

Off, the cost is also measured directly: the hooks a step passes through with tracing off (the step's span, a model
or tool call's, an effect's, the log processor), timed in this process (ns per step), against a step's time.

Prints a table and one `BENCH_JSON {...}` line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import timeit
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.throughput_workers import bench_database, measure  # noqa: E402 - after the path is set


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, decoded; counts the spans."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans = 0
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                with lock:
                    receiver.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="otlp").start()


def hooks_off_ns(rounds: int = 200_000) -> float:
    """ns per step of the tracing hooks a step passes with tracing off: its span (runs.engine._step_span), one model
    or tool call's check (runs.tape), one effect's (runs.steps) and the log processor (core.tracing.add_span_id)."""
    from core import tracing
    from runs import engine
    from runs.models import Run
    from runs.steps import StepDef

    assert not tracing.ENABLED
    run, step, job = Run(workflow="bench_noop5", input={}), StepDef("s", "compute", lambda ctx: {}), engine.JobInfo()

    def one_step():
        with engine._step_span(run, step, job):
            pass
        with tracing.span("tool.read") if tracing.ENABLED else tracing.NULL:  # a call (runs.tape.Recorder._call)
            pass
        with tracing.span("effect.call") if tracing.ENABLED else tracing.NULL:  # an effect (runs.steps.Context)
            pass
        tracing.note("hitl.effect.outcome", "new")
        tracing.add_span_id(None, "info", {})

    def nothing():
        pass

    best = min(timeit.repeat(one_step, number=rounds, repeat=5))
    empty = min(timeit.repeat(nothing, number=rounds, repeat=5))
    return (best - empty) / rounds * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=("pg15", "embedded"), default="pg15")
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with bench_database(args, "tracing", drop_env=("OTEL_",)) as (url, version, tmp, env):
        receiver = Receiver()
        variants = {
            "plain": ("plain", env),
            "off": ("engine", env),
            "on": ("engine", {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}),
        }
        load_before = os.getloadavg()[0]
        results: dict[str, list[dict]] = {name: [] for name in variants}
        spans_before = 0
        for round_ in range(args.rounds):
            # off and on swap places every round (ABBA): a machine that slows down or speeds up meanwhile touches both
            order = ["plain", "off", "on"] if round_ % 2 == 0 else ["plain", "on", "off"]
            for name in order:
                kind, batch_env = variants[name]
                result = measure(url, batch_env, tmp, kind, args.workers, args.runs, batch=f"{name}{round_}")
                result["variant"] = name
                result["spans"] = receiver.spans - spans_before
                spans_before = receiver.spans
                results[name].append(result)
                print(
                    f"round {round_ + 1} {name:5s}: {result['steps_per_s']:8.1f} steps/s ({result['seconds']} s),"
                    f" {result['spans']} spans received",
                    flush=True,
                )
        hooks_ns = hooks_off_ns()
        medians = {name: round(statistics.median(r["steps_per_s"] for r in rs), 1) for name, rs in results.items()}
        step_us = 1e6 / medians["off"] * args.workers  # a step's wall time on one worker process, about
        print(
            f"\ntracing cost on {args.database} (PostgreSQL {version}), {args.runs} runs x 5 steps per batch,"
            f" {args.workers} worker process(es), {args.rounds} rounds; load average {load_before:.1f} before,"
            f" {os.getloadavg()[0]:.1f} after"
        )
        print(f"{'variant':>8s} {'steps/s (median)':>17s} {'each round':>24s} {'vs off':>7s}")
        for name, rs in results.items():
            each = ", ".join(f"{r['steps_per_s']:.1f}" for r in rs)
            print(f"{name:>8s} {medians[name]:17.1f} {each:>24s} {medians[name] / medians['off']:7.3f}")
        print(
            f"tracing off: its hooks cost {hooks_ns:.0f} ns per step, {hooks_ns / (step_us * 1000) * 100:.4f} % of a"
            f" step ({step_us:.0f} us per step per worker)"
        )
        print(
            "BENCH_JSON "
            + json.dumps(
                {
                    "bench": "tracing_cost",
                    "database": args.database,
                    "server_version": version,
                    "workers": args.workers,
                    "runs": args.runs,
                    "median_steps_per_s": medians,
                    "on_vs_off": round(medians["on"] / medians["off"], 3),
                    "off_vs_plain": round(medians["off"] / medians["plain"], 3),
                    "hooks_off_ns_per_step": round(hooks_ns),
                    "results": [r for rs in results.values() for r in rs],
                }
            )
        )


if __name__ == "__main__":
    main()
