"""What the benchmarks that start their own servers share: a free local port, and `manage.py` run as a process of
its own (its last line of output; the benchmark stops, saying why, when it fails)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def manage(env: dict, *args: str, timeout: float = 300) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        sys.exit(f"manage.py {' '.join(args[:2])} failed:\n{done.stderr[-3000:]}")
    # The last line: `shell` may print a line about its auto-imports first.
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
