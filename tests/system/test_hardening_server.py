"""Production hardening on the production server: HTTPS (redirect, HSTS, behind a TLS proxy), the policy on
/api/docs, and its assets served by the console itself (tests/integration/console/test_hardening.py in process)."""

from __future__ import annotations

import http.client
import urllib.request

import pytest

from tests.conftest import ConsoleServer
from tests.integration.console.test_hardening import _ASSET


def test_the_docs_page_and_its_assets_are_served_by_the_console(console_server):
    with urllib.request.urlopen(console_server.url + "/api/docs", timeout=10) as response:
        html = response.read().decode()
    assets = _ASSET.findall(html)
    assert len(assets) >= 4  # stylesheet, favicons, Swagger UI bundle, its start-up script

    for asset in assets:
        assert asset.startswith("/static/"), asset
        with urllib.request.urlopen(console_server.url + asset, timeout=10) as response:
            assert response.status == 200, asset
            assert len(response.read()) > 100, asset
    with urllib.request.urlopen(console_server.url + "/api/openapi.json", timeout=10) as response:
        assert response.status == 200


@pytest.fixture
def production_server(_console_env, transactional_db):
    env = {
        **_console_env,
        "CONSOLE_ENV": "production",
        "SECRET_KEY": "test-only-" + "k" * 50,
        "SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto=https",
    }
    server = ConsoleServer(env)  # it waits for /healthz over plain HTTP: probes are exempt from the redirect
    yield server
    server.stop()


def fetch(server, path: str, headers: dict | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", path, headers=headers or {})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def test_production_redirects_plain_http_to_https_except_probes(production_server):
    response = fetch(production_server, "/accounts/login/")

    assert response.status == 301
    assert response.getheader("Location") == f"https://127.0.0.1:{production_server.port}/accounts/login/"
    assert fetch(production_server, "/healthz").status == 200
    assert fetch(production_server, "/readyz").status in (200, 503)  # not a redirect


def test_production_behind_a_tls_proxy_sends_hsts_and_the_enforced_policy(production_server):
    response = fetch(production_server, "/accounts/login/", {"X-Forwarded-Proto": "https"})

    assert response.status == 200
    assert response.getheader("Strict-Transport-Security") == "max-age=31536000"
    policy = response.getheader("Content-Security-Policy")
    assert "default-src 'self'" in policy and "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "unsafe" not in policy
    assert response.getheader("Content-Security-Policy-Report-Only") is None
    assert response.getheader("X-Content-Type-Options") == "nosniff"
    assert response.getheader("X-Frame-Options") == "DENY"
    assert response.getheader("Server") is None
    cookies = response.headers.get_all("Set-Cookie") or []
    assert cookies and all("Secure" in cookie for cookie in cookies)


def test_production_api_docs_have_the_policy_too(production_server):
    response = fetch(production_server, "/api/docs", {"X-Forwarded-Proto": "https"})

    assert response.status == 200
    assert "script-src 'self'" in response.getheader("Content-Security-Policy")
