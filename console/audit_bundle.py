"""An audit export: the evidence of a period for an auditor, as a self-contained bundle (docs/audit-evidence.md).

`manage.py audit_export` writes it to a directory or a zip file; the audit page's button streams the same zip.
The bundle holds the period's audit entries exactly as hashed (entries.jsonl), one evidence record per decision
(decisions.jsonl, approvals.evidence), the standard-library verifier (verify.py, a copy of core/audit_verifier.py),
a README, and last the manifest (manifest.json): the period, the chain's head hash before and after it, the
database's head when the export was cut, the exporter, the hash scheme and the SHA-256 of every other file.

An export is cut at the head it reads first and audited (`audit.export`) before a byte is written: entries appended
while it is written are not in it, and its own entry comes after the head it names.
"""

from __future__ import annotations

import getpass
import hashlib
import io
import json
import re
import shutil
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from pathlib import Path
from typing import IO

from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.db.models import Count, Max, Min, QuerySet
from django.utils import timezone

from approvals import evidence
from core import audit_verifier
from core.audit_verifier import DECISION_ACTIONS, DECISIONS, ENTRIES, MANIFEST
from core.models import AuditEntry, HashScheme

VERIFIER = "verify.py"
README = "README.txt"
FORMAT = "hitl-console audit export, version 1"
ENTRY_CHUNK = 2000
DECISION_CHUNK = 500

_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")


class ExportRefused(ValueError):
    """The export was not made, and nothing was written: a bad period, or nothing in it."""


@dataclass(frozen=True)
class Period:
    """Whole days, both included, in the console's time zone (UTC, as the audit page shows times)."""

    first_day: date
    last_day: date

    @classmethod
    def parse(cls, first: str | None, last: str | None, *, names: tuple[str, str] = ("--from", "--to")) -> Period:
        """The period from its first and last days as typed (YYYY-MM-DD); `names` are how errors call them."""
        period = cls(_day(names[0], first), _day(names[1], last))
        if period.first_day > period.last_day:
            raise ExportRefused(f"{names[0]} ({period.first_day}) is after {names[1]} ({period.last_day})")
        return period

    @property
    def start(self) -> datetime:
        return timezone.make_aware(datetime.combine(self.first_day, time.min), timezone.get_default_timezone())

    @property
    def end(self) -> datetime:
        """The first moment after the period."""
        return timezone.make_aware(
            datetime.combine(self.last_day + timedelta(days=1), time.min), timezone.get_default_timezone()
        )

    @property
    def name(self) -> str:
        return f"audit-export-{self.first_day}-to-{self.last_day}"

    def __str__(self) -> str:
        return f"{self.first_day} to {self.last_day} ({timezone.get_default_timezone_name()})"


def _day(option: str, text: str | None) -> date:
    text = (text or "").strip()
    if not text:
        raise ExportRefused(f"{option} is required (a date, YYYY-MM-DD)")
    try:
        if not _DAY.fullmatch(text):
            raise ValueError
        return date.fromisoformat(text)
    except ValueError:
        raise ExportRefused(f"{option}: {text[:40]!r} is not a date (YYYY-MM-DD)") from None


@dataclass(frozen=True)
class Export:
    """An export cut and audited, ready to be written (`write`)."""

    period: Period
    first_id: int
    last_id: int
    entries: int
    head_before: str
    head_after: str
    database_head: tuple[int, str]
    exported_at: datetime
    exported_by: str
    via: str
    entry: AuditEntry  # this export's own audit entry

    def queryset(self) -> QuerySet[AuditEntry]:
        return _in_period(self.period).filter(id__gte=self.first_id, id__lte=self.last_id)


def _in_period(period: Period) -> QuerySet[AuditEntry]:
    return AuditEntry.objects.filter(at__gte=period.start, at__lt=period.end)


def begin(period: Period, *, by, via: str) -> Export:
    """Cut the export at the log's head and audit it (`by`: the user, or a component's name). ExportRefused, with
    nothing written, when the period holds no entry up to the head."""
    head = AuditEntry.objects.order_by("-id").values_list("id", "hash").first()
    span = (
        _in_period(period)
        .filter(id__lte=head[0] if head else 0)
        .aggregate(first=Min("id"), last=Max("id"), entries=Count("id"))
    )
    if not span["entries"]:
        raise ExportRefused(f"no audit entries from {period}: nothing to export")
    first = AuditEntry.objects.values_list("prev_hash", flat=True).get(pk=span["first"])
    last = AuditEntry.objects.values_list("hash", flat=True).get(pk=span["last"])
    with transaction.atomic():
        entry = AuditEntry.record(
            "audit.export",
            actor=by,
            target=f"audit:{period.first_day}..{period.last_day}",
            data={
                "from": str(period.first_day),
                "to": str(period.last_day),
                "via": via,
                "entries": span["entries"],
                "first_id": span["first"],
                "last_id": span["last"],
                "head_before": first,
                "head_after": last,
                "database_head": {"id": head[0], "hash": head[1]},
            },
        )
    return Export(
        period=period,
        first_id=span["first"],
        last_id=span["last"],
        entries=span["entries"],
        head_before=first,
        head_after=last,
        database_head=head,
        exported_at=entry.at,
        exported_by=entry.actor,
        via=via,
        entry=entry,
    )


def write(export: Export, open_file: Callable[[str], AbstractContextManager[IO[bytes]]]) -> Iterator[None]:
    """Write the bundle's files through `open_file(name)` (a directory's or a zip's), the manifest last; yields
    after each piece written, so that a streamed response sends it at once."""
    files: dict[str, str] = {}
    decisions = _Counter()
    pieces: list[tuple[str, Iterable[bytes]]] = [
        (ENTRIES, _entry_lines(export)),
        (DECISIONS, decisions.count(_decision_lines(export))),
        (VERIFIER, [Path(audit_verifier.__file__).read_bytes()]),
        (README, [_readme(export).encode()]),
    ]
    for name, chunks in pieces:
        digest = hashlib.sha256()
        with open_file(name) as out:
            for chunk in chunks:
                digest.update(chunk)
                out.write(chunk)
                yield
        files[name] = digest.hexdigest()
    with open_file(MANIFEST) as out:
        out.write(_manifest(export, files, decisions.n))
    yield


class _Counter:
    n = 0

    def count(self, lines: Iterable[tuple[int, bytes]]) -> Iterator[bytes]:
        for n, chunk in lines:
            self.n += n
            yield chunk


class _Encoder(DjangoJSONEncoder):
    """Django's encoder, with times to the microsecond (it cuts them to milliseconds): evidence keeps them whole."""

    def default(self, o):
        if isinstance(o, datetime):
            return o.isoformat()
        return super().default(o)


def _line(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False, cls=_Encoder) + "\n"


def _chunks(entries: QuerySet[AuditEntry], size: int) -> Iterator[list[AuditEntry]]:
    """The entries in id order, a query per chunk (keyset: no long-lived cursor or transaction)."""
    after = 0
    while rows := list(entries.filter(id__gt=after).order_by("id")[:size]):
        yield rows
        after = rows[-1].pk


def _entry_lines(export: Export) -> Iterator[bytes]:
    for chunk in _chunks(export.queryset(), ENTRY_CHUNK):
        # Exactly the fields the hash sees (AuditEntry.hashed_fields), with the entry's id and hash.
        yield "".join(_line({"id": e.pk, "hash": e.hash, **e.hashed_fields()}) for e in chunk).encode()


def _decision_lines(export: Export) -> Iterator[tuple[int, bytes]]:
    for chunk in _chunks(export.queryset().filter(action__in=DECISION_ACTIONS), DECISION_CHUNK):
        records = evidence.records(chunk)
        yield len(records), "".join(_line(record) for record in records).encode()


def _signing(export: Export) -> dict:
    schemes = dict(export.queryset().values_list("hash_scheme").annotate(n=Count("id")).order_by())
    key_ids = sorted(
        export.queryset()
        .filter(hash_scheme=HashScheme.HMAC_SHA256)
        .values_list("hmac_key_id", flat=True)
        .distinct()
        .order_by()
    )
    signed, plain = schemes.get(HashScheme.HMAC_SHA256, 0), schemes.get(HashScheme.SHA256, 0)
    if not signed:
        summary = (
            f"{plain} entries plain SHA-256: anyone who can write to the database could recompute them; compare the"
            " head after the period with one recorded elsewhere"
        )
    else:
        summary = (
            f"{signed} entries HMAC-SHA256 with key {', '.join(key_ids)}"
            + (f", after {plain} plain SHA-256" if plain else "")
            + ": the verifier needs the key (AUDIT_HMAC_KEY or --key-file), which is not in the bundle"
        )
    return {"schemes": schemes, "hmac_key_ids": key_ids, "summary": summary}


def _manifest(export: Export, files: dict[str, str], decisions: int) -> bytes:
    period = export.period
    manifest = {
        "format": FORMAT,
        "period": {
            "from": str(period.first_day),
            "to": str(period.last_day),
            "start": period.start,
            "end": period.end,
            "end_is": "exclusive",
            "time_zone": timezone.get_default_timezone_name(),
        },
        "exported": {"at": export.exported_at, "by": export.exported_by, "via": export.via},
        "chain": {
            "entries": export.entries,
            "first_id": export.first_id,
            "last_id": export.last_id,
            "head_before": export.head_before,
            "head_after": export.head_after,
        },
        "database_head": {"id": export.database_head[0], "hash": export.database_head[1]},
        "export_entry": {"id": export.entry.pk, "hash": export.entry.hash},
        "decisions": decisions,
        "signing": _signing(export),
        "files": files,
        "verify": f"python3 {VERIFIER} (in this directory; with AUDIT_HMAC_KEY set, or --key-file, for a signed log)",
    }
    return (json.dumps(manifest, indent=2, ensure_ascii=False, cls=_Encoder) + "\n").encode()


def _readme(export: Export) -> str:
    return f"""Audit export of the HITL approval console: {export.period}
Exported {export.exported_at.isoformat()} by {export.exported_by} ({export.via}).

{ENTRIES}     the period's {export.entries} audit entries, one JSON object a line, exactly the fields their
                  hash covers, with each entry's id and hash.
{DECISIONS}   one evidence record per decision of the period: what was proposed, what the person was
                  shown, what they decided, when and by whom, and what then executed. Its `entry` and the
                  fields beside it come from the audit entry (proven by the chain); its `database` part was read
                  from the console's database at export time (only as trustworthy as that database).
{VERIFIER}         the offline verifier (Python 3.8 or later, standard library only).
{MANIFEST}     the period, the chain's head before and after it, the database's head at export time, the
                  hash scheme, and the SHA-256 of every other file.

Check it:   python3 {VERIFIER}
            (for a log signed with HMAC-SHA256: AUDIT_HMAC_KEY=... python3 {VERIFIER}, or --key-file FILE)
            (and --anchor HASH: a head recorded outside this bundle, of an entry of the period; never one of
            this bundle's own values, which whoever rewrites the bundle rewrites too)
It prints "intact" (exit 0), or the first entry that differs and every file that does not match (exit 1).

What it proves, and what it does not: docs/audit-evidence.md of the console's source.
"""


# --- where the bundle goes ----------------------------------------------------------------------------------------


def _zip_member(archive: zipfile.ZipFile, folder: str) -> Callable[[str], AbstractContextManager[IO[bytes]]]:
    def open_file(name: str):
        info = zipfile.ZipInfo(f"{folder}/{name}", date_time=timezone.now().timetuple()[:6])
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = 0o644 << 16
        # The size is not known in advance: ZIP64 fields, so that a file past 2 GiB is still written correctly.
        return archive.open(info, "w", force_zip64=True)

    return open_file


class _Pipe(io.RawIOBase):
    """A write-only stream whose bytes are taken out as they come (zipfile writes to it without seeking)."""

    def __init__(self):
        self._pieces: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._pieces.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self._pieces = b"".join(self._pieces), []
        return data


def zip_stream(export: Export) -> Iterator[bytes]:
    """The bundle as a zip, a piece at a time (the audit page's download)."""
    pipe = _Pipe()
    with zipfile.ZipFile(pipe, "w") as archive:
        for _ in write(export, _zip_member(archive, export.period.name)):
            if data := pipe.take():
                yield data
    yield pipe.take()  # the central directory


def write_to(export: Export, out: Path) -> None:
    """The bundle as a directory `out`, or a zip file when `out` ends in .zip; written beside it under a
    temporary name and renamed at the end, so that `out` appears whole or not at all."""
    partial = out.with_name(f".{out.name}.partial")
    try:
        if out.suffix.lower() == ".zip":
            with partial.open("xb") as stream, zipfile.ZipFile(stream, "w") as archive:
                for _ in write(export, _zip_member(archive, out.stem)):
                    pass
        else:
            partial.mkdir()
            for _ in write(export, lambda name: (partial / name).open("xb")):
                pass
        partial.rename(out)
    except BaseException:
        if partial.is_dir():
            shutil.rmtree(partial)
        else:
            partial.unlink(missing_ok=True)
        raise


def exporter_name() -> str:
    """How a command-line export names its exporter: the command, and who ran it on this machine."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"manage.py audit_export (os user {user})"
