"""`manage.py rotate_callback_secret PREFIX`: a new callback signing secret for a live API token (audited)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from core.models import ApiToken


class Command(BaseCommand):
    help = (
        "Give the live API token whose prefix is PREFIX (as admin lists it) a new callback signing secret, printed "
        "on stdout (shown once; the old secret signs nothing from now on). Audited."
    )

    def add_arguments(self, parser):
        parser.add_argument("prefix", help="the token's first characters after hitl_ (admin's Prefix column)")

    def handle(self, *args, prefix, **options):
        tokens = list(ApiToken.objects.select_related("user").filter(prefix=prefix, revoked_at__isnull=True)[:2])
        if not tokens:
            raise CommandError(f"No live API token with the prefix {prefix!r}.")
        if len(tokens) > 1:
            raise CommandError(f"Several live API tokens have the prefix {prefix!r}: rotate it in Django admin.")
        self.stdout.write(tokens[0].rotate_callback_secret(by="manage.py rotate_callback_secret"))
