"""core.outbound_url: a callback is checked when it is asked for and again when it is sent, and the send connects
to the address that second check approved, so a name that resolves elsewhere by then (DNS rebinding) cannot aim
the delivery inward. The resolver is replaced here (a name we control); the connection is a real one."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from core import outbound_url
from tests.serving import serve_in_thread


@pytest.fixture
def receiver():
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            received.append(dict(self.headers))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serve_in_thread(server)
    yield server.server_address[1], received
    server.shutdown()
    server.server_close()


@pytest.fixture
def dns(monkeypatch):
    """What the name `agent.test` resolves to, changed by the test as it goes."""
    answers = {"agent.test": ["93.184.215.14"]}
    real = outbound_url.resolve

    def resolve(host: str, port: int) -> list[str]:
        return list(answers[host]) if host in answers else real(host, port)

    monkeypatch.setattr(outbound_url, "resolve", resolve)
    return answers


def test_a_name_that_resolves_inward_at_send_time_is_refused_then(dns, receiver, settings):
    settings.CALLBACK_ALLOWED_HOSTS = []
    port, received = receiver
    url = f"http://agent.test:{port}/hook"
    checked = outbound_url.check(url)  # at creation: a public address
    assert checked.addresses == ("93.184.215.14",)
    dns["agent.test"] = ["127.0.0.1"]  # the name's owner points it inward before the decision is sent
    with pytest.raises(outbound_url.Refused, match="loopback"):
        outbound_url.post(url, b"{}", {}, timeout=5)
    assert received == []


def test_one_inward_address_among_public_ones_refuses_the_name(dns, settings):
    settings.CALLBACK_ALLOWED_HOSTS = []
    dns["agent.test"] = ["93.184.215.14", "169.254.169.254"]
    with pytest.raises(outbound_url.Refused, match="link-local"):
        outbound_url.check("https://agent.test/hook")


def test_the_send_connects_to_the_checked_address_under_the_urls_host(dns, receiver, settings):
    settings.CALLBACK_ALLOWED_HOSTS = ["agent.test"]
    port, received = receiver
    dns["agent.test"] = ["127.0.0.1"]
    assert outbound_url.post(f"http://agent.test:{port}/hook?x=1", b"{}", {"X-Test": "1"}, timeout=5) == 204
    (headers,) = received
    assert headers["Host"] == f"agent.test:{port}" and headers["X-Test"] == "1"


def test_a_failed_delivery_says_why(dns, settings):
    settings.CALLBACK_ALLOWED_HOSTS = ["agent.test"]
    dns["agent.test"] = ["127.0.0.1"]
    with pytest.raises(OSError):
        outbound_url.post("http://agent.test:9/hook", b"{}", {}, timeout=2)  # the discard port: nobody listens
