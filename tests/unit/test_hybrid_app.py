"""The production server's application (console.asgi): sync views go to Django's WSGI handler in a pool of threads,
with their body read whole first; async views to Django's ASGI handler; the body limit outside
both and, for a chunked body, inside the WSGI side too (console.body_limit.WsgiBodyLimit). On the production
server: tests/system/test_body_limit_server.py, tests/system/test_external_agents.py."""

from __future__ import annotations

import asyncio
import io
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from a2wsgi import WSGIMiddleware

from console.asgi import Hybrid, is_async_view
from console.body_limit import BodyLimit, WsgiBodyLimit

MB = 1024 * 1024
API_LIMIT = 64 * 1024


class WsgiApp:
    """A WSGI app that reads its body as Django's handler does: CONTENT_LENGTH bytes, nothing without it."""

    def __init__(self):
        self.calls: list[bytes] = []

    def __call__(self, environ, start_response):
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        self.calls.append(body)
        start_response("202 Accepted", [("Content-Type", "text/plain")])
        return [b"read %d" % len(body)]


class AsgiApp:
    def __init__(self):
        self.called = False

    async def __call__(self, scope, receive, send):
        self.called = True
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"async"})


def drive(app, path: str, chunks: list[bytes], headers=(), method="POST", disconnect_after=None):
    """Runs `app` on one request whose body comes in `chunks` (then the client goes away, or after
    `disconnect_after` chunks); returns (status, body, chunks the client sent)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers],
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5000),
    }
    pending = list(chunks)
    given = 0
    sent: list[dict] = []

    async def receive():
        nonlocal given
        if not pending or (disconnect_after is not None and given >= disconnect_after):
            await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}
        given += 1
        return {"type": "http.request", "body": pending.pop(0), "more_body": bool(pending)}

    async def send(message):
        sent.append(message)

    # In a thread of its own: a browser test's Playwright may already run an event loop in this one.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, app(scope, receive, send)).result(10)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return (starts[0]["status"] if starts else None), body, given


@pytest.fixture
def apps():
    wsgi_app, asgi_app = WsgiApp(), AsgiApp()
    wsgi = WSGIMiddleware(WsgiBodyLimit(wsgi_app), workers=2)
    return wsgi_app, asgi_app, BodyLimit(Hybrid(wsgi, asgi_app))


def test_a_sync_view_runs_on_the_wsgi_side_with_its_whole_body(apps):
    wsgi_app, asgi_app, app = apps
    status, body, _ = drive(app, "/api/runs", [b'{"a": ', b"1}"], headers=[("content-length", "8")])
    assert (status, body) == (202, b"read 8")
    assert wsgi_app.calls == [b'{"a": 1}'] and not asgi_app.called


def test_a_chunked_body_reaches_a_wsgi_view_with_its_length(apps):
    # Django's WSGI handler reads only a declared Content-Length: without WsgiBodyLimit it would read nothing.
    wsgi_app, _, app = apps
    status, body, _ = drive(app, "/api/runs", [b"abc", b"def"], headers=[("transfer-encoding", "chunked")])
    assert (status, body) == (202, b"read 6")
    assert wsgi_app.calls == [b"abcdef"]


def test_a_client_gone_before_its_body_came_whole_runs_no_view(apps):
    wsgi_app, asgi_app, app = apps
    status, _, _ = drive(app, "/api/runs", [b'{"a"', b": 1}"], headers=[("content-length", "8")], disconnect_after=1)
    assert status is None  # nobody to answer
    assert wsgi_app.calls == [] and not asgi_app.called


def test_a_chunked_body_over_the_limit_is_refused_413_before_it_is_read_whole(apps):
    wsgi_app, _, app = apps
    chunks = [b"x" * (16 * 1024)] * 64  # 1 MiB, chunked, the API's limit is 64 KiB
    status, body, given = drive(app, "/api/runs", chunks, headers=[("transfer-encoding", "chunked")])
    assert status == 413 and json.loads(body)["error"] == "too_large"
    assert wsgi_app.calls == []
    assert given <= API_LIMIT // (16 * 1024) + 1  # it stopped reading just past the limit


def test_a_declared_length_over_the_limit_is_refused_before_a_byte_is_read(apps):
    wsgi_app, _, app = apps
    status, body, given = drive(app, "/api/runs", [b"x" * 1024], headers=[("content-length", str(MB))])
    assert status == 413 and given == 0 and wsgi_app.calls == []


def test_an_async_view_goes_to_the_asgi_side(apps, monkeypatch):
    # No view is async today (the approval-request long-poll waits at the edge instead: console/long_poll.py,
    # tests/system/test_long_poll_waiters.py), so one is made up here.
    assert not is_async_view("/api/approval-requests/4b0c3c1e-7f5e-4d55-9a59-1f1f1f1f1f1f")
    assert not is_async_view("/api/runs") and not is_async_view("/no/such/page")
    monkeypatch.setattr("console.asgi.is_async_view", lambda path: path == "/an/async/view")
    wsgi_app, asgi_app, app = apps
    status, body, _ = drive(app, "/an/async/view", [b""], method="GET")
    assert (status, body) == (200, b"async")
    assert asgi_app.called and wsgi_app.calls == []


# --- WsgiBodyLimit alone (any WSGI server: console/wsgi.py) --------------------------------------------------------


class CountingInput(io.BytesIO):
    def __init__(self, data: bytes):
        super().__init__(data)
        self.taken = 0

    def read(self, size=-1):
        data = super().read(size)
        self.taken += len(data)
        return data


def call_wsgi(path: str, body: bytes, **environ):
    app = WsgiApp()
    stream = CountingInput(body)
    statuses = []
    result = WsgiBodyLimit(app)(
        {"PATH_INFO": path, "REQUEST_METHOD": "POST", "wsgi.input": stream, **environ},
        lambda status, headers, exc_info=None: statuses.append(status),
    )
    return statuses[0], b"".join(result), stream.taken, app


def test_wsgi_a_declared_length_over_the_limit_is_refused_unread():
    status, body, taken, app = call_wsgi("/api/runs", b"x" * 100, CONTENT_LENGTH=str(MB))
    assert status.startswith("413") and json.loads(body)["error"] == "too_large"
    assert taken == 0 and app.calls == []


def test_wsgi_a_chunked_body_over_the_limit_is_read_only_to_the_limit():
    status, body, taken, app = call_wsgi("/api/runs", b"x" * MB, HTTP_TRANSFER_ENCODING="chunked")
    assert status.startswith("413") and taken == API_LIMIT + 1 and app.calls == []


def test_wsgi_a_chunked_body_within_the_limit_gets_its_length():
    status, body, _, app = call_wsgi("/api/runs", b'{"a": 1}', HTTP_TRANSFER_ENCODING="chunked")
    assert status.startswith("202") and app.calls == [b'{"a": 1}']


def test_wsgi_a_length_that_is_not_a_number_is_a_400():
    status, body, _, app = call_wsgi("/api/runs", b"", CONTENT_LENGTH="ten")
    assert status.startswith("400") and json.loads(body)["error"] == "bad_request" and app.calls == []


def test_wsgi_pages_have_the_form_limit_and_a_plain_text_answer(settings):
    status, body, _, _ = call_wsgi(
        "/approvals/1/decide", b"", CONTENT_LENGTH=str(settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1)
    )
    assert status.startswith("413") and body.startswith(b"The body is larger than")
    status, _, _, _ = call_wsgi("/approvals/1/decide", b"", CONTENT_LENGTH=str(API_LIMIT + 1))
    assert status.startswith("202")  # over the API's limit, within the form limit
