from __future__ import annotations

import httpx
import pytest
from fake_console import FakeConsole

from hitl_client import Client

BASE_URL = "http://console.test"


@pytest.fixture
def console() -> FakeConsole:
    return FakeConsole()


@pytest.fixture
def client(console: FakeConsole):
    # No backoff, and a Retry-After counts for nothing: the tests' retries happen at once.
    transport = httpx.MockTransport(console.handler)
    with Client(BASE_URL, "tok-alice", transport=transport, backoff=0, max_backoff=0) as client:
        yield client
