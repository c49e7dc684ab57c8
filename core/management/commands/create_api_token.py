"""`manage.py create_api_token USER`: a new API token and the secret that signs its callbacks, each shown once."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from core.models import ApiToken


class Command(BaseCommand):
    help = (
        "Print a new API token for USER on stdout (only its hash is stored), and the secret that signs its "
        "callbacks on stderr (both shown once)."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument(
            "--tenant",
            action="append",
            dest="tenants",
            help="a tenant the token may start runs for (repeat it; '*' for any); default: default",
        )

    def handle(self, *args, username, tenants=None, **options):
        try:
            user = get_user_model().objects.get(username=username, is_active=True)
        except get_user_model().DoesNotExist:
            raise CommandError(f"No active user named {username!r}.") from None
        token, raw = ApiToken.issue(user, by="manage.py create_api_token", tenants=tenants)
        # The token alone on stdout (scripts read it: `TOKEN=$(manage.py create_api_token agent)`); the callback
        # signing secret, also shown only now, beside it on stderr.
        self.stdout.write(raw)
        self.stderr.write(f"callback signing secret (shown once): {token.callback_secret}", style_func=None)
