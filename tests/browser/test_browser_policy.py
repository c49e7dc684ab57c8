"""The Content-Security-Policy in Chromium: /api/docs renders offline, and the console's pages run, without a
policy violation (no inline script or handler, no eval)."""

from __future__ import annotations

from tests.conftest import set_production_password


def csp_messages(page) -> list[str]:
    messages: list[str] = []
    page.on("console", lambda m: messages.append(m.text) if "Content Security Policy" in m.text else None)
    return messages


def offline(page, server) -> list[str]:
    """Refuses every request to another origin (as with no network), and returns the list of those refused."""
    refused: list[str] = []

    def route(route):
        if route.request.url.startswith(server.url):
            route.continue_()
        else:
            refused.append(route.request.url)
            route.abort()

    page.route("**/*", route)
    return refused


def test_api_docs_render_offline_without_policy_violations(console_server, page):
    refused = offline(page, console_server)
    violations = csp_messages(page)

    page.goto(console_server.url + "/api/docs")

    page.wait_for_selector(".swagger-ui .info .title")
    assert "HITL approval console" in page.locator(".swagger-ui .info .title").inner_text()
    page.wait_for_selector(".opblock-summary-path")  # the operations, from /api/openapi.json
    assert refused == []
    assert violations == []


def test_console_pages_run_without_policy_violations(console_server, page, alice):
    set_production_password(alice)
    refused = offline(page, console_server)
    violations = csp_messages(page)
    page.goto(console_server.url + "/accounts/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "password")
    page.click("button[type=submit]")
    page.wait_for_url(console_server.url + "/")

    for path in ["/", "/runs/", "/channels/", "/dashboard/", "/audit/", "/admin/"]:
        page.goto(console_server.url + path)
        page.wait_for_load_state("networkidle")
        if not path.startswith("/admin/"):
            assert page.evaluate("typeof htmx") == "object", path

    assert refused == []
    assert violations == []
    # The check can fail: an inline handler on the page is reported.
    page.evaluate("""document.body.insertAdjacentHTML("beforeend", '<img src="/nothing" onerror="void 0">')""")
    page.wait_for_timeout(500)
    assert violations
