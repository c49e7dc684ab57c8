"""The production server with several worker processes answers kept-alive requests without the ~40 ms stall
that uvicorn's multi-process mode has by default (no TCP_NODELAY on accepted connections)."""

from __future__ import annotations

import http.client
import os
import statistics
import subprocess
import sys
import time

from django.conf import settings

from tests.conftest import _free_port


def test_kept_alive_requests_do_not_wait_for_delayed_acks():
    port = _free_port()
    env = {**os.environ, "DATABASE_URL": "postgres://postgres@127.0.0.1:1/unused"}  # /healthz needs no database
    server = subprocess.Popen(
        [sys.executable, "-m", "console.webserver", "--port", str(port), "--workers", "2"],
        cwd=settings.BASE_DIR,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        deadline = time.monotonic() + 30
        while True:
            try:
                connection.request("GET", "/healthz")
                connection.getresponse().read()
                break
            except OSError:
                connection.close()
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        timings = []
        for _ in range(30):
            started = time.perf_counter()
            connection.request("GET", "/healthz")
            assert connection.getresponse().read() == b'{"status": "ok"}'
            timings.append(time.perf_counter() - started)
        # The stall is a fixed ~40 ms (Nagle's algorithm against the client's delayed ACK); a healthy answer
        # takes a few ms even on a loaded machine.
        assert statistics.median(timings) < 0.030, f"median {statistics.median(timings) * 1000:.1f} ms"
        connection.close()
    finally:
        server.terminate()
        server.wait(30)
