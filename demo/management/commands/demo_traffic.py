from __future__ import annotations

import random

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from runs.models import Run

REASONS = [
    "Item arrived damaged",
    "Package was three weeks late",
    "Charged twice for one order",
    "Product not as described",
    "Wrong size delivered",
]


class Command(BaseCommand):
    help = "Submit N demo refund runs through the same code path as POST /api/runs."

    def add_arguments(self, parser):
        parser.add_argument("--runs", type=int, default=5)
        parser.add_argument("--seed", type=int, default=None, help="Repeatable inputs.")
        parser.add_argument("--no-gates", action="store_true", help="Amounts below the auto-approve threshold.")
        parser.add_argument("--tenant", default="default")

    def handle(self, *args, runs, seed, no_gates, tenant, **options):
        if runs < 1:
            raise CommandError("--runs must be at least 1")
        agent = get_user_model().objects.filter(username="agent").first()
        rng = random.Random(seed)
        limit = settings.AUTO_APPROVE_CENTS
        for _ in range(runs):
            amount = (
                rng.randrange(100, limit)
                if no_gates
                else rng.choice([rng.randrange(100, limit), rng.randrange(limit, 80_000)])
            )
            Run.submit(
                workflow="refund",
                input={
                    "customer_id": f"cus_{rng.randrange(1000, 9999)}",
                    "amount_cents": amount,
                    "currency": rng.choice(["EUR", "USD", "GBP"]),
                    "reason": rng.choice(REASONS),
                },
                created_by=agent,
                tenant=tenant,
            )
        if options["verbosity"] > 0:
            self.stdout.write(f"Submitted {runs} refund runs.")
