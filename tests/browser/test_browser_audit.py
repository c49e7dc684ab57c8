from __future__ import annotations

from django.db import transaction

from core.models import AuditEntry
from tests.conftest import log_in, set_production_password


def _shown(page) -> list[str]:
    return page.locator("#audit-results tbody tr[data-entry] td.data .comment").all_inner_texts()


def test_an_admin_filters_the_audit_log(console_server, page, alice, bob, carol):
    set_production_password(alice)
    with transaction.atomic():
        AuditEntry.record("approval.approve", actor=bob, channel="payments", data={"comment": "refund looks right"})
        AuditEntry.record("approval.reject", actor=bob, channel="payments", data={"comment": "wrong customer"})
        AuditEntry.record("run.cancel", actor=carol, data={"comment": "customer asked to stop"})
        AuditEntry.record("approval.reject", actor=bob, channel="email", data={"comment": "<script>boom()</script>"})

    log_in(page, console_server, "alice")
    page.click("nav >> text=Audit log")
    page.wait_for_url("**/audit/")
    assert len(_shown(page)) == 4
    assert "<script>boom()</script>" in _shown(page)  # shown as text, not run

    # Choosing an action swaps the results in place (htmx) and puts the filter in the address bar.
    page.select_option("#id_action", "approval.reject")
    page.wait_for_url("**/audit/?action=approval.reject")
    assert sorted(_shown(page)) == ["<script>boom()</script>", "wrong customer"]
    assert page.evaluate("document.querySelectorAll('form.audit-filters').length") == 1  # not reloaded twice

    # Full-text on comments, combined with the action: stemmed, so "customers" finds "customer".
    page.fill("#id_q", "customers")
    page.press("#id_q", "Enter")
    page.wait_for_url("**/audit/?action=approval.reject&q=customers")
    assert _shown(page) == ["wrong customer"]

    # Clearing the action keeps the search.
    page.select_option("#id_action", "")
    page.wait_for_url("**/audit/?q=customers")
    assert sorted(_shown(page)) == ["customer asked to stop", "wrong customer"]

    # The export link follows the filters.
    assert page.get_attribute("a.export", "href") == "/audit/export.csv?q=customers"
