"""The body limit on the production server (uvicorn, and console.body_limit around Django): a body over the limit
gets 413 before the rest of it is sent, with or without a Content-Length. The wrapper in process:
tests/unit/test_body_limit.py."""

from __future__ import annotations

import json
import socket

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command

from core.models import ApiToken
from runs.models import Run
from tests.engine_helpers import REFUND

MB = 1024 * 1024


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


def test_a_2mb_body_gets_413_after_its_first_chunk(console_server, token):
    with socket.create_connection(("127.0.0.1", console_server.port), timeout=10) as sock:
        sock.sendall(request_head(console_server.port, token, f"Content-Length: {2 * MB}\r\n"))
        sock.sendall(first_chunk_of_a_big_run())  # and nothing more: the answer must not wait for the rest

        status, headers, body = read_response(sock)

    assert status == 413
    assert headers["connection"] == "close"
    assert json.loads(body) == {"error": "too_large", "detail": "The body is larger than 65536 bytes."}
    assert not Run.objects.exists()


def test_a_2mb_body_waiting_for_100_continue_gets_413_instead(console_server, token):
    with socket.create_connection(("127.0.0.1", console_server.port), timeout=10) as sock:
        sock.sendall(request_head(console_server.port, token, f"Content-Length: {2 * MB}\r\nExpect: 100-continue\r\n"))

        status, _, body = read_response(sock)

    assert status == 413  # not "100 Continue": the client never sends the body
    assert json.loads(body)["error"] == "too_large"


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


def test_a_small_body_is_still_served_on_the_same_server(console_server, token):
    body = json.dumps({"workflow": "refund", "input": REFUND}).encode()
    with socket.create_connection(("127.0.0.1", console_server.port), timeout=10) as sock:
        sock.sendall(request_head(console_server.port, token, f"Content-Length: {len(body)}\r\n") + body)

        status, _, answer = read_response(sock)

    assert status == 202, answer
    assert Run.objects.get().id.hex == json.loads(answer)["id"].replace("-", "")


def test_a_console_form_over_the_form_limit_gets_413(console_server):
    with socket.create_connection(("127.0.0.1", console_server.port), timeout=10) as sock:
        sock.sendall(
            f"POST /accounts/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {20 * 1024 * MB}\r\n"
            "Content-Type: application/x-www-form-urlencoded\r\n\r\nusername=a&password=".encode()
        )

        status, _, _ = read_response(sock)

    assert status == 413
