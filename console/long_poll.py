"""The long-poll of the approval-request API (`GET /api/approval-requests/{id}?wait=N`) at the web server's edge
(console/asgi.py): while the request is pending, the agent waits here, in the event loop, holding neither a thread
nor a database connection, and each look at the request is an ordinary request through Django.

Why here and not in an async view: under Django's ASGI handler a request whose middlewares are sync (ours are)
runs them in a thread of its own, and that thread stays blocked under the view for as long as the view waits.
Before issue 24 every waiting agent held one, and looked at its request five times a second.

How: one pass through Django (a WSGI thread: middlewares, the token, the request's state; external.api's
`get_request` answers at once), its response kept, not sent. If it is a 200 whose request is still pending and the
wait lasts, the agent waits for a wake-up from the process's listener (external.waiters: a change of the request's
card status, the listener's reconnection, or its fallback timer), then passes through Django once more; the last
response is what the agent gets, as it would have got it from the view itself. Every pass is a full request (its
token checked again, its own line in the request log, external.waiters.EDGE_HEADER added so that the view does
not wait itself); anything but a pending 200 (401, 404, 422 for a bad
`wait`, 503 while the database is away) is answered at once. A client that goes away ends its wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
import uuid
from datetime import datetime
from urllib.parse import parse_qs

from external import waiters

PATH = re.compile(r"^/api/approval-requests/([0-9A-Fa-f-]{32,36})$")
EXPIRY_SLACK_SECONDS = 0.05  # a look just after the request's deadline sees it passed


def long_poll(scope) -> tuple[str, int] | None:
    """(request id, seconds) of a long-poll (`wait` of 1 or more), else None: Django alone answers it."""
    if scope["type"] != "http" or scope["method"] != "GET" or not (match := PATH.match(scope["path"])):
        return None
    try:
        request_id = str(uuid.UUID(match.group(1)))
        wait = int(parse_qs(scope.get("query_string", b"").decode("latin-1")).get("wait", ["0"])[-1])
    except ValueError:
        return None
    # More than the API allows is Django's to refuse (422) on the first pass, which ends the long-poll.
    return (request_id, wait) if wait >= 1 else None


async def serve(app, scope, body: dict, receive, send, request_id: str, wait: int) -> None:
    """Answer the long-poll `scope` through `app` (the WSGI side), whose request `body` was read already."""
    deadline = time.monotonic() + wait
    listener = waiters.listener()
    gone = asyncio.Event()
    watcher = asyncio.create_task(_watch_disconnect(receive, gone))
    try:
        # The waiter is registered before the first look: no change of the request can fall between the two.
        with listener.waiter(request_id) as waiter:
            while True:
                listener.mark(waiter)
                response = await _pass(app, scope, body, gone)
                answer = _pending(response)
                if answer is None or gone.is_set() or (left := deadline - time.monotonic()) <= 0:
                    break
                woken = await _wait(listener, waiter, min(left, _until_expiry(answer)), gone)
                if gone.is_set():
                    return
                if not woken and time.monotonic() >= deadline and listener.heard_everything_since(waiter):
                    break  # the listener heard every change since the last look, and none was this request's
        if not gone.is_set():
            for message in response:
                await send(message)
    finally:
        watcher.cancel()


async def _pass(app, scope, body: dict, gone: asyncio.Event) -> list[dict]:
    """One request through `app`; its response messages, kept."""
    messages: list[dict] = []
    given = False

    async def replay():
        nonlocal given
        if not given:
            given = True
            return body
        await gone.wait()
        return {"type": "http.disconnect"}

    async def keep(message):
        messages.append(message)

    header = (waiters.EDGE_HEADER.lower().encode(), b"1")
    await app({**scope, "headers": [*scope.get("headers", []), header]}, replay, keep)
    return messages


def _pending(response: list[dict]) -> dict | None:
    """The answer of a 200 whose request is still pending, else None (the response is the agent's answer)."""
    if not response or response[0].get("status") != 200:
        return None
    try:
        answer = json.loads(b"".join(m.get("body", b"") for m in response[1:]))
    except ValueError:
        return None
    return answer if isinstance(answer, dict) and answer.get("status") == "pending" else None


def _until_expiry(answer: dict) -> float:
    """Seconds until the request's deadline (a look then sees it passed), or no bound once it has passed."""
    try:
        expires_at = datetime.fromisoformat(answer["expires_at"])
    except (KeyError, TypeError, ValueError):
        return math.inf
    left = expires_at.timestamp() - time.time()
    return left + EXPIRY_SLACK_SECONDS if left > 0 else math.inf


async def _wait(listener, waiter, timeout: float, gone: asyncio.Event) -> bool:
    """Until the waiter is woken (True), `timeout` passes or the client goes (False)."""
    woken = asyncio.create_task(listener.wait(waiter, timeout))
    left = asyncio.create_task(gone.wait())
    try:
        await asyncio.wait({woken, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not woken.done():
            woken.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await woken
    return woken.done() and not woken.cancelled() and woken.result()


async def _watch_disconnect(receive, gone: asyncio.Event) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return
