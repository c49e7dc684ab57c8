"""The audit log's hash, and the offline check of an audit export (docs/audit-evidence.md).

This file is copied, byte for byte, into every bundle that `manage.py audit_export` writes, as `verify.py`: an
auditor runs it on their own machine, with any Python 3.8 or later and nothing else (standard library only, no
access to the console or its database):

    python3 verify.py                      # in the unpacked bundle's directory
    AUDIT_HMAC_KEY=... python3 verify.py   # when the log is signed (HMAC-SHA256): the key, never in the bundle
    python3 verify.py --anchor HASH        # a head recorded outside the bundle, of an entry of the period

It prints "intact" and exits 0, or names the first entry that differs (and every file whose checksum does not
match the manifest) and exits 1; 2 for a usage error.

The console itself uses the same functions for every entry it writes and checks (core.models.AuditEntry:
`canonical`, `compute_hash`, `verify_chain`), so what the bundle's verifier recomputes cannot drift from what
was hashed.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import sys
from datetime import date, datetime, timedelta
from pathlib import Path

GENESIS = "0" * 64
SHA256 = "sha256"
HMAC_SHA256 = "hmac-sha256"

# What an entry's hash covers: these fields, and on a signed entry how it was signed (SIGNING_FIELDS) too. Plain
# entries hash exactly CONTENT_FIELDS, as they did before signing existed, so entries written then still verify.
CONTENT_FIELDS = (
    "at",
    "actor_type",
    "actor",
    "action",
    "target",
    "run_id",
    "approval_id",
    "channel",
    "data",
    "trace_id",
    "prev_hash",
)
SIGNING_FIELDS = ("hash_scheme", "hmac_key_id")

# The bundle's files (manage.py audit_export writes them; the manifest lists every one but itself).
MANIFEST = "manifest.json"
ENTRIES = "entries.jsonl"
DECISIONS = "decisions.jsonl"
KEY_VARIABLE = "AUDIT_HMAC_KEY"

# The audit actions that are a decision on a card, and the decision each one is.
DECISION_ACTIONS = {
    "approval.approve": "approve",
    "approval.edit": "edit",
    "approval.reject": "reject",
    "sla.safe_default": "reject",
}


class MissingKey(Exception):
    """A signed entry's hash cannot be recomputed without the key."""


def covered(fields: dict) -> dict:
    """The part of an entry (a dict with at least CONTENT_FIELDS and hash_scheme) that its hash covers."""
    content = {name: fields[name] for name in CONTENT_FIELDS}
    if fields.get("hash_scheme", SHA256) != SHA256:
        content.update({name: fields[name] for name in SIGNING_FIELDS})
    return content


def canonical(content: dict) -> str:
    """The text a hash is made of: sorted, compact JSON, non-ASCII characters as they are."""
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def entry_hash(fields: dict, key: bytes | None) -> str:
    """The hash of an entry by its scheme: SHA-256, or HMAC-SHA256 under `key` (MissingKey without one)."""
    text = canonical(covered(fields)).encode()
    scheme = fields.get("hash_scheme", SHA256)
    if scheme == HMAC_SHA256:
        if key is None:
            raise MissingKey("this audit entry is signed: the HMAC key is needed to check it")
        return hmac.new(key, text, hashlib.sha256).hexdigest()
    if scheme != SHA256:
        raise ValueError(f"unknown hash scheme {scheme!r}")
    return hashlib.sha256(text).hexdigest()


def key_id(key: bytes) -> str:
    """A key's name, stored with each entry it signs: which key signed an entry, without revealing it."""
    # The message names the table's first home; it stays, or every stored key id would change.
    return hmac.new(key, b"console.auditentry key id", hashlib.sha256).hexdigest()[:16]


class Chain:
    """Checks entries one at a time, in id order, from `previous` (the hash before the first of them): each
    one's link to the one before, how it was signed, and its hash. `key_name` is how messages name the key."""

    def __init__(self, key: bytes | None, *, previous: str = GENESIS, key_name: str = KEY_VARIABLE):
        self.key, self.key_id = key, (key_id(key) if key is not None else "")
        self.previous, self.previous_id = previous, None
        self.key_name = key_name
        self.signed_seen = False

    def check(self, fields: dict, hash_: str, id_=None) -> str | None:
        """What is wrong with this entry (None when nothing is), and move on past it."""
        scheme = fields.get("hash_scheme", SHA256)
        signed = scheme == HMAC_SHA256
        problem = None
        if fields.get("prev_hash") != self.previous:
            problem = f"prev_hash does not match the entry before it ({self.previous[:12]}…)"
            if self._own_hash_holds(fields, hash_):
                # The entry is as it was written, and its hash covers its prev_hash: what it followed is gone.
                before = f"entry {self.previous_id}" if self.previous_id is not None else "the head before the period"
                problem += f": an entry is missing between {before} and this one, or {before} was altered"
        elif scheme not in (SHA256, HMAC_SHA256):
            problem = f"unknown hash scheme {scheme!r} (altered)"
        elif signed and self.key is None:
            problem = (
                f"signed with HMAC key {fields.get('hmac_key_id')}, but {self.key_name} is not set: cannot check it"
            )
        elif signed and fields.get("hmac_key_id") != self.key_id:
            problem = (
                f"signed with HMAC key {fields.get('hmac_key_id')}, but {self.key_name} is key {self.key_id}"
                " (the wrong key, or an altered entry)"
            )
        elif not signed and self.signed_seen:
            # Anyone who can write to the database can append plain entries; once the log is signed, only a writer
            # without the key makes them.
            problem = f"unsigned after signed entries: written without {self.key_name}, or forged"
        elif not _same(entry_hash(fields, self.key), hash_):
            problem = "content does not match its hash (altered)"
        self.signed_seen = self.signed_seen or signed
        self.previous, self.previous_id = str(hash_), id_
        return problem

    def _own_hash_holds(self, fields: dict, hash_: str) -> bool:
        try:
            return _same(entry_hash(fields, self.key), hash_)
        except (MissingKey, ValueError, KeyError):
            return False


def _same(computed: str, stored) -> bool:
    # Bytes: compare_digest refuses a str with non-ASCII characters, which a forged line may hold.
    return hmac.compare_digest(computed.encode(), str(stored).encode())


def decision_summary(entry: dict) -> dict:
    """The readable part of a decision's evidence record, made from its audit entry alone (so proven by the
    chain): the exporter writes it, the verifier recomputes it and compares."""
    data = entry.get("data") if isinstance(entry.get("data"), dict) else {}
    decision = DECISION_ACTIONS.get(entry.get("action"))
    return {
        "entry_id": entry.get("id"),
        "at": entry.get("at"),
        "card_id": entry.get("approval_id"),
        "run_id": entry.get("run_id"),
        "channel": entry.get("channel"),
        "decision": decision,
        "by": entry.get("actor"),
        "by_type": entry.get("actor_type"),
        # Filled by the console once it records delegation and approval policies (null before).
        "on_behalf_of": data.get("on_behalf_of"),
        "policy_stage": data.get("policy_stage"),
        "comment": data.get("comment", ""),
        "reason": data.get("reason", ""),
        "proposed": data.get("proposed"),
        # What this decision approved to run: an edit's payload, or the pending edit an approval accepted, else
        # the proposal; nothing for a rejection.
        "approved_to_run": None if decision == "reject" else data.get("payload", data.get("proposed")),
        "approvals": data.get("approvals"),
        "required": data.get("required"),
        "card_version": data.get("version"),
        "shadow": bool(data.get("shadow", False)),
        "agreement": data.get("agreement"),
    }


# --- the offline check of a bundle --------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


class Report:
    def __init__(self):
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.anchored = ""  # what the anchor proved, said when the bundle is intact

    def problem(self, text: str) -> None:
        self.problems.append(text)


def _read_jsonl(path: Path, report: Report, name: str):
    """(line number, object) for each line of a JSON-lines file; a line that is not a JSON object is a problem."""
    with path.open("rb") as stream:
        for number, raw in enumerate(stream, 1):
            try:
                value = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                report.problem(f"{name} line {number}: not JSON ({exc})")
                continue
            if not isinstance(value, dict):
                report.problem(f"{name} line {number}: not a JSON object")
                continue
            yield number, value


def verify_bundle(bundle: Path, key: bytes | None, *, anchor: str | None = None) -> tuple[Report, dict]:
    """Check a bundle: its files against the manifest's SHA-256, its entries as a chain from the manifest's head
    before the period to its head after it, and each decision record's entry against the chain. Returns the
    report and the manifest (empty if unreadable)."""
    report = Report()
    try:
        manifest = json.loads((bundle / MANIFEST).read_text(encoding="utf-8"))
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        report.problem(f"{MANIFEST}: cannot be read ({exc})")
        return report, {}
    chain_facts = manifest.get("chain") if isinstance(manifest.get("chain"), dict) else {}
    entries = _check_entries(bundle, manifest, chain_facts, key, report)
    decisions = _check_decisions(bundle, entries, report)
    _check_the_manifests_facts(manifest, entries, decisions, report)
    _check_files(bundle, manifest, report)
    if anchor is not None:
        _check_anchor(anchor, chain_facts, entries, key, report)
    else:
        report.notes.append(
            "no --anchor: the chain holds between the manifest's own heads, which whoever rewrites the whole bundle"
            " rewrites too; give a head recorded outside the bundle (manage.py audit_verify prints the log's head)"
        )
    return report, manifest


def _check_anchor(anchor: str, facts: dict, entries: dict, key: bytes | None, report: Report) -> None:
    """An anchor is a head recorded outside the bundle (manage.py audit_verify's output in a ticket or a log
    shipper): the hash of an entry of the period, whose hash the chain check recomputed, proves that entry and
    every one before it in the period, since each hash covers the one before. Nothing of the bundle is ever an
    anchor: the manifest's `head_before` least of all, since a bundle rewritten from scratch claims to start at
    whatever head its writer knows (an earlier export's head after, say)."""
    anchor = anchor.strip().lower()
    held = sorted(id_ for id_, line in entries.items() if str(line.get("hash")).lower() == anchor)
    if held:
        id_ = held[0]
        after = sum(1 for other in entries if other > id_)
        rest = "the bundle and the HMAC key" if key is not None else "the bundle alone"
        report.anchored = (
            f"anchor: entry {id_} holds the head you recorded: entries {min(entries)} to {id_} are the ones it was"
            f" recorded over; {after} {'entry' if after == 1 else 'entries'} after it rest on {rest}"
        )
    elif anchor == str(facts.get("head_before")).lower():
        report.problem(
            f"anchor {anchor} is the bundle's own head_before, which proves nothing: a rewritten bundle starts at"
            " any head its writer knows. Give the hash of an entry of the period, recorded outside the bundle"
            " (manage.py audit_verify's head when it was written)"
        )
    else:
        report.problem(
            f"anchor {anchor} is not the hash of an entry of this period: the bundle is not the log that head was"
            " taken from, or the head was recorded after the period (check that one against the live log,"
            " manage.py audit_verify --anchor, or a later export)"
        )


def _check_entries(bundle: Path, manifest: dict, facts: dict, key: bytes | None, report: Report) -> dict:
    path = bundle / ENTRIES
    if not path.is_file():
        report.problem(f"{ENTRIES}: missing")
        return {}
    chain = Chain(key, previous=str(facts.get("head_before")), key_name="the HMAC key (--key-file or $AUDIT_HMAC_KEY)")
    entries: dict = {}
    last_id = None
    weak: list = []
    for number, line in _read_jsonl(path, report, ENTRIES):
        missing = [name for name in ("id", "hash", *CONTENT_FIELDS) if name not in line]
        if missing:
            report.problem(f"{ENTRIES} line {number} (entry {line.get('id')}): fields missing: {', '.join(missing)}")
            continue
        id_ = line["id"]
        if not isinstance(id_, int) or isinstance(id_, bool):
            report.problem(f"{ENTRIES} line {number}: its id {id_!r} is not a whole number")
        elif last_id is not None and id_ <= last_id:
            report.problem(f"entry {id_} ({ENTRIES} line {number}): out of order, after entry {last_id}")
        problem = chain.check(line, line["hash"], id_)
        if problem is not None:
            report.problem(f"entry {id_} ({ENTRIES} line {number}, {line.get('action')}): {problem}")
        # The plain entries that no signed entry follows yet (a signed one holds every entry before it).
        if line.get("hash_scheme") == HMAC_SHA256:
            weak.clear()
        else:
            weak.append(id_)
        if isinstance(id_, int):
            entries[id_] = line
            last_id = id_ if last_id is None else max(id_, last_id)
    if key is not None and weak:
        # The key says this log is signed. A plain entry is then proven only by a signed entry after it, whose HMAC
        # covers its hash (the entries from before the log was signed); one with none after it, anyone who can edit
        # the bundle could have written, altered and hashed again without the key.
        report.problem(
            f"entry {weak[0]} ({ENTRIES}, {len(weak)} such): plain SHA-256, weaker than the HMAC key given, and no"
            " signed entry after it holds it: a bundle downgraded from HMAC-SHA256 by someone without the key, or a"
            " period from before the log was signed (then verify it without the key, and anchor it: plain entries"
            " prove nothing against whoever can rewrite the bundle)"
        )
    if entries and chain.previous != facts.get("head_after"):
        report.problem(
            f"the last entry (entry {last_id}) is not the head after the period that the manifest names"
            f" ({str(facts.get('head_after'))[:12]}…): entries are missing at the end, or were altered"
        )
    if facts.get("entries") != len(entries):
        report.problem(f"{ENTRIES} holds {len(entries)} entries, the manifest says {facts.get('entries')}")
    if entries and (facts.get("first_id"), facts.get("last_id")) != (min(entries), last_id):
        report.problem(
            f"the entries run from {min(entries)} to {last_id}, the manifest says"
            f" {facts.get('first_id')} to {facts.get('last_id')}"
        )
    return entries


def _check_decisions(bundle: Path, entries: dict, report: Report) -> int:
    """Check every decision record against its entry; returns how many records there are."""
    path = bundle / DECISIONS
    if not path.is_file():
        report.problem(f"{DECISIONS}: missing")
        return 0
    recorded, records = set(), 0
    for number, record in _read_jsonl(path, report, DECISIONS):
        records += 1
        entry = record.get("entry") if isinstance(record.get("entry"), dict) else {}
        where = f"{DECISIONS} line {number} (entry {entry.get('id')})"
        if not isinstance(entry.get("id"), int) or entries.get(entry["id"]) != entry:
            report.problem(f"{where}: its entry differs from entry {entry.get('id')} of {ENTRIES}")
            continue
        recorded.add(entry["id"])
        summary = decision_summary(entry)
        changed = sorted(name for name, value in summary.items() if record.get(name) != value)
        if changed:
            report.problem(f"{where}: {', '.join(changed)} differ from what its entry says")
    for id_, entry in entries.items():
        if entry.get("action") in DECISION_ACTIONS and id_ not in recorded:
            report.problem(f"entry {id_} is a decision ({entry.get('action')}) without its record in {DECISIONS}")
    return records


def _check_the_manifests_facts(manifest: dict, entries: dict, decisions: int, report: Report) -> None:
    """What the manifest says of the entries that can be checked against them: the period they fall in, how many
    decisions, how they were signed. (When and by whom it was exported, and the database's head then, are the
    exporter's word: the export's own entry in the live log, after the period, is what confirms them.)"""
    period = manifest.get("period") if isinstance(manifest.get("period"), dict) else {}
    try:
        start, end = datetime.fromisoformat(period["start"]), datetime.fromisoformat(period["end"])
        first, last = date.fromisoformat(period["from"]), date.fromisoformat(period["to"])
    except (KeyError, TypeError, ValueError):
        report.problem(f"{MANIFEST}: its period cannot be read")
        return
    if (start.date(), (end - timedelta(days=1)).date()) != (first, last):
        report.problem(f"{MANIFEST}: its period from {first} to {last} is not its start {start} and end {end}")
    for id_, entry in entries.items():
        try:
            inside = start <= datetime.fromisoformat(str(entry.get("at"))) < end
        except (TypeError, ValueError):
            inside = False
        if not inside:
            report.problem(f"entry {id_}: at {entry.get('at')} is outside the period ({start} to {end})")
            break
    if manifest.get("decisions") != decisions:
        report.problem(f"{DECISIONS} holds {decisions} records, the manifest says {manifest.get('decisions')}")
    signing = manifest.get("signing") if isinstance(manifest.get("signing"), dict) else {}
    schemes: dict = {}
    for entry in entries.values():
        schemes[entry.get("hash_scheme")] = schemes.get(entry.get("hash_scheme"), 0) + 1
    key_ids = sorted({e.get("hmac_key_id") for e in entries.values() if e.get("hash_scheme") == HMAC_SHA256})
    if (signing.get("schemes"), signing.get("hmac_key_ids")) != (schemes, key_ids):
        report.problem(f"{MANIFEST}: its signing (schemes and key ids) is not the entries'")


def _check_files(bundle: Path, manifest: dict, report: Report) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        report.problem(f"{MANIFEST}: lists no files")
        return
    for name in (ENTRIES, DECISIONS):
        if name not in files:
            report.problem(f"{MANIFEST}: does not list {name}")
    for name, expected in sorted(files.items()):
        path = bundle / name
        if Path(name).name != name or name == MANIFEST:
            report.problem(f"{MANIFEST}: lists {name!r}, which a bundle never holds")
        elif not path.is_file():
            report.problem(f"{name}: missing (the manifest lists it)")
        elif file_sha256(path) != expected:
            report.problem(f"{name}: its SHA-256 does not match the manifest (the file was changed)")
    for path in sorted(bundle.iterdir()):
        if path.name not in files and path.name != MANIFEST and not path.name.startswith("."):
            report.notes.append(f"not in the manifest, not checked: {path.name}")


def _key(args) -> bytes | None:
    if args.key_file:
        return Path(args.key_file).read_text(encoding="utf-8").strip().encode()
    if args.key:
        return args.key.encode()
    value = os.environ.get(KEY_VARIABLE, "")
    return value.encode() if value else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="verify.py",
        description="Check an audit export offline: recompute its hash chain and compare its files with the manifest.",
    )
    parser.add_argument(
        "bundle", nargs="?", default=str(Path(__file__).resolve().parent), help="the bundle's directory (default: here)"
    )
    parser.add_argument("--key-file", help="a file holding the HMAC key, for a signed log")
    parser.add_argument(
        "--key",
        help=f"the HMAC key itself (shows in the process list and shell history: prefer ${KEY_VARIABLE} or --key-file)",
    )
    parser.add_argument(
        "--anchor",
        metavar="HASH",
        help="a head recorded outside the bundle (manage.py audit_verify's output when the period was written): fail"
        " unless it is the hash of an entry of the period. Never take it from the bundle: its head_before is refused",
    )
    args = parser.parse_args(argv)
    try:
        key = _key(args)
    except OSError as exc:
        parser.error(f"cannot read the key file: {exc}")
    try:
        report, manifest = verify_bundle(Path(args.bundle), key, anchor=args.anchor)
    except Exception as exc:  # a bundle malformed past what the checks expect: fail closed, and say why
        report, manifest = Report(), {}
        report.problem(f"the bundle cannot be checked: {exc!r}")
    period = manifest.get("period") if isinstance(manifest.get("period"), dict) else {}
    facts = manifest.get("chain") if isinstance(manifest.get("chain"), dict) else {}
    title = f"audit export {period.get('from')} to {period.get('to')}"
    if report.problems:
        print(f"{title}: NOT intact")
        print(f"first difference: {report.problems[0]}")
        for problem in report.problems[1:]:
            print(f"also: {problem}")
        if any("cannot check it" in problem for problem in report.problems):
            print(f"(the log is signed: give the key with ${KEY_VARIABLE} or --key-file)")
        return 1
    print(f"{title}: intact")
    print(
        f"{facts.get('entries')} entries, {facts.get('first_id')} to {facts.get('last_id')};"
        f" chain from {facts.get('head_before')} to {facts.get('head_after')}"
    )
    signing = manifest.get("signing") if isinstance(manifest.get("signing"), dict) else {}
    print(f"signing: {signing.get('summary', 'unknown')}")
    print(f"files: {len(manifest.get('files', {}))} match the manifest")
    if report.anchored:
        print(report.anchored)
    for note in report.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
