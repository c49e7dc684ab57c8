"""`make bench`: every benchmark, each with its baseline measured in the same run; prints a table and the JSON
lines, and rewrites docs/BENCHMARKS.md (not with BENCH_SMOKE=1, the tiny CI version, which writes nothing).

    .venv/bin/python bench/run_all.py          # make bench
    BENCH_SMOKE=1 .venv/bin/python bench/run_all.py   # make bench-smoke (CI)

Sizes: BENCH_SMOKE=1 makes every size tiny; BENCH_SCALE (default 1) multiplies the big sizes (cards, audit
entries, memory runs, waiting agents) for a quicker full run, e.g. BENCH_SCALE=0.1. BENCH_ONLY=enqueue,resume runs
a subset.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SMOKE = os.environ.get("BENCH_SMOKE", "") not in ("", "0")
SCALE = float(os.environ.get("BENCH_SCALE", "1"))
ONLY = [s for s in os.environ.get("BENCH_ONLY", "").split(",") if s]


def n(full: int, smoke: int) -> int:
    return smoke if SMOKE else max(1, int(full * SCALE))


def pg15_up() -> bool:
    return subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1", "-p", "5432"], check=False).returncode == 0


def cases(only: bool = True) -> list[tuple[str, str, list[str], dict, str]]:
    """(section, title, argv, extra env, what the baseline is); `only`: those BENCH_ONLY names."""
    enqueue_args = ["--duration", "1" if SMOKE else "10", "--connections", "16" if SMOKE else "1,16,64"]
    if not SMOKE:
        # Group commit against each run by itself, same run (runs.group_commit; GROUP_COMMIT=0).
        enqueue_args += ["--profile", "--compare", "production-single"]
    quick_recovery = {"STALLED_AFTER_SECONDS": "3", "STALLED_SWEEP_SECONDS": "1", "WORKER_HEARTBEAT_INTERVAL": "1"}
    out = []
    if pg15_up():
        out.append(
            (
                "enqueue",
                "enqueue, machine's PostgreSQL 15 (TCP)",
                ["bench/enqueue.py", "--database", "pg15", *enqueue_args],
                {},
                "POST /bench/insert on the same server: one INSERT in autocommit, no auth (console/bench_views.py)",
            )
        )
    if pg15_up():
        out.append(
            (
                "throughput",
                "throughput, machine's PostgreSQL 15 (TCP)",
                ["bench/throughput_workers.py", "--database", "pg15", "--runs", str(n(1000, 10))]
                + (["--workers", "1"] if SMOKE else []),
                {},
                "plain Procrastinate, one job per run doing the same five INSERTs, each its own transaction, on the"
                " same workers (bench_plain_run in bench/noop_workflow.py)",
            )
        )
    if pg15_up():
        out.append(
            (
                "tracing",
                "tracing: the engine's step throughput with traces off and on, machine's PostgreSQL 15 (TCP)",
                ["bench/tracing_cost.py", "--database", "pg15", "--runs", str(n(1000, 10)), "--rounds", str(n(4, 1))],
                {},
                "plain Procrastinate on the same workers; off and on alternate round by round (docs/observability.md)",
            )
        )
    if pg15_up() and not SMOKE:
        # Not in `make bench-smoke`: it would install the peers' virtualenv (~50 packages) on every CI run, to compare
        # with other frameworks rather than check the console's code (bench/peers.py).
        out.append(
            (
                "peers",
                "peers: the engine against DBOS and LangGraph on the same workload, machine's PostgreSQL 15 (TCP)",
                ["bench/peers.py", "--runs", str(n(1000, 10)), "--rounds", str(n(3, 1))],
                {},
                "the engine's own steps/s in the same rounds (each peer's ratio is the engine's median over the"
                " peer's), and plain Procrastinate on the engine's worker",
            )
        )
    if pg15_up():
        out.append(
            (
                "webhook",
                "signed webhooks, machine's PostgreSQL 15 (TCP)",
                ["bench/webhook_latency.py", "--duration", "1" if SMOKE else "10"],
                {"_FRESH_PG_DB": "bench_webhook"},
                "GET /healthz on the same server under the same connections; the duplicate-delivery path",
            )
        )
    if pg15_up():
        out.append(
            (
                "longpoll",
                "long-poll: the inbox while agents wait, machine's PostgreSQL 15 (TCP)",
                ["bench/longpoll.py", "--agents", str(n(1000, 20)), "--duration", "1" if SMOKE else "10"],
                {},
                "the same GET /api/approvals on the same server, with the same cards, while nobody waits",
            )
        )
    # The latency a person waits for (issue 21.4): on PostgreSQL 15 when it is up, else on the embedded server.
    latency_db = ["--database", "pg15"] if pg15_up() else ["--database", "embedded"]
    latency_on = "machine's PostgreSQL 15 (TCP)" if pg15_up() else "embedded PostgreSQL"
    out += [
        (
            "enqueue",
            "enqueue, embedded PostgreSQL (unix socket)",
            ["bench/enqueue.py", "--database", "embedded", *enqueue_args],
            {},
            "POST /bench/insert on the same server: one INSERT in autocommit, no auth (console/bench_views.py)",
        ),
        (
            "throughput",
            "throughput, embedded PostgreSQL",
            ["bench/throughput_workers.py", "--database", "embedded", "--runs", str(n(300, 10))]
            + (["--workers", "1"] if SMOKE else []),
            {},
            "plain Procrastinate, one job per run doing the same five INSERTs, each its own transaction, on the same"
            " workers (bench_plain_run in bench/noop_workflow.py)",
        ),
        (
            "resume",
            f"resume latency, back to back, {latency_on}",
            ["bench/resume_latency.py", *latency_db, "--runs", str(n(200, 5)), "--interval-ms", "0", "--closed-loop"],
            {},  # the production worker with its defaults (manage.py worker)
            "procrastinate 3.10's stock worker loop (WORKER_KEEP_NOTIFICATIONS=0) on the same database",
        ),
        (
            "resume",
            f"resume latency, with idle gaps, {latency_on}",
            ["bench/resume_latency.py", *latency_db, "--runs", str(n(50, 3)), "--interval-ms", "250"],
            {},  # the production worker with its defaults (manage.py worker)
            "procrastinate 3.10's stock worker loop (WORKER_KEEP_NOTIFICATIONS=0) on the same database",
        ),
        (
            "console",
            f"console: inbox and card, {latency_on}",
            ["bench/inbox.py", *latency_db, "--cards", str(n(100_000, 200)), "--requests", str(n(50, 2))],
            {},
            "the same pages with 10 open cards",
        ),
        (
            "console",
            "console: audit page",
            ["bench/audit_page.py", "--entries", str(n(1_000_000, 30_000)), "--requests", str(n(50, 2))],
            {},
            "/healthz and /audit/ on an empty log",
        ),
        (
            "replay",
            f"replay: a 50-step run on the deployed code, {latency_on}",
            ["bench/replay.py", *latency_db, "--steps", "50", "--repeat", str(n(20, 2))],
            {},
            "the same run executed once by the engine in the same process (its model, reads and effects are the"
            " demo's in-process fakes)",
        ),
        (
            "replay",
            "evaluate: a candidate rule over 10,000 recorded cards",
            ["bench/evaluate.py", "--cards", str(n(10_000, 300)), "--rounds", str(n(5, 1))],
            {},
            "the same cards and their decisions read alone (evals.records.recorded_cards), nothing evaluated or saved",
        ),
        (
            "recovery",
            "recovery and memory of a worker",
            ["bench/worker_life.py", "--memory-runs", f"{n(1000, 20)},{n(10_000, 60)}"],
            quick_recovery if SMOKE else {},
            "a new run picked up by a live worker; RSS after the first batch of runs",
        ),
    ]
    if SMOKE:
        # Every script once, on one database each (the machine's PostgreSQL 15 when it is up): CI's ~2 minutes.
        seen, smoke = set(), []
        for case in out:
            key = case[2][0]
            if key not in seen:
                seen.add(key)
                smoke.append(case)
        out = smoke
    return [c for c in out if not only or not ONLY or c[0] in ONLY]


def render() -> None:
    """docs/BENCHMARKS.md from bench/last_run.json (also: `bench/run_all.py --render`)."""
    sys.path.insert(0, str(ROOT))
    from bench import report

    data = json.loads((ROOT / "bench" / "last_run.json").read_text())
    (ROOT / "docs" / "BENCHMARKS.md").write_text(report.render(data["meta"], data["sections"]))


def main() -> None:
    if sys.argv[1:] == ["--render"]:
        render()
        return
    started = time.monotonic()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": head.stdout.strip(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
        "cpu": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "?",
        ),
        "python": platform.python_version(),
        "load_before": round(os.getloadavg()[0], 2),
        "smoke": SMOKE,
    }
    sections = []
    failed = []
    for section, title, argv, extra, baseline in cases():
        print(f"\n=== {title}: {' '.join(argv)}", flush=True)
        t0 = time.monotonic()
        load0 = os.getloadavg()[0]
        env = {**os.environ, **extra}
        fresh = env.pop("_FRESH_PG_DB", None)
        if fresh:  # a script that benches the database of DATABASE_URL gets a new one on the machine's server
            fresh = f"{fresh}_{os.getpid()}"
            subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc", f"CREATE DATABASE {fresh}"], check=True)
            env["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:5432/{fresh}"
        try:
            done = subprocess.run([PY, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        finally:
            if fresh:
                subprocess.run(
                    [
                        "psql",
                        "-h",
                        "127.0.0.1",
                        "-U",
                        "postgres",
                        "-qc",
                        f"DROP DATABASE IF EXISTS {fresh} WITH (FORCE)",
                    ],
                    check=False,
                )
        seconds = time.monotonic() - t0
        shown = {k: v for k, v in extra.items() if not k.startswith("_")}
        if fresh:
            shown["DATABASE_URL"] = "postgres://postgres@127.0.0.1:5432/<a new database>"
        output = done.stdout
        print(output, end="")
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            failed.append(title)
        results = [json.loads(m) for m in re.findall(r"^BENCH_JSON (.*)$", output, re.M)]
        sections.append(
            {
                "section": section,
                "title": title,
                "command": " ".join(f"{k}={v}" for k, v in shown.items())
                + (" " if shown else "")
                + ".venv/bin/python "
                + " ".join(argv),
                "baseline": baseline,
                "seconds": round(seconds, 1),
                "load": [round(load0, 1), round(os.getloadavg()[0], 1)],
                "ok": done.returncode == 0,
                "output": "\n".join(line for line in output.splitlines() if not line.startswith("BENCH_JSON ")),
                "results": results,
            }
        )
    meta["seconds"] = round(time.monotonic() - started, 1)
    meta["load_after"] = round(os.getloadavg()[0], 2)
    print("\n=== summary")
    for s in sections:
        print(
            f"{'ok  ' if s['ok'] else 'FAIL'} {s['title']:45s} {s['seconds']:7.1f} s"
            f"  load {s['load'][0]}->{s['load'][1]}"
        )
    for s in sections:
        for r in s["results"]:
            print("BENCH_JSON " + json.dumps(r))
    print(f"total {meta['seconds']:.0f} s")
    if not SMOKE:
        last = ROOT / "bench" / "last_run.json"
        if ONLY and last.exists():
            # A subset re-run (BENCH_ONLY): its sections replace those of the last full run, the others stay.
            previous = json.loads(last.read_text())
            # Sections `make bench` no longer produces (a renamed or moved case) go; the others stay.
            produced = {case[1] for case in cases(only=False)}
            previous["sections"] = [x for x in previous["sections"] if x["title"] in produced]
            fresh = {x["title"] for x in sections}
            sections = [
                x if x["title"] not in fresh else next(y for y in sections if y["title"] == x["title"])
                for x in previous["sections"]
            ] + [y for y in sections if y["title"] not in {x["title"] for x in previous["sections"]}]
            # A re-run of the same sections replaces the earlier re-run's note, as it replaced its sections.
            earlier = [r for r in previous["meta"].get("reruns", []) if r.get("only") != ONLY]
            reruns = [*earlier, {**meta, "only": ONLY}]
            meta = {**{k: v for k, v in previous["meta"].items() if k != "rerun"}, "reruns": reruns}
        last.write_text(json.dumps({"meta": meta, "sections": sections}, indent=1))
        render()
        print("wrote docs/BENCHMARKS.md and bench/last_run.json")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
