"""`manage.py audit_verify`: checks the audit log's hash chain and prints its head, to anchor elsewhere."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db.models import Count

from core.models import AuditEntry, HashScheme, audit_hmac_key, audit_key_id


class Command(BaseCommand):
    help = (
        "Check the audit log's hash chain and print its head (entry and hash) to anchor elsewhere; exit non-zero"
        " at the first break. Signed entries are checked with AUDIT_HMAC_KEY."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--anchor",
            metavar="HASH",
            help="a head hash printed by an earlier run: fail unless the chain still holds that entry",
        )

    def handle(self, *args, anchor=None, **options):
        # The head is read first and the check stops there: the head printed is one that was checked, however
        # many entries are appended meanwhile.
        head = AuditEntry.objects.order_by("-id").values_list("id", "hash").first()
        head_id, head_hash = head if head is not None else (0, AuditEntry.GENESIS)
        for entry, problem in AuditEntry.verify_chain(until=head_id):
            raise CommandError(
                f"audit log broken at entry {entry.pk} ({entry.at:%Y-%m-%d %H:%M:%S} "
                f"{entry.action} by {entry.actor}): {problem}"
            )
        checked = AuditEntry.objects.filter(id__lte=head_id)
        schemes = dict(checked.values_list("hash_scheme").annotate(n=Count("id")).order_by())
        self.stdout.write(f"audit log intact: {sum(schemes.values())} entries")
        self.stdout.write(f"head: entry {head_id} hash {head_hash}" if head else f"head: none (genesis {head_hash})")
        self.stdout.write(self._signing(schemes))
        if anchor:
            anchored = checked.filter(hash=anchor.strip().lower()).values_list("id", flat=True).first()
            if anchored is None:
                raise CommandError(
                    f"anchor {anchor} is not in the audit log: entries up to it were removed or rewritten"
                )
            after = checked.filter(id__gt=anchored).count()
            self.stdout.write(f"anchor: entry {anchored}, unchanged, and {after} entries after it")

    @staticmethod
    def _signing(schemes: dict[str, int]) -> str:
        signed, plain = schemes.get(HashScheme.HMAC_SHA256, 0), schemes.get(HashScheme.SHA256, 0)
        key = audit_hmac_key()
        if key is None:
            return f"signing: none (AUDIT_HMAC_KEY is not set): {plain} entries plain SHA-256"
        if not signed:
            return f"signing: AUDIT_HMAC_KEY is set (key {audit_key_id(key)}) but no entry is signed yet"
        # verify_chain refuses a plain entry after a signed one: the plain ones all came before the key, and the
        # first signed entry's HMAC covers the hash of the last of them.
        return f"signing: {signed} entries HMAC-SHA256 with key {audit_key_id(key)}, after {plain} plain SHA-256"
