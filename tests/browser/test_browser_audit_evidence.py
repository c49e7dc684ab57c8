"""The audit page's "Export evidence" button, in a browser against the production server (uvicorn, ASGI): the
download is the bundle, it verifies offline, and the export is audited."""

from __future__ import annotations

import zipfile

import pytest
from django.db import transaction
from django.utils import timezone

from core.models import AuditEntry
from tests.conftest import log_in, set_production_password
from tests.integration.core.test_audit_evidence_export import _intact, verify

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_an_admin_downloads_the_evidence_of_a_period(console_server, page, alice, bob, tmp_path):
    set_production_password(alice)
    with transaction.atomic():
        AuditEntry.record("approval.approve", actor=bob, channel="payments", data={"comment": "refund looks right"})
        AuditEntry.record("approval.reject", actor=bob, channel="payments", data={"comment": "wrong customer"})
    today = str(timezone.localdate())

    log_in(page, console_server, "alice")
    page.goto(console_server.url + "/audit/")
    page.fill("#evidence-from", today)
    page.fill("#evidence-to", today)
    with page.expect_download() as download:
        page.click("text=Export evidence (zip)")
    assert download.value.suggested_filename == f"audit-export-{today}-to-{today}.zip"
    archive = tmp_path / download.value.suggested_filename
    download.value.save_as(archive)
    with zipfile.ZipFile(archive) as opened:
        opened.extractall(tmp_path)
    _intact(verify(tmp_path / f"audit-export-{today}-to-{today}"))
    export = AuditEntry.objects.get(action="audit.export")
    assert (export.actor, export.data["from"], export.data["to"], export.data["via"]) == (
        "alice",
        today,
        today,
        "console",
    )
    assert page.url == console_server.url + "/audit/"  # a download: the page stays
