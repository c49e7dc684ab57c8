"""`manage.py sandbox_stats`: the side effects the demo's fake systems received, per channel, and the duplicates,
as JSON."""

import json

from django.core.management.base import BaseCommand

from demo import sandbox


class Command(BaseCommand):
    help = "Print the side effects the demo's fake systems received, per channel, and the duplicates, as JSON."

    def handle(self, *args, **options):
        self.stdout.write(json.dumps(sandbox.stats()))
