"""Evidence for auditors (issue 20.5): `manage.py audit_export` and the audit page's button write a bundle of a
period's audit entries, one evidence record per decision, the head hashes and a manifest, with a standard-library
verifier that says "intact" offline, or names the entry that differs.

The verifier runs as the auditor would: `python -I verify.py` in a copy of the bundle, away from the project."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from datetime import UTC, date, datetime, timedelta
from io import StringIO
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.utils import timezone
from guardian.shortcuts import assign_perm

from approvals.models import Approval
from core import audit_verifier
from core.models import AuditEntry, Channel, audit_key_id
from runs.models import Receipt
from tests.engine_helpers import REFUND
from tests.integration.approvals.test_api_approvals import decide, start_parked_run, work_the_runs_job
from tests.integration.core.test_audit_hash import AWKWARD

KEY = "k" * 40
EDITED_CENTS = 4_321
TODAY = timezone.localdate
CHANGED = "its SHA-256 does not match the manifest (the file was changed)"


# --- making a log worth exporting -----------------------------------------------------------------------------


@pytest.fixture
def demo(db):
    call_command("demo_setup", verbosity=0)
    return {user.username: user for user in User.objects.all()}


@pytest.fixture
def decided(client, demo) -> dict[str, Approval]:
    """Three refunds the agent asked for, decided by the demo's reviewer through the API: one approved, one edited
    (a lower amount), one rejected; the approved and edited ones then executed by their runs' jobs. Between them,
    an ops action (not a decision)."""
    cards = {}
    for decision in ("approve", "edit", "reject"):
        run, card = start_parked_run(client, demo["agent"])
        body = {"decision": decision, "comment": f"{decision}d by the test" if decision != "approve" else ""}
        if decision == "edit":
            payload = copy.deepcopy(card.proposed)
            payload["refund"]["amount_cents"] = EDITED_CENTS
            body["payload"] = payload
        response = decide(client, demo["reviewer"], card, **body)
        assert response.status_code == 200, response.content
        if decision != "reject":
            work_the_runs_job(run)
        cards[decision] = card
        if decision == "approve":
            Channel.objects.get(name="crm").engage_kill_switch(demo["ops"], "crm is down")
    return cards


def _signed_day(day: date, n: int, *, key: bytes | None = None) -> list[AuditEntry]:
    """`n` entries stamped on `day` (record() stamps the database's clock, so these are built by hand), chained
    to the log as record() would: a valid chain with the times a test needs. Earlier than every recorded entry."""
    entries = []
    for i in range(n):
        last = AuditEntry.objects.order_by("-id").values_list("hash", flat=True).first()
        entry = AuditEntry(
            at=datetime(day.year, day.month, day.day, 9, i, tzinfo=UTC),
            actor_type="human",
            actor="bob",
            action="test.action",
            target=f"thing:{day}:{i}",
            data={"comment": f"entry {i} of {day}", "n": i},
            prev_hash=last or AuditEntry.GENESIS,
            hash_scheme="hmac-sha256" if key else "sha256",
            hmac_key_id=audit_key_id(key) if key else "",
        )
        entry.hash = entry.compute_hash(key)
        entry.save(force_insert=True)
        entries.append(entry)
    return entries


def _tamper(sql: str, params) -> None:
    """How tests/test_audit_hash.py simulates someone who can drop the append-only trigger."""
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE console_auditentry DISABLE TRIGGER console_audit_append_only")
        cursor.execute(sql, params)
        cursor.execute("ALTER TABLE console_auditentry ENABLE TRIGGER console_audit_append_only")


# --- exporting and verifying as an auditor would ----------------------------------------------------------------


def export(tmp_path: Path, first=None, last=None, *, out: str = "bundle") -> Path:
    first, last = first or TODAY(), last or TODAY()
    call_command(
        "audit_export", "--from", str(first), "--to", str(last), "--out", str(tmp_path / out), stdout=StringIO()
    )
    return tmp_path / out


def auditor_copy(bundle: Path, tmp_path: Path) -> Path:
    """The bundle where the auditor has it: another directory, nothing of the project beside it."""
    copied = tmp_path / "auditor" / bundle.name
    shutil.copytree(bundle, copied)
    return copied


def verify(bundle: Path, *args: str, key: str | None = None) -> subprocess.CompletedProcess:
    """`python -I -S verify.py` in the bundle: isolated mode (no PYTHONPATH, no user site, not the project's
    directory on sys.path) and no site-packages (the standard library only: not even the virtualenv's Django), an
    environment with nothing of ours but the key when one is given."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **({"AUDIT_HMAC_KEY": key} if key else {})}
    return subprocess.run(
        [sys.executable, "-I", "-S", "verify.py", *args],
        cwd=bundle,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def rewrite_lines(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def _intact(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": intact" in result.stdout.splitlines()[0]


def _first_difference(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "NOT intact" in result.stdout
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("first difference: ")]
    return line.removeprefix("first difference: ")


# --- intact -----------------------------------------------------------------------------------------------------


def test_the_verifier_says_intact_on_a_real_export_away_from_the_project(decided, tmp_path):
    with transaction.atomic():  # numbers and text whose JSON PostgreSQL writes its own way
        AuditEntry.record("test.awkward", data=AWKWARD)
    bundle = auditor_copy(export(tmp_path), tmp_path)
    assert sorted(p.name for p in bundle.iterdir()) == [
        "README.txt",
        "decisions.jsonl",
        "entries.jsonl",
        "manifest.json",
        "verify.py",
    ]
    result = verify(bundle)
    _intact(result)
    # The verifier is the console's own module, byte for byte (what an auditor can compare with the source).
    assert (bundle / "verify.py").read_bytes() == (Path(__file__).parents[3] / "core/audit_verifier.py").read_bytes()


def test_the_bundle_holds_every_hashed_field_exactly_as_hashed_and_the_heads(decided, tmp_path):
    before = AuditEntry.objects.order_by("id")
    bundle = export(tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    rows = lines(bundle / "entries.jsonl")
    stored = list(before.filter(id__lte=manifest["chain"]["last_id"]))
    assert [row["id"] for row in rows] == [e.pk for e in stored]
    for row, entry in zip(rows, stored, strict=True):
        assert row == {"id": entry.pk, "hash": entry.hash, **entry.hashed_fields()}
        assert audit_verifier.canonical(audit_verifier.covered(row)) == entry.canonical()
    assert manifest["chain"] == {
        "entries": len(stored),
        "first_id": stored[0].pk,
        "last_id": stored[-1].pk,
        "head_before": stored[0].prev_hash,
        "head_after": stored[-1].hash,
    }
    # The head at export time is the last entry exported; the export's own entry comes after it.
    assert manifest["database_head"] == {"id": stored[-1].pk, "hash": stored[-1].hash}
    export_entry = AuditEntry.objects.get(action="audit.export")
    assert manifest["export_entry"] == {"id": export_entry.pk, "hash": export_entry.hash}
    assert export_entry.prev_hash == stored[-1].hash
    assert manifest["signing"]["schemes"] == {"sha256": len(stored)} and manifest["signing"]["hmac_key_ids"] == []
    assert set(manifest["files"]) == {"entries.jsonl", "decisions.jsonl", "verify.py", "README.txt"}
    assert manifest["period"]["from"] == manifest["period"]["to"] == str(TODAY())
    assert manifest["decisions"] == 3


def test_only_the_periods_entries_are_exported_and_the_heads_tie_it_to_the_chain(db, tmp_path):
    days = [date(2026, 3, 1), date(2026, 3, 2), date(2026, 3, 3)]
    first, second, third = (_signed_day(day, n) for day, n in zip(days, (3, 2, 2), strict=True))
    bundle = export(tmp_path, days[1], days[1])
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [row["id"] for row in lines(bundle / "entries.jsonl")] == [e.pk for e in second]
    assert manifest["chain"]["head_before"] == first[-1].hash
    assert manifest["chain"]["head_after"] == second[-1].hash
    assert manifest["database_head"]["hash"] == third[-1].hash
    _intact(verify(auditor_copy(bundle, tmp_path)))
    # An anchor recorded elsewhere (audit_verify's head when the period was written) must be an entry of the
    # period; the head before it (an earlier export's head after) proves nothing of it (issue 24, defect 8:
    # tests/integration/core/test_audit_verifier_proof.py).
    _intact(verify(bundle, "--anchor", second[-1].hash))
    assert "proves nothing" in _first_difference(verify(bundle, "--anchor", first[-1].hash))
    assert "anchor" in _first_difference(verify(bundle, "--anchor", third[-1].hash))


def test_a_zip_export_verifies_once_unpacked(decided, tmp_path):
    archive = export(tmp_path, out="evidence.zip")
    with zipfile.ZipFile(archive) as opened:
        assert {Path(name).parent.name for name in opened.namelist()} == {"evidence"}
        opened.extractall(tmp_path / "unpacked")
    _intact(verify(tmp_path / "unpacked" / "evidence"))


# --- per decision: what was proposed, shown, decided, and executed --------------------------------------------


def test_each_decision_has_a_readable_evidence_record(decided, demo, tmp_path):
    bundle = export(tmp_path)
    records = {record["decision"]: record for record in lines(bundle / "decisions.jsonl")}
    assert set(records) == {"approve", "edit", "reject"}
    for decision, record in records.items():
        card = decided[decision]
        entry = AuditEntry.objects.get(approval_id=card.pk, action=f"approval.{decision}")
        # From the entry (proven by the chain).
        assert record["entry"] == {"id": entry.pk, "hash": entry.hash, **entry.hashed_fields()}
        assert (record["entry_id"], record["card_id"], record["by"], record["by_type"]) == (
            entry.pk,
            card.pk,
            "reviewer",
            "human",
        )
        assert record["at"] == entry.at.isoformat() and record["proposed"] == card.proposed
        assert record["on_behalf_of"] is None and record["policy_stage"] is None
        # From the database at export time.
        database = record["database"]
        assert database["agrees_with_the_entry"] is True, database["disagreements"]
        assert database["shown"]["proposed"] == card.proposed and database["shown"]["current"] == card.current
        assert database["shown"]["summary"] == card.summary and database["shown"]["pending_edit"] is None
        assert database["card"]["step"] == "approve_refund" and database["decision_row"]["by"] == "reviewer"
    assert records["reject"]["approved_to_run"] is None and records["reject"]["database"]["executed"] == []
    assert records["reject"]["comment"] == "rejectd by the test"
    assert records["approve"]["approved_to_run"] == decided["approve"].proposed
    assert records["edit"]["approved_to_run"]["refund"]["amount_cents"] == EDITED_CENTS
    # What then executed: the refund and the customer's email, each once, with its outcome.
    for decision, cents in (("approve", REFUND["amount_cents"]), ("edit", EDITED_CENTS)):
        executed = records[decision]["database"]["executed"]
        receipts = Receipt.objects.filter(run_id=decided[decision].run_id).order_by("step_seq")
        assert [(e["step"], e["channel"], e["status"], e["key"]) for e in executed] == [
            (step, r.channel, "done", r.key)
            for step, r in zip(("issue_refund", "notify_customer"), receipts, strict=True)
        ]
        assert executed[0]["response"]["amount_cents"] == cents


def test_the_pending_edit_a_second_person_was_shown_is_in_their_record(client, demo, tmp_path):
    Channel.objects.filter(name="payments").update(required_approvals=2)
    rita = User.objects.create_user("rita")
    rita.groups.add(*demo["reviewer"].groups.all())
    assign_perm("core.approve_channel", rita, Channel.objects.get(name="payments"))
    run, card = start_parked_run(client, demo["agent"])
    payload = copy.deepcopy(card.proposed)
    payload["refund"]["amount_cents"] = EDITED_CENTS
    assert decide(client, rita, card, decision="edit", comment="partial", payload=payload).status_code == 200
    card.refresh_from_db()
    assert decide(client, demo["reviewer"], card, decision="approve").status_code == 200
    work_the_runs_job(run)
    records = lines(export(tmp_path) / "decisions.jsonl")
    edit, approval = records
    assert (edit["by"], edit["approvals"], edit["required"]) == ("rita", 1, 2)
    assert (approval["by"], approval["approvals"], approval["required"]) == ("reviewer", 2, 2)
    shown = approval["database"]["shown"]["pending_edit"]
    assert (shown["by"], shown["comment"], shown["payload"]) == ("rita", "partial", payload)
    assert approval["approved_to_run"] == payload  # proven by the chain: what the approval let run
    assert approval["database"]["executed"][0]["response"]["amount_cents"] == EDITED_CENTS
    assert edit["database"]["shown"]["pending_edit"] is None


def test_a_database_that_changed_since_the_decision_is_flagged_but_not_proven_wrong(decided, tmp_path):
    """The database part of a record is only as trustworthy as the database: the export says where it no longer
    agrees with the entry, and the chain (which does not cover it) stays intact."""
    card = decided["approve"]
    changed = copy.deepcopy(card.proposed)
    changed["refund"]["amount_cents"] = 1
    Approval.objects.filter(pk=card.pk).update(proposed=changed)
    bundle = export(tmp_path)
    record = next(r for r in lines(bundle / "decisions.jsonl") if r["card_id"] == card.pk)
    assert record["database"]["agrees_with_the_entry"] is False
    assert record["database"]["disagreements"] == ["the card's proposal differs from the one the entry recorded"]
    assert record["proposed"] == card.proposed  # the entry's, unchanged
    _intact(verify(auditor_copy(bundle, tmp_path)))


# --- it names what differs ----------------------------------------------------------------------------------------


def test_it_names_the_entry_after_one_byte_of_the_export_is_changed(decided, tmp_path):
    bundle = auditor_copy(export(tmp_path), tmp_path)
    rejected = AuditEntry.objects.get(action="approval.reject")
    text = (bundle / "entries.jsonl").read_bytes()
    line_start = text.index(b'{"id": %d,' % rejected.pk)
    at = text.index(b"rejectd by the test", line_start)
    (bundle / "entries.jsonl").write_bytes(text[:at] + b"R" + text[at + 1 :])  # one byte of a field's value
    result = verify(bundle)
    assert _first_difference(result).startswith(f"entry {rejected.pk} ")
    assert "content does not match its hash (altered)" in _first_difference(result)
    assert "also: entries.jsonl: its SHA-256 does not match the manifest" in result.stdout


def test_it_names_the_entry_after_one_row_in_the_database_is_changed_before_export(decided, tmp_path):
    approved = AuditEntry.objects.get(action="approval.approve")
    _tamper("UPDATE console_auditentry SET actor = 'mallory' WHERE id = %s", [approved.pk])
    bundle = auditor_copy(export(tmp_path), tmp_path)
    result = verify(bundle)
    assert _first_difference(result) == f"entry {approved.pk} (entries.jsonl line {_line_of(bundle, approved.pk)}," + (
        " approval.approve): content does not match its hash (altered)"
    )
    # The files are as exported: only the chain tells.
    assert "SHA-256" not in result.stdout


def test_it_names_the_entry_after_one_row_deleted_from_the_database_before_export(decided, tmp_path):
    edit = AuditEntry.objects.get(action="approval.edit")
    after = AuditEntry.objects.filter(id__gt=edit.pk).order_by("id").first()
    _tamper("DELETE FROM console_auditentry WHERE id = %s", [edit.pk])
    difference = _first_difference(verify(auditor_copy(export(tmp_path), tmp_path)))
    assert difference.startswith(f"entry {after.pk} ")
    assert "an entry is missing between entry" in difference


def test_it_names_the_entry_after_one_that_was_removed_from_the_export(decided, tmp_path):
    bundle = auditor_copy(export(tmp_path), tmp_path)
    rows = lines(bundle / "entries.jsonl")
    removed, after = rows[3], rows[4]
    rewrite_lines(bundle / "entries.jsonl", rows[:3] + rows[4:])
    difference = _first_difference(verify(bundle))
    assert difference.startswith(f"entry {after['id']} (entries.jsonl line 4, ")
    assert f"an entry is missing between entry {rows[2]['id']} and this one" in difference
    assert removed["id"] not in [row["id"] for row in lines(bundle / "entries.jsonl")]


def test_it_says_when_entries_are_missing_at_either_end(decided, tmp_path):
    bundle = auditor_copy(export(tmp_path), tmp_path)
    rows = lines(bundle / "entries.jsonl")
    rewrite_lines(bundle / "entries.jsonl", rows[:-1])
    result = verify(bundle)
    assert _first_difference(result).startswith(f"the last entry (entry {rows[-2]['id']}) is not the head after")
    rewrite_lines(bundle / "entries.jsonl", rows[1:])
    difference = _first_difference(verify(bundle))
    assert difference.startswith(f"entry {rows[1]['id']} (entries.jsonl line 1, ")
    assert "an entry is missing between the head before the period and this one" in difference


def test_it_says_which_file_does_not_match_the_manifest(decided, tmp_path):
    bundle = auditor_copy(export(tmp_path), tmp_path)
    # The database part of a record is not covered by the chain: only the manifest's checksum holds it.
    records = lines(bundle / "decisions.jsonl")
    records[0]["database"]["card"]["status"] = "rejected"
    rewrite_lines(bundle / "decisions.jsonl", records)
    assert (
        _first_difference(verify(bundle))
        == "decisions.jsonl: its SHA-256 does not match the manifest (the file was changed)"
    )
    shutil.rmtree(bundle)
    bundle = auditor_copy(export(tmp_path, out="second"), tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"]["verify.py"] = "0" * 64
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert (
        _first_difference(verify(bundle)) == "verify.py: its SHA-256 does not match the manifest (the file was changed)"
    )


def test_a_decision_record_that_differs_from_its_entry_is_named(decided, tmp_path):
    """The summary beside each entry is recomputed from the entry: changing who decided is caught even when the
    checksum in the manifest is changed to match."""
    bundle = auditor_copy(export(tmp_path), tmp_path)
    records = lines(bundle / "decisions.jsonl")
    records[1]["by"] = "someone else"
    rewrite_lines(bundle / "decisions.jsonl", records)
    _rechecksum(bundle, "decisions.jsonl")
    assert _first_difference(verify(bundle)) == (
        f"decisions.jsonl line 2 (entry {records[1]['entry_id']}): by differ from what its entry says"
    )


# --- a signed log: the key is needed, and never in the bundle -----------------------------------------------------


def test_a_signed_log_verifies_with_the_key_only_and_the_key_is_not_in_the_bundle(db, settings, tmp_path):
    settings.AUDIT_HMAC_KEY = KEY
    _signed_day(date(2026, 3, 1), 2)  # from before the key: plain, held by the first signed entry
    signed = _signed_day(date(2026, 3, 2), 3, key=KEY.encode())
    bundle = auditor_copy(export(tmp_path, date(2026, 3, 1), date(2026, 3, 2)), tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["signing"]["schemes"] == {"sha256": 2, "hmac-sha256": 3}
    assert manifest["signing"]["hmac_key_ids"] == [audit_key_id(KEY.encode())]
    for path in bundle.iterdir():
        assert KEY.encode() not in path.read_bytes(), path.name
    _intact(verify(bundle, key=KEY))
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    _intact(verify(bundle, "--key-file", str(key_file)))
    missing = verify(bundle)
    assert f"entry {signed[0].pk} " in _first_difference(missing) and "cannot check it" in _first_difference(missing)
    assert "give the key with $AUDIT_HMAC_KEY or --key-file" in missing.stdout
    assert "the wrong key" in _first_difference(verify(bundle, key="o" * 40))


# --- bad input: a clear error, and nothing written ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "last", "error"),
    [
        ("2026-03-02", "2026-03-01", r"--from \(2026-03-02\) is after --to \(2026-03-01\)"),
        ("2026-13-01", "2026-03-01", r"--from: '2026-13-01' is not a date \(YYYY-MM-DD\)"),
        ("2026-03-01", "yesterday", r"--to: 'yesterday' is not a date \(YYYY-MM-DD\)"),
        ("2026-3-1", "2026-03-01", r"--from: '2026-3-1' is not a date"),
        ("20260301", "2026-03-01", r"--from: '20260301' is not a date"),  # ISO 8601, but not YYYY-MM-DD
        ("", "2026-03-01", r"--from is required"),
        ("2026-03-04", "2026-03-05", r"no audit entries from 2026-03-04 to 2026-03-05 \(UTC\): nothing to export"),
        ("2099-01-01", "2099-12-31", r"no audit entries from 2099-01-01 to 2099-12-31"),
    ],
)
def test_a_bad_period_is_refused_and_nothing_is_written(db, tmp_path, first, last, error):
    _signed_day(date(2026, 3, 1), 2)
    _signed_day(date(2026, 3, 6), 1)
    before = AuditEntry.objects.count()
    with pytest.raises(CommandError, match=error):
        call_command("audit_export", "--from", first, "--to", last, "--out", str(tmp_path / "out"), stdout=StringIO())
    assert list(tmp_path.iterdir()) == []
    assert AuditEntry.objects.count() == before  # not audited either: nothing was exported


def test_an_export_never_overwrites(db, tmp_path):
    _signed_day(date(2026, 3, 1), 1)
    (tmp_path / "out.zip").write_bytes(b"an earlier export")
    before = AuditEntry.objects.count()
    with pytest.raises(CommandError, match="out.zip exists"):
        call_command("audit_export", "--from", "2026-03-01", "--to", "2026-03-01", "--out", str(tmp_path / "out.zip"))
    assert (tmp_path / "out.zip").read_bytes() == b"an earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.zip"] and AuditEntry.objects.count() == before


def test_the_command_export_is_audited(db, tmp_path):
    _signed_day(date(2026, 3, 1), 2)
    export(tmp_path, date(2026, 3, 1), date(2026, 3, 1))
    entry = AuditEntry.objects.get(action="audit.export")
    assert entry.actor.startswith("manage.py audit_export (os user ") and entry.actor_type == "system"
    assert entry.target == "audit:2026-03-01..2026-03-01"
    assert (entry.data["from"], entry.data["to"], entry.data["entries"], entry.data["via"]) == (
        "2026-03-01",
        "2026-03-01",
        2,
        "manage.py audit_export",
    )


# --- the audit page's button ------------------------------------------------------------------------------------


def _unzip(content: bytes, tmp_path: Path) -> Path:
    with zipfile.ZipFile(io.BytesIO(content)) as opened:
        opened.extractall(tmp_path / "download")
        (folder,) = {Path(name).parts[0] for name in opened.namelist()}
    return tmp_path / "download" / folder


def test_an_admin_downloads_the_same_bundle_from_the_audit_page_and_it_is_audited(client, decided, alice, tmp_path):
    client.force_login(alice)
    page = client.get("/audit/")
    assert b'action="/audit/evidence.zip"' in page.content and b"Export evidence" in page.content
    today = str(TODAY())
    response = client.post("/audit/evidence.zip", {"from": today, "to": today})
    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"] == "application/zip"
    assert response["Content-Disposition"] == f'attachment; filename="audit-export-{today}-to-{today}.zip"'
    bundle = _unzip(b"".join(response.streaming_content), tmp_path)
    _intact(verify(bundle))
    entry = AuditEntry.objects.get(action="audit.export")
    assert (entry.actor, entry.actor_type, entry.data["from"], entry.data["to"], entry.data["via"]) == (
        "alice",
        "human",
        today,
        today,
        "console",
    )
    assert json.loads((bundle / "manifest.json").read_text())["exported"]["by"] == "alice"


def test_the_download_streams_under_asgi_too(async_client, decided, alice, tmp_path):
    async_client.force_login(alice)
    today = str(TODAY())

    async def fetch() -> bytes:
        response = await async_client.post("/audit/evidence.zip", {"from": today, "to": today})
        assert response.status_code == 200 and response.is_async
        return b"".join([chunk async for chunk in response.streaming_content])

    _intact(verify(_unzip(async_to_sync(fetch)(), tmp_path)))


@pytest.mark.parametrize("user", ["bob", "carol", "dave"])
def test_the_button_is_refused_to_non_admins_and_nothing_is_written(client, db, request, user):
    _signed_day(date(2026, 3, 1), 2)
    client.force_login(request.getfixturevalue(user))
    before = AuditEntry.objects.count()
    response = client.post("/audit/evidence.zip", {"from": "2026-03-01", "to": "2026-03-01"})
    assert response.status_code == 403
    assert AuditEntry.objects.count() == before


def test_anonymous_is_sent_to_login_and_a_get_is_refused(client, alice, db):
    response = client.post("/audit/evidence.zip", {"from": "2026-03-01", "to": "2026-03-01"})
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    client.force_login(alice)
    assert client.get("/audit/evidence.zip").status_code == 405
    assert not AuditEntry.objects.filter(action="audit.export").exists()


@pytest.mark.parametrize(
    ("form", "error"),
    [
        ({"from": "2026-03-02", "to": "2026-03-01"}, "From (2026-03-02) is after To (2026-03-01)"),
        ({"from": "2026-03-01", "to": "soon"}, "To: 'soon' is not a date (YYYY-MM-DD)"),
        ({"to": "2026-03-01"}, "From is required"),
        ({"from": "2026-02-01", "to": "2026-02-28"}, "no audit entries from 2026-02-01 to 2026-02-28 (UTC)"),
    ],
)
def test_a_bad_period_on_the_page_is_a_400_and_nothing_is_written(client, alice, db, form, error):
    _signed_day(date(2026, 3, 1), 2)
    client.force_login(alice)
    before = AuditEntry.objects.count()
    response = client.post("/audit/evidence.zip", form)
    assert response.status_code == 400 and error in response.content.decode()
    assert AuditEntry.objects.count() == before


# --- helpers ------------------------------------------------------------------------------------------------------


def _line_of(bundle: Path, entry_id: int) -> int:
    return next(n for n, row in enumerate(lines(bundle / "entries.jsonl"), 1) if row["id"] == entry_id)


def test_a_decision_whose_record_was_removed_is_named(decided, tmp_path):
    bundle = auditor_copy(export(tmp_path), tmp_path)
    records = lines(bundle / "decisions.jsonl")
    rewrite_lines(bundle / "decisions.jsonl", records[1:])
    _rechecksum(bundle, "decisions.jsonl")
    assert _first_difference(verify(bundle)) == (
        f"entry {records[0]['entry_id']} is a decision (approval.approve) without its record in decisions.jsonl"
    )


def _rechecksum(bundle: Path, name: str) -> None:
    """What someone who edits a file would do next: make the manifest's checksum match it."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256((bundle / name).read_bytes()).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def test_a_manifest_that_misstates_the_period_the_decisions_or_the_signing_is_named(decided, tmp_path):
    bundle = auditor_copy(export(tmp_path), tmp_path)
    original = json.loads((bundle / "manifest.json").read_text())
    first = lines(bundle / "entries.jsonl")[0]
    tomorrow = TODAY() + timedelta(days=1)
    misstatements = {
        "period": (
            {"from": str(tomorrow), "to": str(tomorrow), "start": f"{tomorrow}T00:00:00+00:00"},
            f"entry {first['id']}: at {first['at']} is outside the period",
        ),
        "decisions": ({"decisions": 2}, "decisions.jsonl holds 3 records, the manifest says 2"),
        "signing": ({"signing": {"schemes": {"hmac-sha256": 10}}}, "manifest.json: its signing"),
    }
    for change, expected in misstatements.values():
        manifest = copy.deepcopy(original)
        for key, value in change.items():
            (manifest["period"] if key in ("from", "to", "start") else manifest)[key] = value
        if "from" in change:
            manifest["period"]["end"] = f"{tomorrow + timedelta(days=1)}T00:00:00+00:00"
        (bundle / "manifest.json").write_text(json.dumps(manifest))
        assert _first_difference(verify(bundle)).startswith(expected)


def test_a_malformed_bundle_is_not_intact_and_says_why_without_a_traceback(decided, tmp_path):
    original = export(tmp_path)
    rows = lines(original / "entries.jsonl")
    mangled = {
        "a hash with non-ASCII characters": (
            lambda bundle: rewrite_lines(bundle / "entries.jsonl", [{**rows[0], "hash": "é" * 64}, *rows[1:]]),
            f"entry {rows[0]['id']} (entries.jsonl line 1, ",
        ),
        "an id that is not a number": (
            lambda bundle: rewrite_lines(bundle / "entries.jsonl", [{**rows[0], "id": [1]}, *rows[1:]]),
            "entries.jsonl line 1: its id [1] is not a whole number",
        ),
        "a line that is not JSON": (
            lambda bundle: (bundle / "entries.jsonl").write_bytes(b"{not json\n"),
            "entries.jsonl line 1: not JSON",
        ),
        "a manifest that is not JSON": (
            lambda bundle: (bundle / "manifest.json").write_text("[]"),
            "manifest.json: cannot be read (not a JSON object)",
        ),
    }
    for name, (mangle, expected) in mangled.items():
        bundle = tmp_path / name
        shutil.copytree(original, bundle)
        mangle(bundle)
        result = verify(bundle)
        assert "Traceback" not in result.stderr, (name, result.stderr)
        assert _first_difference(result).startswith(expected), name
