"""Reviewer signals (approvals.reviewers) and their panels on /dashboard/: figures from the decisions recorded, people's
only, over the last 30 days; rubber stamps shown, never enforced."""

from __future__ import annotations

import itertools
import re
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from approvals import reviewers
from approvals.models import Approval, Decision
from runs import submission
from runs.models import Run
from tests.engine_helpers import REFUND, drive

URL = "/dashboard/"
_seq = itertools.count(1)


@pytest.fixture
def now() -> datetime:
    return timezone.now()


def card(channel, opened: datetime, *, status="approved", risk="medium", workflow="refund") -> Approval:
    """A card of `workflow` opened at `opened`, closed as `status` (its decisions are added by `decision`)."""
    run = Run.objects.create(workflow=workflow, workflow_version=1, input={}, status=Run.Status.WAITING_HUMAN)
    closed = status not in Approval.OPEN
    approval = Approval.objects.create(
        run=run,
        step_seq=next(_seq),
        channel=channel,
        proposed={"to": "x"},
        risk=risk,
        status=status,
        args_hash="x",
        due_at=opened + timedelta(hours=1),
        decided_at=opened + timedelta(minutes=10) if closed else None,
    )
    Approval.objects.filter(pk=approval.pk).update(created_at=opened)
    return approval


def decision(approval: Approval, actor, kind: str, at: datetime, *, stage: int | None = None) -> Decision:
    """`actor`'s decision (None: the system's) taken at `at`; it also dates the card's close, as the last one."""
    made = Decision.objects.create(
        approval=approval, actor=actor, decision=kind, comment="no" if kind == "reject" else "", stage=stage
    )
    Decision.objects.filter(pk=made.pk).update(created_at=at)
    Approval.objects.filter(pk=approval.pk, decided_at__isnull=False).update(decided_at=at)
    return made


def decided(channel, actor, kind: str, seconds: float, opened: datetime, **card_options) -> Approval:
    """A card one person closed with `kind`, `seconds` after it opened."""
    status = {"approve": "approved", "edit": "edited", "reject": "rejected"}[kind]
    approval = card(channel, opened, status=status, **card_options)
    decision(approval, actor, kind, opened + timedelta(seconds=seconds))
    return approval


def row(signals, reviewer: str, risk: str) -> reviewers.ReviewerRisk:
    return next(r for r in signals.reviewers if (r.reviewer, r.risk) == (reviewer, risk))


def test_it_computes_time_to_decide_and_the_rates_per_reviewer_and_risk(payments, bob, carol, now):
    opened = now - timedelta(days=1)
    for kind, seconds in [("approve", 10), ("approve", 20), ("edit", 30), ("reject", 40), ("approve", 100)]:
        decided(payments, bob, kind, seconds, opened)
    decided(payments, bob, "approve", 50, opened, risk="low")
    decided(payments, carol, "approve", 7, opened)

    signals = reviewers.signals(now)

    assert [(r.reviewer, r.risk) for r in signals.reviewers] == [("bob", "low"), ("bob", "medium"), ("carol", "medium")]
    medium = row(signals, "bob", "medium")
    assert (medium.decisions, medium.approved, medium.edits, medium.rejections) == (5, 3, 1, 1)
    assert medium.median_seconds == 30
    assert medium.p90_seconds == pytest.approx(76)  # 40 + 0.6 * (100 - 40), interpolated
    assert medium.approval_rate == pytest.approx(0.6)
    assert medium.rubber_stamps == 0  # quick approvals of medium-risk cards are no signal
    assert row(signals, "bob", "low").median_seconds == 50
    assert row(signals, "carol", "medium").rubber_stamps == 0


def test_rubber_stamps_are_plain_approvals_of_high_risk_cards_under_the_threshold(payments, bob, now, settings):
    settings.RUBBER_STAMP_SECONDS = 10
    opened = now - timedelta(hours=2)
    for kind, seconds in [("approve", 5), ("approve", 9.5), ("approve", 10), ("edit", 3), ("reject", 2)]:
        decided(payments, bob, kind, seconds, opened, risk="high")
    decided(payments, bob, "approve", 1, opened, risk="low")

    signals = reviewers.signals(now)

    assert row(signals, "bob", "high").rubber_stamps == 2  # 5 s and 9.5 s; not 10 s, not the edit, not the reject
    assert row(signals, "bob", "low").rubber_stamps == 0
    assert signals.rubber_stamps == 2 and signals.rubber_stamp_seconds == 10

    settings.RUBBER_STAMP_SECONDS = 3
    assert reviewers.signals(now).rubber_stamps == 0


def test_per_workflow_the_share_approved_unchanged(payments, bob, carol, now):
    opened = now - timedelta(days=2)
    for kind in ["approve", "approve", "approve", "edit"]:
        decided(payments, bob, kind, 60, opened, workflow="refund")
    decided(payments, carol, "reject", 60, opened, workflow="email")
    decided(payments, carol, "approve", 60, opened, workflow="email")

    signals = reviewers.signals(now)

    shares = [(w.workflow, w.cards, w.unchanged, w.edited, w.rejected) for w in signals.workflows]
    assert shares == [("refund", 4, 3, 1, 0), ("email", 2, 1, 0, 1)]  # the likeliest candidate first
    assert signals.workflows[0].unchanged_share == pytest.approx(0.75)
    assert signals.workflows[1].unchanged_share == pytest.approx(0.5)


def test_cards_decided_by_nobody_are_left_out(payments, bob, now):
    opened = now - timedelta(hours=5)
    decided(payments, bob, "approve", 60, opened)
    card(payments, opened, status="expired")
    card(payments, opened, status="cancelled")
    card(payments, opened, status="pending")
    # An SLA's safe default: the system's decision (no actor) closes the card.
    decision(card(payments, opened, status="rejected", risk="high"), None, "reject", opened + timedelta(seconds=1))
    # A first person approved, then the SLA's default closed it: not a card closed by people.
    half = card(payments, opened, status="approved", workflow="half")
    decision(half, bob, "approve", opened + timedelta(seconds=30))
    decision(half, None, "approve", opened + timedelta(minutes=30))

    signals = reviewers.signals(now)

    assert [(r.reviewer, r.risk, r.decisions) for r in signals.reviewers] == [("bob", "medium", 2)]
    assert [(w.workflow, w.cards) for w in signals.workflows] == [("refund", 1)]


def test_the_window_is_respected(payments, bob, now):
    decided(payments, bob, "approve", 60, now - timedelta(days=29))
    decided(payments, bob, "reject", 60, now - timedelta(days=31))

    signals = reviewers.signals(now)

    assert row(signals, "bob", "medium").decisions == 1
    assert [(w.workflow, w.cards, w.unchanged) for w in signals.workflows] == [("refund", 1, 1)]
    week = reviewers.signals(now, window=timedelta(days=7))
    assert week.reviewers == [] and week.workflows == []


def test_a_quorum_card_counts_each_persons_decision_timed_from_their_stage(payments, alice, bob, carol, now):
    """Stage 0 asks two people (quorum), stage 1 one: each decision is timed from when the card reached its stage."""
    opened = now - timedelta(hours=3)
    quorum = card(payments, opened, status="approved", risk="high")
    decision(quorum, bob, "approve", opened + timedelta(seconds=60), stage=0)
    decision(quorum, carol, "approve", opened + timedelta(seconds=90), stage=0)  # this one moved it to stage 1
    decision(quorum, alice, "approve", opened + timedelta(seconds=95), stage=1)

    signals = reviewers.signals(now)

    times = {r.reviewer: (r.decisions, r.median_seconds, r.rubber_stamps) for r in signals.reviewers}
    assert times == {"bob": (1, 60, 0), "carol": (1, 90, 0), "alice": (1, 5, 1)}  # 5 s after it reached her
    assert [(w.workflow, w.cards, w.unchanged) for w in signals.workflows] == [("refund", 1, 1)]  # the card once


def test_a_decision_through_approval_decide_is_counted(demo, now):
    """The real door: what Approval.decide records is what the signals read."""
    drive(submission.submit(workflow="refund", input=REFUND)[0])
    approval = Approval.objects.get()
    approval.decide(demo["reviewer"], "approve", version=approval.version)

    signals = reviewers.signals()

    assert [(r.reviewer, r.risk, r.decisions, r.approved) for r in signals.reviewers] == [
        ("reviewer", approval.risk, 1, 1)
    ]
    assert [(w.workflow, w.cards, w.unchanged) for w in signals.workflows] == [("refund", 1, 1)]


def test_the_panels_render_for_who_sees_the_dashboard(client, payments, bob, carol, now, settings):
    settings.RUBBER_STAMP_SECONDS = 10
    decided(payments, bob, "approve", 4, now - timedelta(hours=1), risk="high")
    client.force_login(carol)

    body = client.get(URL).content.decode()

    assert 'id="reviewers"' in body and 'id="rule-candidates"' in body
    assert 'data-reviewer="bob:high"' in body
    assert '<span class="dash-state warn">1</span>' in body  # the rubber stamp, highlighted
    assert "never enforced" in body and "less than 10 s" in body
    assert re.search(r'data-workflow="refund"><td>refund</td><td>1</td>\s*<td class="dash-rate">100%</td>', body)


def test_the_figures_poll_does_not_read_the_signals(client, payments, bob, carol, now):
    decided(payments, bob, "approve", 4, now - timedelta(hours=1))
    client.force_login(carol)

    body = client.get(URL, headers={"HX-Request": "true"}).content.decode()

    assert 'id="reviewers"' not in body and "data-reviewer" not in body


@pytest.mark.parametrize("user", ["bob", "dave"])
def test_the_panels_are_refused_to_who_may_not_see_the_dashboard(client, request, payments, bob, now, user):
    decided(payments, bob, "approve", 4, now - timedelta(hours=1))
    client.force_login(request.getfixturevalue(user))

    response = client.get(URL)

    assert response.status_code == 404 and b"data-reviewer" not in response.content
