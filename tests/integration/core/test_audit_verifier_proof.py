"""Issue 24, defect 8: what the offline verifier (core/audit_verifier.py, an export's verify.py) accepts as proof.

- A bundle "downgraded" to plain SHA-256 (a signed log's entries rewritten, altered and hashed again without the
  key, as anyone who can edit the bundle can) is refused when the HMAC key is given: an entry signed by a weaker
  scheme than the key is not proven by it.
- `--anchor` is a head recorded outside the bundle and must be the hash of one of the period's entries, which
  the verifier recomputed. The bundle's own `head_before` is no proof of anything: a rewritten bundle claims to
  start wherever its writer likes.

The verifier runs as the auditor would (tests.integration.core.test_audit_evidence_export.verify)."""

from __future__ import annotations

import hashlib
import json
from datetime import date
from pathlib import Path

from core import audit_verifier
from tests.integration.core.test_audit_evidence_export import (
    KEY,
    _first_difference,
    _intact,
    _signed_day,
    auditor_copy,
    export,
    lines,
    rewrite_lines,
    verify,
)

DAYS = [date(2026, 3, 1), date(2026, 3, 2), date(2026, 3, 3)]


def rewrite_as_plain(bundle: Path, *, alter: int | None = None, head_before: str | None = None) -> None:
    """What someone without the key does to a bundle: change entry `alter` (its data), hash every entry again with
    plain SHA-256 from `head_before` (default: the manifest's), and make the manifest agree (heads, signing,
    checksums). Every check that does not need the key then passes."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    previous = head_before or manifest["chain"]["head_before"]
    rows = []
    for row in lines(bundle / "entries.jsonl"):
        row = {**row, "hash_scheme": "sha256", "hmac_key_id": "", "prev_hash": previous}
        if row["id"] == alter:
            row["data"] = {**row["data"], "comment": "approved by nobody in particular"}
        row["hash"] = previous = audit_verifier.entry_hash(row, None)
        rows.append(row)
    rewrite_lines(bundle / "entries.jsonl", rows)
    manifest["chain"].update(head_before=rows[0]["prev_hash"], head_after=previous)
    manifest["signing"] = {"schemes": {"sha256": len(rows)}, "hmac_key_ids": [], "summary": "none"}
    manifest["files"]["entries.jsonl"] = hashlib.sha256((bundle / "entries.jsonl").read_bytes()).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(manifest))


# --- a downgraded bundle --------------------------------------------------------------------------------------


def test_a_bundle_downgraded_to_plain_sha256_is_refused_when_the_key_is_given(db, settings, tmp_path):
    settings.AUDIT_HMAC_KEY = KEY
    signed = _signed_day(DAYS[0], 3, key=KEY.encode())
    bundle = auditor_copy(export(tmp_path, DAYS[0], DAYS[0]), tmp_path)
    _intact(verify(bundle, key=KEY))

    rewrite_as_plain(bundle, alter=signed[1].pk)
    # Without the key nothing tells (what plain SHA-256 can prove is only as good as an anchor kept elsewhere)...
    _intact(verify(bundle))
    # ...with it, the verifier refuses entries weaker than the key, clearly, and exits 1.
    result = verify(bundle, key=KEY)
    first = _first_difference(result)
    assert first.startswith(f"entry {signed[0].pk} ")
    assert "plain SHA-256" in first and "weaker than the HMAC key given" in first
    assert "downgraded" in first


def test_with_the_key_plain_entries_are_accepted_only_where_a_signed_entry_holds_them(db, settings, tmp_path):
    """A log signed from some day on: the plain entries before the first signed one are held by its HMAC (which
    covers their chain's head), and verify with the key (the existing contract). A period wholly from before
    the key has nothing to hold them: with the key given, the verifier says so instead of reading it intact."""
    settings.AUDIT_HMAC_KEY = KEY
    plain = _signed_day(DAYS[0], 2)
    _signed_day(DAYS[1], 2, key=KEY.encode())
    _intact(verify(auditor_copy(export(tmp_path, DAYS[0], DAYS[1], out="both"), tmp_path), key=KEY))
    before_the_key = auditor_copy(export(tmp_path, DAYS[0], DAYS[0], out="before"), tmp_path)
    assert "weaker than the HMAC key given" in _first_difference(verify(before_the_key, key=KEY))
    assert f"entry {plain[0].pk} " in _first_difference(verify(before_the_key, key=KEY))
    _intact(verify(before_the_key))


# --- the anchor -----------------------------------------------------------------------------------------------


def test_an_anchor_from_the_bundles_own_head_before_is_not_proof(db, tmp_path):
    first, second, _ = (_signed_day(day, n) for day, n in zip(DAYS, (3, 2, 2), strict=True))
    bundle = auditor_copy(export(tmp_path, DAYS[1], DAYS[1]), tmp_path)
    head_before = json.loads((bundle / "manifest.json").read_text())["chain"]["head_before"]
    assert head_before == first[-1].hash
    result = verify(bundle, "--anchor", head_before)
    first_difference = _first_difference(result)
    assert "anchor" in first_difference and "head_before" in first_difference
    assert "proves nothing" in first_difference


def test_a_rewritten_bundle_that_claims_to_start_at_a_recorded_head_is_not_anchored_by_it(db, tmp_path):
    """Someone who knows a head recorded before the period (an earlier export's head_after, a ticket) rewrites the
    period from it: the chain is whole, and the recorded head is its head_before. That is no proof; the head of
    an entry inside the period, recorded when it was written (audit_verify's output), is."""
    first, second, _ = (_signed_day(day, n) for day, n in zip(DAYS, (3, 2, 2), strict=True))
    bundle = auditor_copy(export(tmp_path, DAYS[1], DAYS[1]), tmp_path)
    _intact(verify(bundle, "--anchor", second[-1].hash))  # recorded when it was the log's head
    rewrite_as_plain(bundle, alter=second[0].pk, head_before=first[-1].hash)
    _intact(verify(bundle))  # whole, as far as the bundle alone can tell
    assert "anchor" in _first_difference(verify(bundle, "--anchor", first[-1].hash))
    assert "anchor" in _first_difference(verify(bundle, "--anchor", second[-1].hash))


def test_an_anchor_inside_the_period_says_what_it_proves(db, tmp_path):
    _, second, third = (_signed_day(day, n) for day, n in zip(DAYS, (3, 3, 2), strict=True))
    bundle = auditor_copy(export(tmp_path, DAYS[1], DAYS[1]), tmp_path)
    result = verify(bundle, "--anchor", second[1].hash.upper())
    _intact(result)
    assert f"anchor: entry {second[1].pk} holds the head you recorded" in result.stdout
    assert "1 entry after it" in result.stdout
    # A head from after the period is not in this bundle: checked against the live log or a later export.
    later = _first_difference(verify(bundle, "--anchor", third[-1].hash))
    assert "not the hash of an entry of this period" in later
    # Without an anchor, the verifier says what the heads rest on.
    assert "no --anchor" in verify(bundle).stdout
