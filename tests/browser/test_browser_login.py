from __future__ import annotations

from tests.conftest import set_production_password


def test_a_reviewer_logs_in_and_sees_the_empty_inbox(console_server, page, bob):
    set_production_password(bob)
    page.goto(console_server.url + "/")
    assert page.url.endswith("/accounts/login/?next=/")
    page.fill("#id_username", "bob")
    page.fill("#id_password", "password")
    page.click("button[type=submit]")
    page.wait_for_url(console_server.url + "/")
    assert page.locator("[data-role=reviewer] h2").inner_text() == "Your inbox is empty"
    assert page.evaluate("typeof htmx") == "object"  # htmx is served from static/, not a CDN

    page.click("text=Log out")
    page.wait_for_url("**/accounts/login/")


def test_a_wrong_password_keeps_you_out(console_server, page, bob):
    set_production_password(bob)
    page.goto(console_server.url + "/accounts/login/")
    page.fill("#id_username", "bob")
    page.fill("#id_password", "wrong")
    page.click("button[type=submit]")
    assert "didn't match" in page.locator(".error").inner_text()
    page.goto(console_server.url + "/")
    assert "/accounts/login/" in page.url
