"""`manage.py demo_setup`: the demo channels and users, with their roles and channel permissions. The users share
DEMO_PASSWORD: outside development it must be one of the operator's own (a stack's demo, compose.yaml), never
the default everyone knows."""

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
    help = "Create the demo channels and users (idempotent; outside development only with a DEMO_PASSWORD of your own)."

    def handle(self, *args, **options):
        if not settings.DEVELOPMENT and settings.DEMO_PASSWORD == "demo":
            raise CommandError(
                "demo_setup creates users with the password DEMO_PASSWORD: outside development, set DEMO_PASSWORD "
                "to a password of your own (the default, 'demo', is everyone's)."
            )
        with transaction.atomic():
            # The role groups (migration console.0002 makes them; a flushed database has lost them) and the
            # channels, each made once: a few statements in all, as every test that takes the demo runs this.
            Group.objects.bulk_create([Group(name=role.value) for role in Role], ignore_conflicts=True)
            Channel.objects.bulk_create(
                [Channel(name=name, description=text) for name, text in DEMO_CHANNELS.items()], ignore_conflicts=True
            )
            channels = list(Channel.objects.filter(name__in=DEMO_CHANNELS))
            groups = {group.name: group for group in Group.objects.all()}
            for username, (roles, superuser, staff, channel_perms) in DEMO_USERS.items():
                user = self._ensure_user(username, superuser, staff)
                user.groups.add(*(groups[role] for role in roles))
                for channel_perm in channel_perms:
                    # guardian's bulk form: the grants the user lacks, in one INSERT.
                    assign_perm(f"core.{channel_perm}", user, channels)
        if options["verbosity"] > 0:
            self.stdout.write("Demo channels: " + ", ".join(DEMO_CHANNELS))
            self.stdout.write("Demo users: " + ", ".join(DEMO_USERS) + " (password: $DEMO_PASSWORD)")

    def _ensure_user(self, username, superuser, staff) -> User:
        user, _ = User.objects.get_or_create(username=username)
        # Only write what differs, so a second run leaves every row as it was.
        if not user.check_password(settings.DEMO_PASSWORD) or (user.is_superuser, user.is_staff) != (superuser, staff):
            user.set_password(settings.DEMO_PASSWORD)
            user.is_superuser, user.is_staff = superuser, staff
            user.save()
        return user
