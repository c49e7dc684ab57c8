"""The tests' little HTTP servers (a webhook receiver, Slack's API, a payments service) run in a thread each."""

from __future__ import annotations

import threading
from socketserver import BaseServer


def serve_in_thread(server: BaseServer, name: str | None = None) -> threading.Thread:
    """Serve `server` in a daemon thread. It polls for shutdown every 50 ms, not socketserver's default 500 ms,
    which every test's teardown (`server.shutdown()`) waited out: 0.5 s a test, over a minute of the fast suite."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name=name)
    thread.start()
    return thread
