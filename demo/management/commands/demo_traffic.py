"""`manage.py demo_traffic`: submits N demo runs (refund, support_agent, or both) through the code path of
POST /api/runs."""

from __future__ import annotations

import random

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from runs import submission

WORKFLOWS = ("refund", "support_agent", "all")

MESSAGES = [  # support_agent: what customers write ({amount}: a partial refund they ask for)
    "My order arrived damaged. Please refund {amount}.",
    "The package never arrived and tracking has not moved in two weeks. I want my money back.",
    "I was charged twice for one order, please refund {amount}.",
    "The jacket is not as described (wrong colour). Can I get a refund?",
    "Delivery was ten days late, I would like {amount} back for the shipping.",
]

REASONS = [
    "Item arrived damaged",
    "Package was three weeks late",
    "Charged twice for one order",
    "Product not as described",
    "Wrong size delivered",
]


class Command(BaseCommand):
    help = (
        "Submit N demo runs (refund, support_agent, or all: both in turn) through the same code path as POST /api/runs."
    )

    def add_arguments(self, parser):
        parser.add_argument("--runs", type=int, default=5)
        parser.add_argument("--seed", type=int, default=None, help="Repeatable inputs.")
        parser.add_argument("--no-gates", action="store_true", help="Amounts below the auto-approve threshold.")
        parser.add_argument("--tenant", default="default")
        parser.add_argument(
            "--workflow",
            choices=WORKFLOWS,
            default="refund",
            help="support_agent runs always ask for the email; --no-gates keeps their refunds below the threshold.",
        )

    def handle(self, *args, runs, seed, no_gates, tenant, workflow="refund", **options):
        if runs < 1:
            raise CommandError("--runs must be at least 1")
        agent = get_user_model().objects.filter(username="agent").first()
        rng = random.Random(seed)
        limit = settings.AUTO_APPROVE_CENTS
        for i in range(runs):
            name = workflow if workflow != "all" else WORKFLOWS[i % 2]
            amount = (
                rng.randrange(100, limit)
                if no_gates
                else rng.choice([rng.randrange(100, limit), rng.randrange(limit, 80_000)])
            )
            customer_id = f"cus_{rng.randrange(1000, 9999)}"
            if name == "refund":
                run_input = {
                    "customer_id": customer_id,
                    "amount_cents": amount,
                    "currency": rng.choice(["EUR", "USD", "GBP"]),
                    "reason": rng.choice(REASONS),
                }
            else:
                message = rng.choice(MESSAGES if not no_gates else [m for m in MESSAGES if "{amount}" in m])
                run_input = {"customer_id": customer_id, "message": message.format(amount=f"{amount / 100:.2f}")}
                if rng.random() < 0.5:  # some customers name the order
                    run_input["order_id"] = f"ord_{customer_id[-4:]}{rng.randrange(1, 3)}"
            submission.submit(workflow=name, input=run_input, created_by=agent, tenant=tenant)
        if options["verbosity"] > 0:
            self.stdout.write(f"Submitted {runs} {'demo' if workflow == 'all' else workflow} runs.")
