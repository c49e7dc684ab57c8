"""How long `make run` takes to answer the login page, with the environment already installed.

    .venv/bin/python bench/startup.py [--rounds 3]

Each round starts `make run` on a free port, times it until GET /accounts/login/ answers 200, then stops it
with Ctrl-C (SIGINT to its process group). "cold" uses a new, empty data folder (initdb + all migrations);
"warm" reuses the folder, like a second `make run`. The baseline, measured in the same run, is the embedded
PostgreSQL alone starting and stopping; the ratio says how much the rest (migrate check, collectstatic, demo
seed, uvicorn, worker) adds.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_make_run(pgdata: Path) -> float:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env |= {"EMBEDDED_PGDATA": str(pgdata), "PORT": str(port)}
    started = time.perf_counter()
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "run"],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/accounts/login/", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - started
            except OSError:
                pass
            if proc.poll() is not None:
                sys.exit("make run exited before answering")
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)


def time_postgres_alone(pgdata: Path) -> float:
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from console import embedded_db;"
            "embedded_db.start(Path(sys.argv[1]))",
            str(pgdata),
        ],
        cwd=ROOT,
        check=True,
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cold, warm, baseline = [], [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            pgdata = Path(tmp) / "pgdata"
            cold.append(time_make_run(pgdata))
            time.sleep(1)  # let the previous server's guard finish
            warm.append(time_make_run(pgdata))
            time.sleep(1)
            baseline.append(time_postgres_alone(pgdata))
    for name, values in (
        ("make run, cold", cold),
        ("make run, warm", warm),
        ("baseline: postgres", baseline),
    ):
        print(f"{name:20s} median {statistics.median(values):6.2f} s   all: " + ", ".join(f"{v:.2f}" for v in values))
    print(f"warm / baseline ratio: {statistics.median(warm) / statistics.median(baseline):.1f}x")


if __name__ == "__main__":
    main()
