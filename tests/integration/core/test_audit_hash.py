"""The audit log's hash covers exactly what is stored, TRUNCATE is refused, AUDIT_HMAC_KEY signs the chain, and
audit_verify prints the head to anchor elsewhere."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import random
import struct
import subprocess
import sys
import uuid
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command, execute_from_command_line
from django.db import DatabaseError, connection, transaction
from django.db.backends.base.operations import BaseDatabaseOperations
from django.db.backends.postgresql.operations import DatabaseOperations

from core.models import AuditEntry, audit_key_id

KEY = "k" * 40
OTHER_KEY = "o" * 40

# Numbers whose Python JSON text is not the text jsonb keeps, and strings and keys in every order.
AWKWARD = {
    "zebra": 1,
    "big": 1e16,
    "negative_zero": -0.0,
    "huge": 1.5e300,
    "tenth": 0.1,
    "beyond_int64": 10**20,
    "one": 1.0,
    "tiny": 1e-7,
    "subnormal": 5e-324,
    "max": 1.7976931348623157e308,
    "min": -1.7976931348623157e308,
    "nested": [1e16, {"z": -0.0, "a": [1e300, 2.5e-8, [1e22, -1e-300]]}],
    "unicode": "é€😀\u2028\u202e ß",
    "ключ": {"b": 2, "a": 1, "ä": 3, "A": 4},
    "alpha": None,
}


def _record(n: int = 1, **kwargs) -> list[AuditEntry]:
    with transaction.atomic():
        return [AuditEntry.record("test.action", target=f"thing:{i}", **kwargs) for i in range(n)]


def _verify(*args) -> str:
    out = StringIO()
    call_command("audit_verify", *args, stdout=out)
    return out.getvalue()


def _tamper(sql: str, params) -> None:
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE console_auditentry DISABLE TRIGGER console_audit_append_only")
        cursor.execute(sql, params)
        cursor.execute("ALTER TABLE console_auditentry ENABLE TRIGGER console_audit_append_only")


def _exit_code() -> int:
    """What the shell would see (in-process: the test's transaction is invisible to another process)."""
    try:
        execute_from_command_line(["manage.py", "audit_verify"])
    except SystemExit as exit_:
        return exit_.code
    return 0


# What is hashed is what is stored


def test_it_hashes_awkward_numbers_as_postgresql_stores_them(db):
    (entry,) = _record(data=AWKWARD)
    stored = AuditEntry.objects.get(pk=entry.pk)
    assert stored.data == entry.data and stored.compute_hash() == entry.hash
    # What jsonb made of them, and what the entry kept.
    assert stored.data["big"] == 10**16 and isinstance(stored.data["big"], int)
    assert math.copysign(1, stored.data["negative_zero"]) == 1
    assert stored.data["huge"] == 15 * 10**299 and stored.data["tiny"] == 1e-7 and stored.data["one"] == 1.0
    assert "intact: 1 entries" in _verify()


def test_audit_verify_exits_zero_after_awkward_entries(db, bob):
    _record(2, actor=bob, data=AWKWARD)
    _record(1, data={"edited": {"amount": 1e16, "currency": "EUR"}, "comment": "huge float"})
    assert _exit_code() == 0


def test_keys_in_any_order_hash_the_same(db):
    forward = {"a": 1, "b": [1.5, {"c": 1e16, "d": "x"}]}
    backward = {"b": [1.5, {"d": "x", "c": 1e16}], "a": 1}
    first, second = _record(data=forward)[0], _record(data=backward)[0]
    assert first.data == second.data
    assert json.loads(first.canonical())["data"] == json.loads(second.canonical())["data"]
    _verify()


def test_random_doubles_and_large_integers_all_verify(db):
    rng = random.Random(20261201)
    doubles = [struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0] for _ in range(4000)]
    doubles = [value for value in doubles if math.isfinite(value)]
    scaled = [rng.uniform(-1, 1) * 10.0 ** rng.randint(-320, 308) for _ in range(2000)]
    integers = [rng.getrandbits(rng.randint(1, 200)) * rng.choice([1, -1]) for _ in range(500)]
    for chunk in range(0, len(doubles), 1000):
        _record(data={"doubles": doubles[chunk : chunk + 1000]})
    _record(data={"scaled": scaled, "integers": integers, "as_keys": {repr(v): v for v in scaled[:200]}})
    assert "intact" in _verify()


def test_tampering_with_an_awkward_entry_is_still_detected(db):
    entries = _record(3, data=AWKWARD)
    altered = {**entries[1].data, "big": 10**16 + 1}
    _tamper("UPDATE console_auditentry SET data = %s WHERE id = %s", [json.dumps(altered), entries[1].pk])
    with pytest.raises(CommandError, match=f"broken at entry {entries[1].pk}.*altered"):
        call_command("audit_verify")
    assert _exit_code() == 1


def test_rewriting_a_number_in_another_notation_is_no_tampering(db):
    """jsonb itself treats 1e16 and 10000000000000000 as one value: a rewrite that stores the same value is no
    change, and must not read as one."""
    (entry,) = _record(data={"amount": 1e16})
    _tamper("UPDATE console_auditentry SET data = %s WHERE id = %s", ['{"amount": 1e16}', entry.pk])
    assert _exit_code() == 0


# TRUNCATE


@pytest.mark.parametrize(
    "statement", ["TRUNCATE console_auditentry", "TRUNCATE console_channel, console_auditentry CASCADE"]
)
def test_the_database_refuses_truncate(db, statement):
    _record(2)
    with pytest.raises(DatabaseError, match="TRUNCATE refused"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(statement)
    assert AuditEntry.objects.count() == 2


class _RolledBack(Exception):
    pass


def test_the_tables_owner_may_waive_it_in_its_own_transaction(db):
    _record(2)
    with pytest.raises(_RolledBack), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL console.allow_audit_truncate = on")
        cursor.execute("TRUNCATE console_auditentry")
        assert not AuditEntry.objects.exists()
        raise _RolledBack  # (a savepoint of the test's transaction: its rollback undoes the SET LOCAL too)
    assert AuditEntry.objects.count() == 2
    with pytest.raises(DatabaseError, match="TRUNCATE refused"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("TRUNCATE console_auditentry")


def test_the_waiver_gives_a_role_that_does_not_own_the_table_nothing(db):
    _record(1)
    with connection.cursor() as cursor:
        cursor.execute("SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user")
        if not cursor.fetchone()[0]:
            pytest.skip("the test database's role cannot create a role")
    role = f"audit_truncater_{uuid.uuid4().hex[:12]}"  # created in the test's transaction, rolled back with it
    with pytest.raises(DatabaseError, match="TRUNCATE refused"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {role}")
        cursor.execute(f"GRANT TRUNCATE ON console_auditentry TO {role}")
        cursor.execute(f"SET LOCAL ROLE {role}")
        cursor.execute("SET LOCAL console.allow_audit_truncate = on")
        cursor.execute("TRUNCATE console_auditentry")
    assert AuditEntry.objects.count() == 1


def test_manage_py_flush_is_refused_unless_waived(db, monkeypatch):
    _record(2)
    # Django's own flush, without the test suite's waiver (tests/conftest.py).
    monkeypatch.setattr(DatabaseOperations, "execute_sql_flush", BaseDatabaseOperations.execute_sql_flush)
    with pytest.raises(CommandError, match="couldn't be flushed") as refused:
        call_command("flush", interactive=False, verbosity=0)
    assert "TRUNCATE refused" in str(refused.value.__cause__)
    assert AuditEntry.objects.count() == 2
    # How bench/resume_latency.py empties its throwaway database.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL console.allow_audit_truncate = on")
        call_command("flush", interactive=False, verbosity=0)
    assert not AuditEntry.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_transactional_tests_flush_still_empties_the_log():
    """The flush after this test truncates the log (tests/conftest.py waives the trigger for it): a refused
    flush fails this test's teardown. The next test sees the log empty."""
    _record(3)


def test_after_a_flush_the_log_is_empty(transactional_db):
    assert not AuditEntry.objects.exists()
    _record(1)
    _verify()


# AUDIT_HMAC_KEY


def test_with_a_key_each_entry_is_an_hmac(db, settings):
    settings.AUDIT_HMAC_KEY = KEY
    first, second = _record(2, data={"amount": 1e16})
    for entry in (first, second):
        assert (entry.hash_scheme, entry.hmac_key_id) == ("hmac-sha256", audit_key_id(KEY.encode()))
        canonical = AuditEntry.objects.get(pk=entry.pk).canonical().encode()
        assert entry.hash == hmac.new(KEY.encode(), canonical, hashlib.sha256).hexdigest()
        assert entry.hash != hashlib.sha256(canonical).hexdigest()
    assert second.prev_hash == first.hash
    out = _verify()
    assert "intact: 2 entries" in out and f"2 entries HMAC-SHA256 with key {first.hmac_key_id}" in out


def test_a_database_writer_cannot_recompute_a_signed_entry(db, settings):
    settings.AUDIT_HMAC_KEY = KEY
    entries = _record(3)
    last = AuditEntry.objects.get(pk=entries[-1].pk)
    last.data = {"comment": "nothing happened"}
    # The forger's best: an HMAC under a key of their own, or plain SHA-256.
    last.hash_scheme, last.hmac_key_id = "hmac-sha256", audit_key_id(OTHER_KEY.encode())
    forged_hmac = last.compute_hash(OTHER_KEY.encode())
    last.hash_scheme, last.hmac_key_id = "sha256", ""
    forged_plain = last.compute_hash()
    update = "UPDATE console_auditentry SET data = %s, hash_scheme = %s, hmac_key_id = %s, hash = %s WHERE id = %s"
    data = json.dumps(last.data)
    _tamper(update, [data, "hmac-sha256", audit_key_id(KEY.encode()), forged_hmac, last.pk])
    with pytest.raises(CommandError, match=f"broken at entry {last.pk}.*altered"):
        call_command("audit_verify")
    _tamper(update, [data, "hmac-sha256", audit_key_id(OTHER_KEY.encode()), forged_hmac, last.pk])
    with pytest.raises(CommandError, match=f"broken at entry {last.pk}.*wrong key"):
        call_command("audit_verify")
    _tamper(update, [data, "sha256", "", forged_plain, last.pk])
    with pytest.raises(CommandError, match=f"broken at entry {last.pk}.*unsigned after signed entries"):
        call_command("audit_verify")


def test_audit_verify_says_when_the_key_is_missing_or_wrong(db, settings):
    settings.AUDIT_HMAC_KEY = KEY
    (entry,) = _record(1)
    settings.AUDIT_HMAC_KEY = ""
    with pytest.raises(CommandError, match=f"entry {entry.pk}.*AUDIT_HMAC_KEY is not set: cannot check it"):
        call_command("audit_verify")
    settings.AUDIT_HMAC_KEY = OTHER_KEY
    with pytest.raises(CommandError, match=f"AUDIT_HMAC_KEY is key {audit_key_id(OTHER_KEY.encode())}.*wrong key"):
        call_command("audit_verify")
    assert _exit_code() == 1


def test_entries_from_before_the_key_stay_plain_and_are_held_by_the_first_signed_one(db, settings):
    plain = _record(3)
    settings.AUDIT_HMAC_KEY = KEY
    signed = _record(2)
    assert {e.hash_scheme for e in plain} == {"sha256"} and {e.hash_scheme for e in signed} == {"hmac-sha256"}
    assert signed[0].prev_hash == plain[-1].hash
    assert "2 entries HMAC-SHA256 with key" in _verify() and "after 3 plain SHA-256" in _verify()
    # Someone without the key rewrites the plain entries and recomputes their SHA-256 chain: the first signed
    # entry's HMAC covers the last plain hash, so the break shows there.
    previous = AuditEntry.GENESIS
    for entry in AuditEntry.objects.filter(pk__in=[e.pk for e in plain]).order_by("id"):
        entry.actor, entry.prev_hash = "mallory", previous
        entry.hash = previous = entry.compute_hash()
        _tamper(
            "UPDATE console_auditentry SET actor = %s, prev_hash = %s, hash = %s WHERE id = %s",
            [entry.actor, entry.prev_hash, entry.hash, entry.pk],
        )
    with pytest.raises(CommandError, match=f"broken at entry {signed[0].pk}.*prev_hash"):
        call_command("audit_verify")


def test_writing_without_the_key_after_signed_entries_is_logged_and_reported(db, settings, caplog):
    settings.AUDIT_HMAC_KEY = KEY
    _record(1)
    settings.AUDIT_HMAC_KEY = ""
    (unsigned,) = _record(1)
    assert unsigned.hash_scheme == "sha256"
    assert "AUDIT_HMAC_KEY is not set, but the audit log is signed" in caplog.text
    settings.AUDIT_HMAC_KEY = KEY
    with pytest.raises(CommandError, match=f"broken at entry {unsigned.pk}.*unsigned after signed"):
        call_command("audit_verify")


def test_a_short_key_stops_the_process():
    env = {**os.environ, "AUDIT_HMAC_KEY": "too-short"}
    proc = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=settings.BASE_DIR, env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "AUDIT_HMAC_KEY must be at least 32 characters" in proc.stderr


# The head, to anchor elsewhere


def test_audit_verify_prints_the_head_hash_and_the_count(db):
    entries = _record(4)
    out = _verify()
    assert "audit log intact: 4 entries" in out
    assert f"head: entry {entries[-1].pk} hash {entries[-1].hash}" in out
    assert "signing: none (AUDIT_HMAC_KEY is not set): 4 entries plain SHA-256" in out


def test_audit_verify_of_an_empty_log(db):
    out = _verify()
    assert "intact: 0 entries" in out and f"head: none (genesis {AuditEntry.GENESIS})" in out


def test_an_anchored_head_finds_entries_removed_from_the_end(db):
    entries = _record(3)
    anchor = entries[-1].hash
    later = _record(2)
    assert f"anchor: entry {entries[-1].pk}, unchanged, and 2 entries after it" in _verify("--anchor", anchor)
    # Removing the newest entries leaves a chain that is whole: only the anchor tells.
    _tamper("DELETE FROM console_auditentry WHERE id >= %s", [entries[-1].pk])
    assert f"head: entry {entries[-2].pk}" in _verify()
    with pytest.raises(CommandError, match=f"anchor {anchor} is not in the audit log"):
        call_command("audit_verify", "--anchor", anchor)
    assert later  # appended after the anchor, then removed with it
