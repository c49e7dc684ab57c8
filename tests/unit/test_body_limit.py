"""The body limit is enforced while the body is read (console.body_limit, the ASGI wrapper around Django): a body
over the limit gets 413 before the rest of it is sent, with or without a Content-Length. On the production server:
tests/system/test_body_limit_server.py."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from console.body_limit import BodyLimit

MB = 1024 * 1024


# --- the wrapper, in process --------------------------------------------------------------------------------


class FakeDjango:
    """An ASGI app that reads the whole body as Django's handler does (a disconnect ends it without a response)."""

    def __init__(self):
        self.body = b""
        self.called = False

    async def __call__(self, scope, receive, send):
        self.called = True
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def run_wrapper(path: str, chunks: list[bytes], content_length: int | None = None):
    """Drives BodyLimit(FakeDjango) with a body in `chunks`; returns (status, body, app, chunks received)."""
    app = FakeDjango()
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    scope = {"type": "http", "path": path, "method": "POST", "headers": headers}
    pending = list(chunks)
    taken = 0
    sent: list[dict] = []

    async def receive():
        nonlocal taken
        if not pending:
            return {"type": "http.disconnect"}
        taken += 1
        body = pending.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    async def send(message):
        sent.append(message)

    # In a thread of its own: a browser test's Playwright may already run an event loop in this one.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, BodyLimit(app)(scope, receive, send)).result()
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start, body, app, taken


def test_a_declared_length_over_the_limit_is_413_before_reading_a_byte(settings):
    settings.API_MAX_BODY_BYTES = 1_000

    start, body, app, taken = run_wrapper("/api/runs", [b"x" * 1_001], content_length=1_001)

    assert start["status"] == 413
    assert (b"connection", b"close") in start["headers"]
    assert json.loads(body) == {"error": "too_large", "detail": "The body is larger than 1000 bytes."}
    assert not app.called
    assert taken == 0


def test_a_body_without_a_length_is_cut_off_once_it_passes_the_limit(settings):
    settings.API_MAX_BODY_BYTES = 1_000
    chunks = [b"x" * 400] * 100  # 40 kB, of which the wrapper must take only 3 chunks

    start, body, app, taken = run_wrapper("/api/runs", chunks)

    assert start["status"] == 413
    assert json.loads(body)["error"] == "too_large"
    assert taken == 3
    assert len(app.body) == 800  # Django saw the first two chunks only, then a disconnect


def test_a_body_that_lies_about_its_length_is_cut_off_too(settings):
    settings.API_MAX_BODY_BYTES = 1_000

    start, _, _, taken = run_wrapper("/api/runs", [b"x" * 600] * 10, content_length=10)

    assert start["status"] == 413
    assert taken == 2


def test_a_body_at_the_limit_reaches_the_app_whole(settings):
    settings.API_MAX_BODY_BYTES = 1_000

    start, body, app, _ = run_wrapper("/api/runs", [b"x" * 500, b"y" * 500], content_length=1_000)

    assert start["status"] == 200
    assert body == b"ok"
    assert app.body == b"x" * 500 + b"y" * 500


def test_console_pages_have_the_form_limit(settings):
    settings.API_MAX_BODY_BYTES = 1_000
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 5_000

    assert run_wrapper("/accounts/login/", [b"x" * 2_000], content_length=2_000)[0]["status"] == 200
    start, body, app, _ = run_wrapper("/accounts/login/", [b"x" * 6_000], content_length=6_000)
    assert start["status"] == 413
    assert not app.called
    assert b"larger than 5000 bytes" in body


def test_an_invalid_content_length_is_400(settings):
    start, body, app, _ = run_wrapper("/api/runs", [b"{}"], content_length=-5)

    assert start["status"] == 400
    assert json.loads(body)["error"] == "bad_request"
    assert not app.called
