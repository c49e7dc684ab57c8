from __future__ import annotations

from django.core.management import call_command

from core.models import AuditEntry
from jobs.models import DeadLetter
from runs import submission
from runs.models import Run
from tests.conftest import log_in, set_production_password
from tests.engine_helpers import SMALL_REFUND, drive


def test_an_admin_requeues_a_dead_letter_from_django_admin(console_server, page, alice):
    call_command("demo_setup", verbosity=0)
    run = drive(submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {"issue_refund": ["fatal"]}})[0])
    letter = DeadLetter.objects.get(run_id=run.id)
    set_production_password(alice)
    log_in(page, console_server, "alice")

    page.goto(console_server.url + "/admin/jobs/deadletter/?state=open")
    row = page.locator("#result_list tbody tr", has_text="issue_refund")
    assert "Fatal" in row.inner_text() and "open" in row.inner_text()
    row.locator("input[name=_selected_action]").check()
    page.select_option("select[name=action]", "requeue")
    page.click("button[name=index]")

    assert "queued again from their last checkpoint" in page.locator(".messagelist").inner_text()
    run.refresh_from_db()
    letter.refresh_from_db()
    assert run.status == Run.Status.QUEUED and run.cursor == 4
    assert letter.resolution == "requeued" and letter.resolved_by == alice
    assert AuditEntry.objects.get(action="dead_letter.requeue").actor == "alice"

    # The letter's page now says so, and links to the run.
    page.goto(console_server.url + f"/admin/jobs/deadletter/{letter.pk}/change/")
    assert "requeued" in page.locator(".field-state").inner_text()
    page.click(f"a[href='/admin/runs/run/{run.id}/change/']")
    assert "queued" in page.locator("div.form-row.field-status").inner_text().lower()
