"""In Chromium: ops engages and releases a channel's kill switch on /channels/, and must give a reason."""

from __future__ import annotations

from django.core.management import call_command
from guardian.shortcuts import assign_perm
from playwright.sync_api import expect

from core.models import AuditEntry, Channel
from tests.conftest import log_in, set_production_password


def test_ops_engages_and_releases_a_switch_with_a_reason(console_server, page, carol):
    call_command("demo_setup", verbosity=0)
    for channel in Channel.objects.all():
        assign_perm("core.operate_channel", carol, channel)
    set_production_password(carol)
    log_in(page, console_server, "carol")

    page.click("nav >> text=Channels")
    page.wait_for_url(console_server.url + "/channels/")
    row = page.locator("#channel-email")
    summary = page.locator("#switch-summary")
    reason = row.locator("input[name=reason]")
    expect(row).to_have_attribute("data-state", "released")
    expect(summary).to_contain_text("0 of 3 channel switches engaged")

    # No reason: the browser does not even send it.
    row.locator("button", has_text="Engage").click()
    assert reason.evaluate("input => input.validity.valueMissing")
    # Blanks get past the browser; the server refuses them and says why, in the row.
    reason.fill("   ")
    row.locator("button", has_text="Engage").click()
    expect(row.locator(".error")).to_contain_text("Give a reason")
    expect(row).to_have_attribute("data-state", "released")
    assert not Channel.objects.get(name="email").kill_switch_engaged
    assert not AuditEntry.objects.filter(action__startswith="kill_switch.").exists()

    row.locator("input[name=reason]").fill("the refund email template is broken")
    row.locator("button", has_text="Engage").click()
    expect(row).to_have_attribute("data-state", "engaged")
    expect(row.locator(".reason")).to_have_text("the refund email template is broken")
    expect(row.locator(".by")).to_have_text("carol")
    expect(row.locator(".error")).to_have_count(0)
    expect(summary).to_contain_text("1 of 3 channel switches engaged")  # refreshed by the htmx event
    email = Channel.objects.get(name="email")
    assert email.kill_switch_engaged and email.kill_switch_by == carol
    assert page.url == console_server.url + "/channels/"  # one click, no page load

    row.locator("input[name=reason]").fill("template fixed")
    row.locator("button", has_text="Release").click()
    expect(row).to_have_attribute("data-state", "released")
    expect(row.locator(".reason")).to_have_text("template fixed")
    expect(summary).to_contain_text("0 of 3 channel switches engaged")
    assert not Channel.objects.get(name="email").kill_switch_engaged
    assert list(
        AuditEntry.objects.filter(action__startswith="kill_switch.").order_by("id").values_list("action", "actor")
    ) == [("kill_switch.engage", "carol"), ("kill_switch.release", "carol")]


def test_ops_without_the_permission_see_the_page_read_only(console_server, page, carol):
    call_command("demo_setup", verbosity=0)
    set_production_password(carol)
    log_in(page, console_server, "carol")
    page.goto(console_server.url + "/channels/")
    expect(page.locator("#channel-email .read-only")).to_be_visible()
    expect(page.locator("#channel-email form")).to_have_count(0)
    expect(page.locator("#switch-global form")).to_have_count(1)  # carol is ops: the global switch is hers
