"""The inbox's counts kept by the cards' writes (issue 30): approvals.models.InboxCount, its triggers (migration
0016) and approvals.inbox.Inbox.facets.

The counts are checked against the grouped query the inbox ran before (every open card the user may decide,
grouped by channel, risk, workflow and SLA state, each facet counted under the other facets' filters), for several
users and filters, on cards that differ in all that matters (who started the run, whom the stage asks, who covers
for whom, who decided already, due when), after each kind of write: decisions, expiry, escalation, reassignment,
a risk changed by raw SQL, deletions, bulk inserts."""

from __future__ import annotations

import itertools
import threading
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection, connections
from django.db.migrations.executor import MigrationExecutor
from django.db.models import Count as SqlCount
from django.db.models import Sum
from django.utils import timezone
from guardian.shortcuts import assign_perm

from approvals import inbox
from approvals.inbox import FACETS, SLA_STATES, Inbox, approvable_channels, open_cards_for
from approvals.models import Approval, Decision, Delegation, InboxCount
from approvals.rules import sla_state_expression
from core.models import Channel
from runs.models import Run
from tests.integration.approvals.test_inbox import HTMX_COUNTS, _queries, card, facet_count


def reference(box: Inbox) -> tuple[dict, int, int]:
    """The counts as the inbox computed them before issue 30: one grouped query over every open card."""
    groups = list(
        open_cards_for(box.user, box.channels)
        .annotate(sla=sla_state_expression(box.channels, box.now))
        .values("channel__name", "risk", "workflow", "sla")
        .annotate(n=SqlCount("*"))
        .order_by()
    )
    for group in groups:
        group["channel"] = group.pop("channel__name")

    def matches(group, but=None):
        return all(group[f] == v for f, v in box.filters.items() if f != but)

    counts = {facet: {} for facet in FACETS}
    for facet in FACETS:
        for group in groups:
            if matches(group, but=facet):
                counts[facet][group[facet]] = counts[facet].get(group[facet], 0) + group["n"]
    return counts, sum(g["n"] for g in groups if matches(g)), sum(g["n"] for g in groups)


def kept(box: Inbox) -> tuple[dict, int, int]:
    facets, matching, total = box.facets()
    assert not matching.more and not any(v.count.more for values in facets.values() for v in values)
    counts = {facet: {v.value: v.count.n for v in values if v.count.n} for facet, values in facets.items()}
    return counts, matching.n, total


FILTERS = [
    {},
    {"channel": "payments"},
    {"risk": "high"},
    {"workflow": "dunning"},
    {"sla": "breached"},
    {"sla": "due_soon"},
    {"sla": "on_time"},
    {"channel": "email", "risk": "low"},
    {"channel": "payments", "sla": "on_time", "workflow": "refund"},
    {"risk": "medium", "sla": "breached", "workflow": "kyc"},
]


def assert_counts_match(users) -> None:
    now = timezone.now()
    for user in users:
        channels = approvable_channels(user)
        for filters in FILTERS:
            if filters.get("channel", channels[0].name) not in {c.name for c in channels}:
                continue  # not a filter they are offered (Inbox.from_request drops it)
            box = Inbox(user, channels, filters, None, now)
            assert kept(box) == reference(box), (user.username, filters)
    assert_kept_equals_rebuild()


def assert_kept_equals_rebuild() -> None:
    """The rows the triggers added sum, per key, to what the migration's rebuild computes from the cards."""
    by_key = {
        tuple(tuple(v) if isinstance(v, list) else v for v in (r[k] for k in InboxCount.KEY)): r["n"]
        for r in InboxCount.objects.values(*InboxCount.KEY).annotate(n=Sum("n")).order_by()
        if r["n"]
    }
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {', '.join(InboxCount.KEY)}, count(*) FROM (SELECT *, approvals_card_deciders(id) AS deciders"
            " FROM approvals_approval WHERE status IN ('pending', 'escalated')) AS open"
            f" GROUP BY {', '.join(InboxCount.KEY)}"
        )
        rebuilt = {tuple(tuple(v) if isinstance(v, list) else v for v in row[:-1]): row[-1] for row in cursor}
    assert by_key == rebuilt


@pytest.fixture
def world(alice, bob):
    """Three channels; bob approves all three, erin email, rita payments through her group; varied cards."""
    payments = Channel.objects.create(name="payments", sla=timedelta(hours=4))
    email = Channel.objects.create(name="email", sla=timedelta(minutes=10))
    crm = Channel.objects.create(name="crm", sla=timedelta(hours=1), required_approvals=2)
    erin = User.objects.create_user("erin")
    rita = User.objects.create_user("rita")
    finance = Group.objects.create(name="finance")
    rita.groups.add(finance)
    for channel in (payments, email, crm):
        assign_perm("core.approve_channel", bob, channel)
    assign_perm("core.approve_channel", erin, email)
    assign_perm("core.approve_channel", erin, crm)
    assign_perm("core.approve_channel", finance, payments)
    # Bob covers for erin: the cards that ask erin (on channels erin approves) are his to decide too.
    Delegation.objects.create(user=erin, cover=bob, until=timezone.now() + timedelta(hours=2))
    cards = []
    combos = itertools.product(
        [payments, email, crm],
        ["low", "medium", "high"],
        ["refund", "dunning", "kyc"],
        [timedelta(minutes=-5), timedelta(minutes=3), timedelta(hours=3)],
    )
    for i, (channel, risk, workflow, due_in) in enumerate(itertools.islice(combos, 0, None, 2)):
        c = card(channel, risk=risk, workflow=workflow, due_in=due_in, created_by=bob if i % 7 == 0 else None)
        if i % 5 == 1:  # a policy's stage that asks erin only
            Approval.objects.filter(pk=c.pk).update(asked_anyone=False, asked_users=[erin.pk])
        elif i % 5 == 2:  # one that asks the finance group
            Approval.objects.filter(pk=c.pk).update(asked_anyone=False, asked_groups=[finance.pk])
        if i % 6 == 3:
            Approval.objects.filter(pk=c.pk).update(status="escalated")
        cards.append(c)
    # Decisions that leave cards open (the two-person rule): their deciders no longer count them.
    for c in cards[::4]:
        Decision.objects.create(approval=c, actor=bob, decision="approve")
    for c in cards[1::9]:
        Decision.objects.create(approval=c, actor=erin, decision="approve")
    card(payments, status="approved")  # closed cards count nowhere
    card(email, status="rejected")
    return {"users": [alice, bob, erin, rita], "cards": cards, "bob": bob, "erin": erin, "finance": finance}


def test_the_kept_counts_are_the_grouped_querys(world):
    assert_counts_match(world["users"])


def test_they_stay_so_after_every_kind_of_write(world):
    cards, bob, erin = world["cards"], world["bob"], world["erin"]
    now = timezone.now()
    # A decision that closes a card (payments needs one approval), through the one door.
    open_payment = next(
        c
        for c in cards
        if c.channel.name == "payments" and c.due_at > now + timedelta(minutes=30) and c.run.created_by is None
    )
    open_payment.decide(erin if False else User.objects.get(username="alice"), "approve")
    # Expiry, escalation to a group, reassignment to a person, a risk changed by raw SQL.
    Approval.objects.filter(pk=cards[2].pk).update(status="expired", decided_at=now)
    Approval.objects.filter(pk=cards[5].pk).update(status="escalated", asked_anyone=False, asked_groups=[7, 8])
    Approval.objects.filter(pk=cards[6].pk).update(asked_anyone=False, asked_users=[bob.pk])
    with connection.cursor() as cursor:
        cursor.execute("UPDATE approvals_approval SET risk = 'low' WHERE id = ANY(%s)", [[c.pk for c in cards[10:20]]])
        # A bulk insert of open cards (as bench/inbox.py fills its database), copied from open ones.
        cursor.execute(
            "INSERT INTO approvals_approval (run_id, workflow, run_created_by_id, step_seq, kind, channel_id,"
            " proposed, current, summary, headline, amount_minor, currency, rule_id, confidence, citations, risk,"
            " status, shadow, args_hash, version, due_at, expires_at, on_expiry, assigned_group_id, policy, stage,"
            " asked_anyone, asked_users, asked_groups, created_at, decided_at, trace_parent)"
            " SELECT run_id, workflow, run_created_by_id, step_seq + 100000, kind, channel_id, proposed, current,"
            " summary, headline, amount_minor, currency, rule_id, confidence, citations, risk, status, shadow,"
            " args_hash, version, due_at, expires_at, on_expiry, assigned_group_id, policy, stage, asked_anyone,"
            " asked_users, asked_groups, created_at, decided_at, trace_parent FROM approvals_approval"
            " WHERE status IN ('pending', 'escalated') AND id % 3 = 0"
        )
    assert_counts_match(world["users"])
    # A decision deleted (by raw SQL), and a card deleted with its decisions, as Django deletes them.
    Decision.objects.filter(approval=cards[4]).delete()
    Approval.objects.get(pk=cards[8].pk).delete()
    # A second decision by the same person changes nothing; a first one by another moves the card.
    Decision.objects.create(approval=cards[0], actor=bob, decision="edit", payload={})
    Decision.objects.create(approval=cards[0], actor=erin, decision="approve")
    assert_counts_match(world["users"])
    # Folded into one row per key: the same counts.
    rows = InboxCount.objects.count()
    assert InboxCount.compact() < rows
    assert InboxCount.compact() == InboxCount.objects.count()
    assert_counts_match(world["users"])


def test_a_truncate_of_the_cards_rebuilds_the_counts(world):
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # the test's transaction has deferred FK checks pending
        cursor.execute("TRUNCATE approvals_decision")
    assert_counts_match(world["users"])
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE approvals_approval CASCADE")
    assert not InboxCount.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_migration_counts_the_cards_already_open(bob, payments):
    """Cards opened before migration 0016 (no trigger yet) are counted by it: its backfill is what the triggers
    keep from then on."""
    executor = MigrationExecutor(connection)
    executor.migrate([("approvals", "0015_approval_trace_parent")])
    try:
        assign_perm("core.approve_channel", bob, payments)
        with connection.cursor() as cursor:
            cursor.execute("SELECT to_regclass('approvals_inboxcount')")
            assert cursor.fetchone() == (None,)
        for i in range(6):
            card(payments, risk=["low", "high"][i % 2], due_in=timedelta(minutes=10 * i - 15))
        card(payments, status="approved")
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
    assert InboxCount.objects.aggregate(n=Sum("n"))["n"] == 6
    assert_counts_match([bob])
    card(payments, risk="medium")
    assert_counts_match([bob])


# --- past the cap, and the number of queries --------------------------------------------------------------------


def test_an_sla_count_past_the_cap_says_so_and_on_time_is_the_rest(client, bob, payments, monkeypatch):
    monkeypatch.setattr(inbox, "SLA_COUNT_CAP", 3)
    assign_perm("core.approve_channel", bob, payments)
    for _ in range(2):
        card(payments, due_in=timedelta(minutes=-5))
    for _ in range(6):
        card(payments, due_in=timedelta(hours=3))
    client.force_login(bob)
    response = client.get("/", headers=HTMX_COUNTS)
    # Both near counts below the cap: on time is the kept count less them, exact past the cap.
    assert [facet_count(response, "sla", s) for s in ("on_time", "due_soon", "breached")] == [6, 0, 2]
    assert b'<span class="count">6</span>' in response.content
    for _ in range(3):
        card(payments, due_in=timedelta(minutes=-5))
    response = client.get("/", headers=HTMX_COUNTS)
    assert b'data-value="breached"' in response.content
    section = response.content.decode().split('data-facet="sla"', 1)[1]
    assert '<span class="label">Breached</span> <span class="count">3+</span>' in section
    # Breached past the cap, on time cannot be the rest: at least what was read of it.
    assert '<span class="label">On time</span> <span class="count">3+</span>' in section
    response = client.get("/?sla=breached", headers=HTMX_COUNTS)
    assert b'<strong data-count="matching">3+</strong> cards' in response.content
    assert b'data-count="total">11<' in response.content
    risks = response.content.decode().split('data-facet="risk"', 1)[1].split("</section>", 1)[0]
    assert '<span class="label">Medium</span> <span class="count">3+</span>' in risks
    assert '<span class="label">High</span> <span class="count">0+</span>' in risks  # none among those read


def _many_cards(channels, n: int, agent) -> None:
    runs = Run.objects.bulk_create(
        Run(workflow=f"wf{i % 3}", workflow_version=1, input={}, status=Run.Status.WAITING_HUMAN) for i in range(n)
    )
    now = timezone.now()
    Approval.objects.bulk_create(
        Approval(
            run=run,
            workflow=run.workflow,
            step_seq=1,
            channel=channels[i % len(channels)],
            proposed={"refund": {"amount_cents": 100, "currency": "EUR"}},
            risk=["low", "medium", "high"][i % 3],
            status="escalated" if i % 10 == 0 else "pending",
            args_hash="h",
            due_at=now + timedelta(minutes=i % 300 - 30),
            run_created_by=agent if i % 4 == 0 else None,
        )
        for i, run in enumerate(runs)
    )


@pytest.mark.parametrize("url", ["/", "/?sla=on_time", "/?risk=high&sla=breached", "/?workflow=wf1&channel=payments"])
def test_the_page_makes_as_many_queries_at_10_cards_as_at_1000(client, bob, payments, url):
    email = Channel.objects.create(name="email", sla=timedelta(minutes=10))
    agent = User.objects.create_user("agent")
    for channel in (payments, email):
        assign_perm("core.approve_channel", bob, channel)
    client.force_login(bob)
    _many_cards([payments, email], 10, agent)
    few = [_queries(client, url), _queries(client, url, HTMX_COUNTS)]
    _many_cards([payments, email], 990, agent)
    assert Approval.objects.filter(status__in=Approval.OPEN).count() == 1000
    many = [_queries(client, url), _queries(client, url, HTMX_COUNTS)]
    assert few == many
    assert many[1] <= 5, many  # session, user, channels, kept counts, SLA counts
    # And the counts read no more rows than the kinds of cards there are (not one per card).
    assert InboxCount.objects.count() < 100


# --- concurrent writes -------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_concurrent_writes_keep_the_counts_exact():
    """Card writes and decisions from several connections at once, on the same keys: nobody waits for a counter
    row (the triggers only add rows), and the sums are exact. A decision's trigger locks its card, so a card moved
    while someone decides it is counted once, under its new key."""
    channel = Channel.objects.create(name="payments")
    people = [User.objects.create_user(f"p{i}") for i in range(4)]
    cards = [card(channel, risk="medium") for _ in range(40)]
    errors = []

    def work(worker: int) -> None:
        try:
            for i, c in enumerate(cards):
                if i % 4 == worker:
                    Decision.objects.create(approval=c, actor=people[worker], decision="approve")
                elif i % 4 == (worker + 1) % 4:
                    Approval.objects.filter(pk=c.pk).update(risk="high")
                elif i % 4 == (worker + 2) % 4 and i % 8 == 0:
                    Approval.objects.filter(pk=c.pk).update(status="expired", decided_at=timezone.now())
                card(channel, risk="low")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert_kept_equals_rebuild()
    total = InboxCount.objects.aggregate(n=Sum("n"))["n"]
    assert total == Approval.objects.filter(status__in=Approval.OPEN).count() == 40 - 5 + 4 * 40


def test_sla_states_are_the_inbox_s(world):
    """The SLA facet's values are the inbox's own (a sanity check of the reference above)."""
    assert [v for v, _ in SLA_STATES] == ["on_time", "due_soon", "breached"]
