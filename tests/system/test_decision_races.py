"""Two reviewers decide the same card at the same moment, through the API, fifty times.

One decision per card (optimistic concurrency on the card's version): exactly one of the two requests
succeeds, the other gets 409; the run resumes once and pays once.

Sizes: RACE_CARDS (50).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from django.conf import settings

from approvals.models import Approval, Decision
from runs.models import Run
from tests.system.conftest import describe_runs, effects_per_run, env_int, jobs_doing, report, sandbox_stats

CARDS = env_int("RACE_CARDS", 50)


def test_two_reviewers_deciding_one_card_at_once_make_one_decision(system):
    run_ids = [
        system.submit(
            {
                "customer_id": f"cus_{3000 + i}",
                "amount_cents": settings.AUTO_APPROVE_CENTS + 100 * i,
                "currency": "EUR",
                "reason": "Item arrived damaged",
            }
        )
        for i in range(CARDS)
    ]
    statuses = system.wait_for_runs(run_ids, timeout=60, until=[Run.Status.WAITING_HUMAN])
    assert statuses == {Run.Status.WAITING_HUMAN: CARDS}, describe_runs(run_ids)
    cards = system.reviewer.get("/api/approvals?status=pending").body
    assert sorted(card["run_id"] for card in cards) == sorted(run_ids)
    # Both reviewers see the same card, at the same version.
    assert {c["id"]: c["version"] for c in system.second_reviewer.get("/api/approvals?status=pending").body} == {
        c["id"]: c["version"] for c in cards
    }

    outcomes: dict[int, dict[str, int]] = {}
    started = time.monotonic()
    for card in cards:
        barrier = threading.Barrier(2)
        results: dict[str, int] = {}

        def decide(api, card=card, barrier=barrier, results=results):
            body = {"decision": "approve", "comment": f"approved by {api.who}", "version": card["version"]}
            barrier.wait(5)
            results[api.who] = api.post(f"/api/approvals/{card['id']}/decision", body).status

        threads = [threading.Thread(target=decide, args=(api,)) for api in (system.reviewer, system.second_reviewer)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        outcomes[card["id"]] = results
    raced = time.monotonic() - started

    statuses = system.wait_for_runs(run_ids, timeout=60)
    stats = sandbox_stats()
    winners = Counter(who for results in outcomes.values() for who, status in results.items() if status == 200)
    report(
        "decision races",
        cards=len(cards),
        outcomes=dict(Counter(tuple(sorted(results.values())) for results in outcomes.values())),
        winners=dict(winners),
        race_seconds=raced,
        statuses=dict(statuses),
        sandbox=stats,
    )

    assert {card_id: sorted(results.values()) for card_id, results in outcomes.items()} == {
        card["id"]: [200, 409] for card in cards
    }
    assert Counter(Decision.objects.filter(approval__run_id__in=run_ids).values_list("approval_id", flat=True)) == {
        card["id"]: 1 for card in cards
    }
    assert set(Approval.objects.filter(run_id__in=run_ids).values_list("status", flat=True)) == {"approved"}
    assert statuses == {Run.Status.SUCCEEDED: CARDS}, describe_runs(
        Run.objects.filter(pk__in=run_ids).exclude(status="succeeded").values_list("pk", flat=True)
    )
    assert set(effects_per_run(run_ids, "payments").values()) == {1}
    assert set(effects_per_run(run_ids, "email").values()) == {1}
    assert stats == {"channels": {"payments": CARDS, "email": CARDS, "crm": CARDS}, "duplicates": 0}
    assert jobs_doing() == []
