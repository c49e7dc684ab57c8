from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command, execute_from_command_line
from django.db import DatabaseError, connection, transaction

from approvals.models import Approval
from core.models import AuditEntry
from runs import submission
from tests.conftest import approves_every_channel
from tests.engine_helpers import REFUND, SMALL_REFUND, drive


def _record(n: int, **extra) -> list[AuditEntry]:
    with transaction.atomic():
        return [
            AuditEntry.record("test.action", target=f"thing:{i}", data={"i": i, "comment": "ok"}, **extra)
            for i in range(n)
        ]


def test_entries_form_a_hash_chain(db, bob):
    first, second = _record(1, actor=bob)[0], _record(1)[0]
    assert first.prev_hash == AuditEntry.GENESIS
    assert second.prev_hash == first.hash
    assert first.at <= second.at  # the database's clock, read under the chain's lock
    assert (first.actor, first.actor_type, second.actor, second.actor_type) == ("bob", "human", "system", "system")
    stored = AuditEntry.objects.get(pk=first.pk)
    assert stored.compute_hash() == stored.hash  # what was hashed is what was stored


def test_it_must_be_written_inside_the_recorded_transaction(transactional_db):
    with pytest.raises(AssertionError):
        AuditEntry.record("test.action")


@pytest.mark.parametrize(
    "statement", ["UPDATE console_auditentry SET actor = 'mallory'", "DELETE FROM console_auditentry"]
)
def test_the_database_refuses_update_and_delete(db, statement):
    _record(2)
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(statement)
    assert set(AuditEntry.objects.values_list("actor", flat=True)) == {"system"}
    assert AuditEntry.objects.count() == 2


def test_the_orm_cannot_change_an_entry_either(db):
    (entry,) = _record(1)
    entry.action = "something.else"
    with pytest.raises(DatabaseError), transaction.atomic():
        entry.save()


def test_audit_verify_passes_on_an_intact_chain(db, capsys):
    _record(5)
    call_command("audit_verify")
    assert "intact: 5 entries" in capsys.readouterr().out


def _tamper(sql: str, params) -> None:
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE console_auditentry DISABLE TRIGGER console_audit_append_only")
        cursor.execute(sql, params)
        cursor.execute("ALTER TABLE console_auditentry ENABLE TRIGGER console_audit_append_only")


def test_audit_verify_detects_an_altered_entry(db):
    entries = _record(5)
    _tamper(
        "UPDATE console_auditentry SET data = %s WHERE id = %s",
        ['{"i": 2, "comment": "nothing to see"}', entries[2].pk],
    )
    with pytest.raises(CommandError, match=f"broken at entry {entries[2].pk}.*altered"):
        call_command("audit_verify")


def test_audit_verify_detects_a_deleted_entry(db):
    entries = _record(5)
    _tamper("DELETE FROM console_auditentry WHERE id = %s", [entries[1].pk])
    with pytest.raises(CommandError, match=f"broken at entry {entries[2].pk}.*prev_hash"):
        call_command("audit_verify")


def test_audit_verify_exits_non_zero(db):
    entries = _record(3)
    _tamper("UPDATE console_auditentry SET actor = 'mallory' WHERE id = %s", [entries[0].pk])
    # What the shell sees: the test's transaction is invisible to another process, so run it in-process.
    with pytest.raises(SystemExit) as exit_info:
        execute_from_command_line(["manage.py", "audit_verify"])
    assert exit_info.value.code == 1


def test_every_decision_is_audited_with_the_person_as_actor(db, bob):
    call_command("demo_setup", verbosity=0)
    approves_every_channel(bob)
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    card = Approval.objects.get(run=run)
    card.decide(bob, "reject", comment="wrong customer", reason="wrong_recipient")
    entry = AuditEntry.objects.get(action="approval.reject")
    assert (entry.actor, entry.actor_type, entry.approval_id, entry.run_id) == ("bob", "human", card.pk, run.id)
    assert entry.channel == "payments" and entry.data["comment"] == "wrong customer"
    assert entry.data["reason"] == "wrong_recipient" and entry.trace_id == run.trace_id


def test_cancel_and_dead_letters_are_audited(db, carol):
    call_command("demo_setup", verbosity=0)
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    run.cancel(by=carol)
    failed = drive(submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {"classify": ["fatal"]}})[0])
    cancel, dead = AuditEntry.objects.get(action="run.cancel"), AuditEntry.objects.get(action="run.dead_letter")
    assert (cancel.actor, cancel.run_id) == ("carol", run.id)
    assert (dead.actor, dead.actor_type, dead.run_id) == ("engine", "system", failed.id)
    call_command("audit_verify")
