from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


def run_coroutine(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run in a thread of its own: in the console's suite, Playwright's sync API (the browser tests'
    session fixture) keeps an event loop running in the main thread, where asyncio.run refuses to start."""
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(asyncio.run, coroutine).result()
