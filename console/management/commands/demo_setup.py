"""`manage.py demo_setup`: the demo channels and users, with their roles and channel permissions (development
only: the users have a known password)."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import Group, User
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from guardian.shortcuts import assign_perm

from core.models import Channel, Role

DEMO_CHANNELS = {
    "payments": "Refunds and payouts (fake payment system)",
    "email": "Messages to customers (fake mail system)",
    "crm": "Customer records (fake CRM)",
}

# username -> (groups, superuser, staff (Django admin: ops requeue dead letters there), channel permissions). The
# agent may ask for approvals on every channel (external agents: docs/external-agents.md), never act unreviewed.
DEMO_USERS = {
    "admin": ([Role.ADMIN], True, True, ()),
    "reviewer": ([Role.REVIEWER], False, False, ("approve_channel",)),
    "ops": ([Role.OPS], False, True, ("operate_channel",)),
    "outsider": ([], False, False, ()),
    "agent": ([], False, False, ("request_channel",)),
}


class Command(BaseCommand):
    help = "Create the demo channels and users (idempotent; development only)."

    def handle(self, *args, **options):
        if not settings.DEVELOPMENT:
            raise CommandError("demo_setup creates users with a known password: it runs only in development.")
        with transaction.atomic():
            # The role groups (migration console.0002 makes them; a flushed database has lost them).
            for role in Role:
                Group.objects.get_or_create(name=role.value)
            channels = [
                Channel.objects.get_or_create(name=name, defaults={"description": description})[0]
                for name, description in DEMO_CHANNELS.items()
            ]
            for username, (roles, superuser, staff, channel_perms) in DEMO_USERS.items():
                self._ensure_user(username, roles, superuser, staff, channel_perms, channels)
        if options["verbosity"] > 0:
            self.stdout.write("Demo channels: " + ", ".join(DEMO_CHANNELS))
            self.stdout.write("Demo users: " + ", ".join(DEMO_USERS) + " (password: $DEMO_PASSWORD)")

    def _ensure_user(self, username, roles, superuser, staff, channel_perms, channels) -> None:
        user, _ = User.objects.get_or_create(username=username)
        # Only write what differs, so a second run leaves every row as it was.
        if not user.check_password(settings.DEMO_PASSWORD) or (user.is_superuser, user.is_staff) != (superuser, staff):
            user.set_password(settings.DEMO_PASSWORD)
            user.is_superuser, user.is_staff = superuser, staff
            user.save()
        user.groups.add(*Group.objects.filter(name__in=roles))
        for channel_perm in channel_perms:
            for channel in channels:
                assign_perm(f"core.{channel_perm}", user, channel)
