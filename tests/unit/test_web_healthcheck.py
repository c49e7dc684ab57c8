"""`python -m console.healthcheck`: 0 when the web server's /healthz answers 200, 1 with why otherwise."""

from __future__ import annotations

import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.serving import serve_in_thread

ROOT = Path(__file__).resolve().parents[2]


def _server(status: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(status if self.path == "/healthz" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serve_in_thread(server, name=f"healthz-{status}")
    return server


def _check(port: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "console.healthcheck", "--port", str(port), "--timeout", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(("status", "code", "said"), [(200, 0, "ok"), (400, 1, "HTTP 400"), (503, 1, "HTTP 503")])
def test_it_passes_only_on_200(status, code, said):
    server = _server(status)
    try:
        done = _check(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == code
    assert said in done.stdout + done.stderr


def test_no_server_is_a_failure_that_says_so():
    server = _server(200)
    port = server.server_port
    server.shutdown()
    server.server_close()
    done = _check(port)
    assert done.returncode == 1
    assert "no answer" in done.stderr
