"""`manage.py audit_export`: the audit evidence of a period, for an auditor, as a directory or a zip file
(docs/audit-evidence.md)."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from console.audit_bundle import ExportRefused, Period, begin, exporter_name, write_to


class Command(BaseCommand):
    help = (
        "Write the audit evidence of a period (whole days, UTC) for an auditor: its entries as JSON lines, one record"
        " per decision, the chain's head hashes, a manifest and a standard-library verifier (verify.py), to a new"
        " directory or zip file. Audited as audit.export. See docs/audit-evidence.md."
    )

    def add_arguments(self, parser):
        parser.add_argument("--from", dest="first_day", metavar="YYYY-MM-DD", help="the period's first day")
        parser.add_argument("--to", dest="last_day", metavar="YYYY-MM-DD", help="the period's last day (included)")
        parser.add_argument(
            "--out",
            metavar="DIR|FILE.zip",
            help="where to write it: a new directory, or a zip file (default: ./audit-export-FROM-to-TO)",
        )

    def handle(self, *args, first_day=None, last_day=None, out=None, **options):
        # Everything is checked before the export is cut and audited: a refused export writes nothing at all.
        try:
            period = Period.parse(first_day, last_day)
        except ExportRefused as exc:
            raise CommandError(str(exc)) from None
        out = Path(out or period.name)
        partial = out.with_name(f".{out.name}.partial")
        if out.exists() or out.is_symlink():
            raise CommandError(f"{out} exists: an export is written to a new directory or zip file")
        if partial.exists():
            raise CommandError(f"{partial} exists (left by an export that was interrupted?): remove it first")
        if not out.parent.is_dir():
            raise CommandError(f"{out.parent} is not a directory")
        try:
            export = begin(period, by=exporter_name(), via="manage.py audit_export")
        except ExportRefused as exc:
            raise CommandError(str(exc)) from None
        write_to(export, out)
        self.stdout.write(f"audit export {period}: {out}")
        self.stdout.write(f"{export.entries} entries, {export.first_id} to {export.last_id}")
        self.stdout.write(f"head before the period: {export.head_before}")
        self.stdout.write(f"head after the period:  {export.head_after}")
        self.stdout.write(f"database head at export: entry {export.database_head[0]} hash {export.database_head[1]}")
        self.stdout.write(f"audited as entry {export.entry.pk} (audit.export)")
        where = f"unzip {out} and run python3 verify.py in it" if out.suffix.lower() == ".zip" else f"cd {out}"
        self.stdout.write(f"verify: {where}" + ("" if out.suffix.lower() == ".zip" else " && python3 verify.py"))
