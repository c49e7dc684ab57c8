from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from console.models import ApiToken


class Command(BaseCommand):
    help = "Print a new API token for USER on stdout (only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("username")

    def handle(self, *args, username, **options):
        try:
            user = get_user_model().objects.get(username=username, is_active=True)
        except get_user_model().DoesNotExist:
            raise CommandError(f"No active user named {username!r}.") from None
        _, raw = ApiToken.issue(user, by="manage.py create_api_token")
        self.stdout.write(raw)
