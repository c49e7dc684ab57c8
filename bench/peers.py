"""The engine against its peers, DBOS and LangGraph, on the same workload in the same run: runs of five no-op durable
steps, each step's completion persisted, on the machine's PostgreSQL 15 over TCP.

    .venv/bin/python bench/peers.py [--runs 1000] [--rounds 3] [--peers dbos,dbos-queue,langgraph,langgraph-async]

The peers are not the console's dependencies: they are installed into a virtualenv of this script's own,
.bench-peers-venv/ in the repository (made with `python -m venv` from this interpreter, from the exact pins of
bench/peers-requirements.txt; made again when that file or the interpreter changes, reused otherwise), and each batch
runs in it, as bench/peers_runner.py (its docstring says how each peer is driven), on a fresh database created and
dropped here. So anyone can re-run the comparison with this one command. Not part of `make bench-smoke` (CI): the
peers' virtualenv would cost CI an install of ~50 packages for a comparison, not a check of the console's code.

In the same process, on the workload of bench/throughput_workers.py (whose batches are reused here, on one fresh
database of their own):
* engine: `bench_noop5` runs (five empty compute steps) on one production worker (`manage.py worker`);
* plain: plain Procrastinate doing the same five writes on the same worker (`bench_plain_run`);
* each peer in --peers, at the concurrency of the console's worker (WORKER_CONCURRENCY, 4 by default) unless
  --concurrency says otherwise.
--rounds rounds, alternated (the order reversed every other round), so that a drift of the shared machine touches
each alike; a figure is the median of its rounds, printed beside the spread of the rounds; the engine's ratio to
each peer is the ratio of the medians (goal: >= 2). Prints a table and one `BENCH_JSON {...}` line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.throughput_workers import bench_database, measure  # noqa: E402 - after the path is set

VENV = ROOT / ".bench-peers-venv"
REQUIREMENTS = ROOT / "bench" / "peers-requirements.txt"
RUNNER = ROOT / "bench" / "peers_runner.py"
PEERS = ("dbos", "dbos-queue", "langgraph", "langgraph-async")
GOAL = 2.0


def peers_python() -> Path:
    """The python of the peers' virtualenv, made or made again when its requirements or this interpreter changed."""
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    digest = hashlib.sha256(REQUIREMENTS.read_bytes() + sys.version.encode()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        print(f"peers' virtualenv {VENV.name}: up to date with {REQUIREMENTS.name}", flush=True)
        return python
    # The progress on stderr (bench/run_all.py keeps a section's stdout for docs/BENCHMARKS.md), one line a package.
    print(f"peers' virtualenv {VENV.name}: making it from {REQUIREMENTS.name} (a minute or so)", file=sys.stderr)
    shutil.rmtree(VENV, ignore_errors=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    print("  installing the pinned packages:", file=sys.stderr, flush=True)
    install = subprocess.Popen(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "-r",
            str(REQUIREMENTS),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tail = []
    for line in install.stdout:
        tail = [*tail[-30:], line]
        if line.startswith(("Collecting", "Successfully installed")):
            print("  " + line.rstrip()[:150], file=sys.stderr, flush=True)
    if install.wait() != 0:
        sys.exit("installing the peers failed:\n" + "".join(tail))
    stamp.write_text(digest + "\n")
    print(f"peers' virtualenv {VENV.name}: made from {REQUIREMENTS.name} in {time.monotonic() - t0:.0f} s", flush=True)
    return python


def run_peer(python: Path, args, peer: str, round_: int) -> dict:
    """One batch of `peer` in the peers' virtualenv, on a fresh database created and dropped here."""
    dbname = f"{args.db_prefix}_peers_{peer.replace('-', '_')}_{os.getpid()}_{round_}"
    with psycopg.connect(f"{args.pg_url}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{dbname}"')
        admin.execute(f'CREATE DATABASE "{dbname}"')
    try:
        url = f"{args.pg_url.replace('postgres://', 'postgresql://', 1)}/{dbname}"
        argv = [str(python), str(RUNNER), peer, "--url", url, "--runs", str(args.runs)]
        argv += ["--concurrency", str(args.concurrency)]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200)
        found = [line for line in done.stdout.splitlines() if line.startswith("PEER_JSON ")]
        if done.returncode != 0 or not found:
            sys.exit(f"{peer} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return json.loads(found[-1].removeprefix("PEER_JSON "))
    finally:
        with psycopg.connect(f"{args.pg_url}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peers", default=",".join(PEERS), help=f"some of {', '.join(PEERS)}")
    parser.add_argument("--concurrency", type=int, help="the peers' (default: the console worker's)")
    parser.add_argument("--db-prefix", default="bench", help="the databases' names start with it")
    args = parser.parse_args()
    args.database = "pg15"  # bench_database's choice: the peers run on the machine's PostgreSQL over TCP alone
    peers = [p for p in args.peers.split(",") if p]
    if unknown := set(peers) - set(PEERS):
        sys.exit(f"unknown peers: {', '.join(sorted(unknown))} (known: {', '.join(PEERS)})")
    python = peers_python()
    with bench_database(args, "peers", prefix=args.db_prefix) as (url, version, tmp, env):
        from django.conf import settings

        worker_concurrency = settings.PROCRASTINATE_WORKER_DEFAULTS["concurrency"]
        args.concurrency = args.concurrency or worker_concurrency
        load_before = os.getloadavg()[0]
        names = ["plain", "engine", *peers]
        results: dict[str, list[dict]] = {name: [] for name in names}
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                load = os.getloadavg()[0]
                if name in ("plain", "engine"):
                    result = measure(url, env, tmp, name, 1, args.runs, batch=f"{name}{round_}")
                    result["concurrency"] = worker_concurrency
                else:
                    result = run_peer(python, args, name, round_)
                result["load"] = round(load, 2)
                results[name].append(result)
                print(
                    f"round {round_ + 1} {name:15s}: {result['steps_per_s']:8.1f} steps/s ({result['seconds']} s,"
                    f" load {load:.1f})",
                    flush=True,
                )
        medians = {name: round(statistics.median(r["steps_per_s"] for r in rs), 1) for name, rs in results.items()}
        spreads = {
            name: [min(r["steps_per_s"] for r in rs), max(r["steps_per_s"] for r in rs)] for name, rs in results.items()
        }
        ratios = {peer: round(medians["engine"] / medians[peer], 2) for peer in peers}
        # The engine's ratio to a peer within each round (the same minutes), to show how far one round can stray.
        round_ratios = {
            peer: [
                round(e["steps_per_s"] / p["steps_per_s"], 2)
                for e, p in zip(results["engine"], results[peer], strict=True)
            ]
            for peer in [*peers, "plain"]
        }
        versions = {}
        for peer in peers:
            r = results[peer][0]
            versions[peer] = f"{r['framework']} {r['version']}, " + {
                "dbos": "DBOS.start_workflow",
                "dbos-queue": "a DBOS queue",
                "langgraph": f"PostgresSaver {r.get('checkpoint_postgres')}, durability={r.get('durability')}",
                "langgraph-async": f"PostgresSaver {r.get('checkpoint_postgres')}, durability={r.get('durability')}",
            }.get(peer, "")
        print(
            f"\npeers on pg15 (PostgreSQL {version}), {args.runs} runs x 5 no-op steps per batch, concurrency"
            f" {args.concurrency} (the engine and plain: 1 worker process of concurrency {worker_concurrency}),"
            f" {args.rounds} alternated rounds; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        )
        print(f"{'':16s} {'steps/s':>8s} {'rounds: min-max':>16s} {'engine / it':>12s} {'each round':>18s}  what")
        described = {
            "engine": "the console's engine (bench_noop5), 1 worker",
            "plain": "plain Procrastinate, same 5 writes, same worker",
            **versions,
        }
        for name in names:
            low, high = spreads[name]
            ratio = "" if name == "engine" else f"{medians['engine'] / medians[name]:.2f}"
            each = "" if name == "engine" else ", ".join(f"{x:.2f}" for x in round_ratios[name])
            print(
                f"{name:16s} {medians[name]:8.1f} {f'{low:.0f}-{high:.0f}':>16s} {ratio:>12s} {each:>18s}"
                f"  {described[name]}"
            )
        worst = min(ratios, key=ratios.get) if ratios else None
        if worst:
            print(
                f"goal: the engine >= {GOAL:g}x every peer's steps/s: {'met' if ratios[worst] >= GOAL else 'NOT met'}"
                f" (lowest: {ratios[worst]:.2f} against {worst})"
            )
        print(
            "BENCH_JSON "
            + json.dumps(
                {
                    "bench": "peers",
                    "database": "pg15",
                    "server_version": version,
                    "runs": args.runs,
                    "rounds": args.rounds,
                    "concurrency": args.concurrency,
                    "worker_concurrency": worker_concurrency,
                    "versions": versions,
                    "median_steps_per_s": medians,
                    "spread_steps_per_s": spreads,
                    "engine_vs": ratios,
                    "engine_vs_plain": round(medians["engine"] / medians["plain"], 3),
                    "round_ratios": round_ratios,
                    "goal": GOAL,
                    "results": [{"name": name, **r} for name, rs in results.items() for r in rs],
                }
            )
        )


if __name__ == "__main__":
    main()
