"""`manage.py erase_subject <subject>`: erase a data subject's personal data (runs.erasure, docs/personal-data.md)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from runs.erasure import UnknownSubject, erase_subject


class Command(BaseCommand):
    help = (
        "Erase a data subject (the value of a schema's x-pii-subject, e.g. a customer id): destroy their key, so that "
        "every personal value of theirs becomes unreadable everywhere at once, and cancel their runs in flight. "
        "Audited. Exits non-zero for a subject nothing is known of."
    )

    def add_arguments(self, parser):
        parser.add_argument("subject", help="the subject, as the x-pii-subject field holds it (e.g. cus_1234)")
        parser.add_argument("--reason", default="", help="why (a request under GDPR art. 17, ...): audited")
        parser.add_argument("--by", default="erase_subject", help="who asks (recorded as the audit entry's actor)")

    def handle(self, *args, subject, reason, by, **options):
        try:
            done = erase_subject(subject, by=by, reason=reason)
        except UnknownSubject as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(done.describe())
