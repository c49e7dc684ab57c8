"""The body limit is enforced while the body is read (console.body_limit, the ASGI wrapper around Django): a body
over the limit gets 413 before the rest of it is sent, with or without a Content-Length."""

from __future__ import annotations

import asyncio
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command

from console.body_limit import BodyLimit
from core.models import ApiToken
from runs.models import Run
from tests.engine_helpers import REFUND

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


# --- the production server ----------------------------------------------------------------------------------


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """Reads one HTTP response (until the server closes the connection, as it must after a 413)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            headers = dict(line.decode().lower().split(": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
            if len(body) >= int(headers.get("content-length", 10**9)):
                break
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


@pytest.fixture
def token(console_server):
    call_command("demo_setup", verbosity=0)
    _, raw = ApiToken.issue(User.objects.get(username="agent"))
    return raw


def request_head(port: int, token: str, extra: str) -> bytes:
    return (
        f"POST /api/runs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def first_chunk_of_a_big_run() -> bytes:
    return json.dumps({"workflow": "refund", "input": {**REFUND, "reason": "x" * (2 * MB)}}).encode()[: 16 * 1024]


@pytest.mark.slow
def test_a_2mb_body_gets_413_after_its_first_chunk(console_server, token):
    with socket.create_connection(("127.0.0.1", console_server.port), timeout=10) as sock:
        sock.sendall(request_head(console_server.port, token, f"Content-Length: {2 * MB}\r\n"))
        sock.sendall(first_chunk_of_a_big_run())  # and nothing more: the answer must not wait for the rest

        status, headers, body = read_response(sock)

    assert status == 413
    assert headers["connection"] == "close"
    assert json.loads(body) == {"error": "too_large", "detail": "The body is larger than 65536 bytes."}
    assert not Run.objects.exists()


@pytest.mark.slow
def test_a_2mb_body_waiting_for_100_continue_gets_413_instead(console_server, token):
    with socket.create_connection(("127.0.0.1", console_server.port), timeout=10) as sock:
        sock.sendall(request_head(console_server.port, token, f"Content-Length: {2 * MB}\r\nExpect: 100-continue\r\n"))

        status, _, body = read_response(sock)

    assert status == 413  # not "100 Continue": the client never sends the body
    assert json.loads(body)["error"] == "too_large"


@pytest.mark.slow
def test_a_chunked_body_gets_413_once_past_the_limit_without_sending_the_rest(console_server, token):
    chunk = b"x" * 16 * 1024
    with socket.create_connection(("127.0.0.1", console_server.port), timeout=10) as sock:
        sock.sendall(request_head(console_server.port, token, "Transfer-Encoding: chunked\r\n"))
        prefix = b'{"workflow": "refund", "input": {"reason": "'
        sock.sendall(b"%x\r\n%s\r\n" % (len(prefix), prefix))
        # 80 kB of a 2 MB body, in chunks, without the terminating chunk: the server must answer now.
        for _ in range(5):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))

        status, headers, body = read_response(sock)

    assert status == 413
    assert headers["connection"] == "close"
    assert json.loads(body)["error"] == "too_large"
    assert not Run.objects.exists()


@pytest.mark.slow
def test_a_small_body_is_still_served_on_the_same_server(console_server, token):
    body = json.dumps({"workflow": "refund", "input": REFUND}).encode()
    with socket.create_connection(("127.0.0.1", console_server.port), timeout=10) as sock:
        sock.sendall(request_head(console_server.port, token, f"Content-Length: {len(body)}\r\n") + body)

        status, _, answer = read_response(sock)

    assert status == 202, answer
    assert Run.objects.get().id.hex == json.loads(answer)["id"].replace("-", "")


@pytest.mark.slow
def test_a_console_form_over_the_form_limit_gets_413(console_server):
    with socket.create_connection(("127.0.0.1", console_server.port), timeout=10) as sock:
        sock.sendall(
            f"POST /accounts/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {20 * 1024 * MB}\r\n"
            "Content-Type: application/x-www-form-urlencoded\r\n\r\nusername=a&password=".encode()
        )

        status, _, _ = read_response(sock)

    assert status == 413
