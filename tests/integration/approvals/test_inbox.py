"""The reviewer inbox at `/` and bulk decisions at POST /approvals/bulk."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from guardian.shortcuts import assign_perm

from approvals.models import Approval, Decision
from core.models import AuditEntry, Channel
from runs.models import Run

HTMX = {"HX-Request": "true", "HX-Target": "inbox-rows"}
HTMX_COUNTS = {"HX-Request": "true", "HX-Target": "inbox-counts"}


@pytest.fixture
def email(db):
    return Channel.objects.create(name="email", sla=timedelta(minutes=10))


@pytest.fixture
def reviewers(bob, payments, email):
    """Bob reviews payments; Erin reviews email only."""
    assign_perm("core.approve_channel", bob, payments)
    erin = User.objects.create_user("erin", password="password")
    assign_perm("core.approve_channel", erin, email)
    return {"bob": bob, "erin": erin}


_seq = iter(range(1, 10**9))


def card(
    channel,
    *,
    due_in=timedelta(hours=1),
    risk="medium",
    workflow="refund",
    summary="Refund a damaged item",
    amount=12_500,
    created_by=None,
    status="pending",
) -> Approval:
    run = Run.objects.create(
        workflow=workflow, workflow_version=1, input={}, status=Run.Status.WAITING_HUMAN, created_by=created_by
    )
    proposed = {"refund": {"amount_cents": amount, "currency": "EUR"}} if amount is not None else {"to": "x"}
    return Approval.objects.create(
        run=run,
        step_seq=next(_seq),
        channel=channel,
        proposed=proposed,
        # As the refund gate's display hints set them when a card opens (approvals.gates).
        amount_minor=amount,
        currency="EUR" if amount is not None else "",
        summary=summary,
        risk=risk,
        status=status,
        args_hash="h",
        due_at=timezone.now() + due_in,
        decided_at=None if status in Approval.OPEN else timezone.now(),
    )


def shown(response) -> list[int]:
    """The card ids listed, in order."""
    return [int(pk) for pk in re.findall(rb'data-pk="(\d+)"', response.content)]


def facet_count(response, facet: str, value: str) -> int:
    html = response.content.decode()
    section = html.split(f'data-facet="{facet}"', 1)[1].split("</section>", 1)[0]
    match = re.search(
        rf'data-value="{re.escape(value)}"[^>]*>\s*<span class="label">[^<]*</span> <span class="count">(\d+)', section
    )
    assert match, f"no {facet}={value} in the counts"
    return int(match.group(1))


# --- who sees what ---------------------------------------------------------------------------------------------


@pytest.fixture
def two_channels(reviewers, payments, email):
    return {"payments": card(payments, summary="pay card"), "email": card(email, summary="mail card", amount=None)}


@pytest.mark.parametrize(
    ("who", "expected"),
    [
        ("alice", {"payments", "email"}),  # admin: a superuser holds every permission
        ("bob", {"payments"}),  # reviewer of payments
        ("erin", {"email"}),  # reviewer of another channel
    ],
)
def test_it_shows_the_cards_of_the_channels_the_user_may_approve(client, request, two_channels, who, expected):
    user = request.getfixturevalue(who) if who == "alice" else User.objects.get(username=who)
    client.force_login(user)
    response = client.get("/")
    assert response.status_code == 200
    assert set(shown(response)) == {two_channels[name].pk for name in expected}


@pytest.mark.parametrize("who", ["carol", "dave"])
def test_ops_and_outsiders_keep_their_empty_states(client, request, two_channels, who):
    user = request.getfixturevalue(who)
    client.force_login(user)
    response = client.get("/")
    assert response.status_code == 200
    assert shown(response) == []
    assert b"data-role=" in response.content
    assert b"pay card" not in response.content


def test_anonymous_is_sent_to_login(client, two_channels):
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


def test_it_hides_cards_of_runs_the_user_started(client, reviewers, payments):
    bob = reviewers["bob"]
    mine = card(payments, created_by=bob)
    theirs = card(payments, created_by=reviewers["erin"])
    client.force_login(bob)
    response = client.get("/")
    assert shown(response) == [theirs.pk]
    assert mine.pk not in shown(client.get("/", headers=HTMX))
    assert facet_count(response, "channel", "payments") == 1


def test_it_lists_only_open_cards_most_urgent_first(client, reviewers, payments):
    later = card(payments, due_in=timedelta(hours=2))
    breached = card(payments, due_in=timedelta(minutes=-3))
    soon = card(payments, due_in=timedelta(minutes=2), status="escalated")
    card(payments, status="approved")
    card(payments, status="cancelled")
    client.force_login(reviewers["bob"])
    response = client.get("/")
    assert shown(response) == [breached.pk, soon.pk, later.pk]
    assert b"escalated" in response.content


def test_an_escalated_card_names_its_group(client, reviewers, payments):
    c = card(payments, status="escalated")
    Approval.objects.filter(pk=c.pk).update(assigned_group=Group.objects.create(name="payments-leads"))
    client.force_login(reviewers["bob"])
    assert b'title="escalated to payments-leads">escalated<' in client.get("/").content


def test_a_reviewer_with_no_card_sees_an_empty_inbox(client, reviewers):
    client.force_login(reviewers["bob"])
    response = client.get("/")
    assert b"Nothing waits for you" in response.content
    assert b'id="inbox-rows"' in response.content


# --- rows ------------------------------------------------------------------------------------------------------


def test_a_row_shows_channel_risk_workflow_summary_amount_and_sla(client, reviewers, payments):
    c = card(payments, risk="high", workflow="refund", summary="Refund order 42", amount=12_500)
    client.force_login(reviewers["bob"])
    html = client.get("/").content.decode()
    row = html.split(f'id="row-{c.pk}"', 1)[1].split("</tr>", 1)[0]
    assert 'class="channel">payments<' in row
    assert "High" in row and 'class="workflow">refund<' in row
    assert "Refund order 42" in row
    assert "125.00 EUR" in row
    assert f'href="/approvals/{c.pk}/"' in row
    assert f'data-due-at="{c.due_at.isoformat()[:19]}' in row
    assert "left" in row
    assert f'value="{c.pk}:{c.version}"' in row


def test_a_row_without_an_amount_shows_none(client, reviewers, email):
    c = card(email, amount=None)
    client.force_login(reviewers["erin"])
    html = client.get("/").content.decode()
    row = html.split(f'id="row-{c.pk}"', 1)[1].split("</tr>", 1)[0]
    assert 'class="amount"></td>' in row


def test_summaries_are_escaped(client, reviewers, payments):
    card(payments, summary='<script>alert(1)</script>"><img src=x onerror=alert(2)>')
    client.force_login(reviewers["bob"])
    response = client.get("/")
    assert b"<script>alert(1)" not in response.content
    assert b"<img src=x" not in response.content
    assert b"&lt;script&gt;alert(1)&lt;/script&gt;" in response.content


def test_sla_states(client, reviewers, payments, email):
    # payments: 1 h SLA -> due soon within 15 min; email: 10 min SLA -> due soon within 5 min (the floor).
    late = card(payments, due_in=timedelta(minutes=-1))
    soon = card(payments, due_in=timedelta(minutes=14))
    fine = card(payments, due_in=timedelta(minutes=16))
    mail_soon = card(email, due_in=timedelta(minutes=4))
    mail_fine = card(email, due_in=timedelta(minutes=6))
    assign_perm("core.approve_channel", reviewers["bob"], email)
    client.force_login(reviewers["bob"])
    html = client.get("/").content.decode()
    for c, state in [
        (late, "breached"),
        (soon, "due_soon"),
        (fine, "on_time"),
        (mail_soon, "due_soon"),
        (mail_fine, "on_time"),
    ]:
        assert f'class="card-row sla-{state}" id="row-{c.pk}"' in html
    assert shown(client.get("/?sla=due_soon")) == [mail_soon.pk, soon.pk]
    assert shown(client.get("/?sla=breached")) == [late.pk]
    assert shown(client.get("/?sla=on_time")) == [mail_fine.pk, fine.pk]
    response = client.get("/")
    assert [facet_count(response, "sla", s) for s in ("on_time", "due_soon", "breached")] == [2, 2, 1]


# --- filters and counts ----------------------------------------------------------------------------------------


@pytest.fixture
def mixed(reviewers, payments, email):
    assign_perm("core.approve_channel", reviewers["bob"], email)
    return [
        card(payments, risk="high", workflow="refund"),
        card(payments, risk="low", workflow="refund"),
        card(payments, risk="high", workflow="dunning"),
        card(email, risk="high", workflow="refund"),
        card(email, risk="medium", workflow="newsletter"),
    ]


def test_filters_combine(client, reviewers, mixed):
    client.force_login(reviewers["bob"])
    assert set(shown(client.get("/?channel=payments"))) == {c.pk for c in mixed[:3]}
    assert set(shown(client.get("/?risk=high"))) == {mixed[0].pk, mixed[2].pk, mixed[3].pk}
    assert set(shown(client.get("/?workflow=refund&risk=high"))) == {mixed[0].pk, mixed[3].pk}
    assert set(shown(client.get("/?channel=email&workflow=newsletter"))) == {mixed[4].pk}
    assert shown(client.get("/?channel=payments&workflow=newsletter")) == []


def test_unknown_filter_values_are_ignored(client, reviewers, mixed):
    client.force_login(reviewers["bob"])
    assert len(shown(client.get("/?channel=crm&risk=extreme&sla=whenever&after=garbage"))) == 5


def test_counts_per_filter_value(client, reviewers, mixed):
    client.force_login(reviewers["bob"])
    response = client.get("/")
    assert facet_count(response, "channel", "payments") == 3
    assert facet_count(response, "channel", "email") == 2
    assert [facet_count(response, "risk", r) for r in ("low", "medium", "high")] == [1, 1, 3]
    assert facet_count(response, "workflow", "refund") == 3
    assert facet_count(response, "workflow", "dunning") == 1
    assert facet_count(response, "workflow", "newsletter") == 1
    # Under a filter, each facet counts under the other facets' filters (its own values stay selectable).
    response = client.get("/?channel=payments&risk=high")
    assert facet_count(response, "channel", "payments") == 2
    assert facet_count(response, "channel", "email") == 1
    assert [facet_count(response, "risk", r) for r in ("low", "medium", "high")] == [1, 0, 2]
    assert facet_count(response, "workflow", "refund") == 1
    assert facet_count(response, "workflow", "newsletter") == 0
    assert b'<strong data-count="matching">2</strong>' in response.content
    assert b'data-count="total">5<' in response.content


def test_the_counts_partial_alone(client, reviewers, mixed):
    client.force_login(reviewers["bob"])
    response = client.get("/?risk=high", headers=HTMX_COUNTS)
    html = response.content.decode()
    assert html.lstrip().startswith('<aside id="inbox-counts"')
    assert 'hx-trigger="every 5s, approvals-changed from:body"' in html
    assert "<table" not in html
    assert facet_count(response, "channel", "payments") == 2


def test_the_rows_partial_alone(client, reviewers, mixed):
    client.force_login(reviewers["bob"])
    response = client.get("/?risk=high", headers=HTMX)
    html = response.content.decode()
    assert html.lstrip().startswith('<div id="inbox-rows"')
    assert 'hx-trigger="every 5s, approvals-changed from:body"' in html
    assert 'hx-get="/?risk=high"' in html
    assert "inbox-counts" not in html and "<html" not in html
    assert len(shown(response)) == 3


# --- pagination -----------------------------------------------------------------------------------------------


def test_pages_follow_each_other_by_keyset(client, reviewers, payments):
    due = timezone.now() + timedelta(minutes=30)
    cards = [card(payments, due_in=timedelta(minutes=i)) for i in range(60)]
    # Ties on due_at are broken by id, across a page boundary too.
    Approval.objects.filter(pk__in=[c.pk for c in cards[45:55]]).update(due_at=due)
    expected = [c.pk for c in sorted(Approval.objects.all(), key=lambda c: (c.due_at, c.pk))]
    client.force_login(reviewers["bob"])
    first = client.get("/")
    assert shown(first) == expected[:50]
    next_url = re.search(rb'href="([^"]+)" rel="next"', first.content).group(1).decode().replace("&amp;", "&")
    second = client.get(next_url)
    assert shown(second) == expected[50:]
    assert b'rel="next"' not in second.content
    assert b'rel="first"' in second.content


def test_the_next_page_keeps_the_filters(client, reviewers, payments):
    for i in range(55):
        card(payments, risk="high", due_in=timedelta(minutes=i))
    card(payments, risk="low")
    client.force_login(reviewers["bob"])
    first = client.get("/?risk=high")
    next_url = re.search(rb'href="([^"]+)" rel="next"', first.content).group(1).decode().replace("&amp;", "&")
    assert "risk=high" in next_url
    assert len(shown(client.get(next_url))) == 5


# --- a fixed number of queries ----------------------------------------------------------------------------------


def _queries(client, url, headers=None) -> int:
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url, headers=headers or {}).status_code == 200
    return len(ctx.captured_queries)


@pytest.mark.parametrize("url", ["/", "/?risk=high&sla=on_time", "/?workflow=refund&channel=payments"])
def test_a_page_costs_the_same_number_of_queries_whatever_the_number_of_cards(client, reviewers, payments, email, url):
    assign_perm("core.approve_channel", reviewers["bob"], email)
    client.force_login(reviewers["bob"])
    for i in range(10):
        card(payments if i % 2 else email, risk=["low", "high"][i % 2], workflow=f"wf{i % 3}")
    few = [_queries(client, url), _queries(client, url, HTMX), _queries(client, url, HTMX_COUNTS)]
    for i in range(90):
        card(payments if i % 2 else email, risk=["low", "high"][i % 2], workflow=f"wf{i % 5}")
    many = [_queries(client, url), _queries(client, url, HTMX), _queries(client, url, HTMX_COUNTS)]
    assert few == many
    assert many[0] <= 8, many


# --- bulk decisions ---------------------------------------------------------------------------------------------


def bulk(client, cards, decision="approve", comment="", reason="", htmx=True):
    data = {"cards": [f"{c.pk}:{c.version}" for c in cards], "decision": decision, "comment": comment, "reason": reason}
    return client.post("/approvals/bulk", data, headers={"HX-Request": "true"} if htmx else {})


def test_bulk_approve_of_one_channel(client, reviewers, payments):
    cards = [card(payments) for _ in range(3)]
    client.force_login(reviewers["bob"])
    response = bulk(client, cards, comment="all fine")
    assert response.status_code == 200
    assert "approvals-changed" in response["HX-Trigger-After-Settle"]
    assert b"3 of 3 cards decided" in response.content
    for c in cards:
        c.refresh_from_db()
        assert c.status == Approval.Status.APPROVED
        assert c.run.__class__.objects.get(pk=c.run_id).status == Run.Status.QUEUED
    # Each decision on its own: one Decision and one audit entry per card, actor = the person.
    assert Decision.objects.filter(approval__in=cards, actor=reviewers["bob"], comment="all fine").count() == 3
    entries = AuditEntry.objects.filter(action="approval.approve", actor="bob")
    assert sorted(entries.values_list("approval_id", flat=True)) == sorted(c.pk for c in cards)
    assert shown(client.get("/")) == []


def test_bulk_reject_needs_a_comment_and_a_reason(client, reviewers, payments):
    cards = [card(payments) for _ in range(2)]
    client.force_login(reviewers["bob"])
    response = bulk(client, cards, decision="reject", comment="  ", reason="policy")
    assert response.status_code == 422
    assert b'data-field="comment"' in response.content
    response = bulk(client, cards, decision="reject", comment="not our policy", reason="")
    assert response.status_code == 422
    assert b'data-field="reason"' in response.content
    response = bulk(client, cards, decision="reject", comment="not our policy", reason="because")
    assert response.status_code == 422
    assert not Decision.objects.exists()
    assert set(Approval.objects.values_list("status", flat=True)) == {"pending"}

    response = bulk(client, cards, decision="reject", comment="not our policy", reason="policy")
    assert response.status_code == 200
    assert set(Approval.objects.values_list("status", flat=True)) == {"rejected"}
    assert set(Decision.objects.values_list("reason", "comment")) == {("policy", "not our policy")}
    assert AuditEntry.objects.filter(action="approval.reject").count() == 2


def test_bulk_refuses_mixed_channels(client, reviewers, payments, email):
    assign_perm("core.approve_channel", reviewers["bob"], email)
    cards = [card(payments), card(email)]
    client.force_login(reviewers["bob"])
    response = bulk(client, cards)
    assert response.status_code == 400
    assert b"one channel" in response.content
    assert not Decision.objects.exists()
    assert bulk(client, cards, htmx=False).status_code == 400


def test_bulk_checks_permission_per_card(client, reviewers, payments, email):
    mine, other = card(payments), card(email)  # bob may not approve on email
    client.force_login(reviewers["bob"])
    response = bulk(client, [mine, other])
    assert response.status_code == 200
    assert f'data-card="{other.pk}" data-status="404"'.encode() in response.content
    mine.refresh_from_db()
    other.refresh_from_db()
    assert (mine.status, other.status) == ("approved", "pending")


def test_bulk_refuses_the_cards_of_runs_the_user_started(client, reviewers, payments):
    own, theirs = card(payments, created_by=reviewers["bob"]), card(payments)
    client.force_login(reviewers["bob"])
    response = bulk(client, [own, theirs])
    assert f'data-card="{own.pk}" data-status="403"'.encode() in response.content
    own.refresh_from_db()
    assert own.status == "pending"
    assert Approval.objects.get(pk=theirs.pk).status == "approved"


def test_bulk_reports_cards_already_decided(client, reviewers, payments):
    first, second = card(payments), card(payments)
    rita = User.objects.create_user("rita")
    assign_perm("core.approve_channel", rita, payments)
    first.decide(rita, "approve")
    client.force_login(reviewers["bob"])
    response = bulk(client, [first, second])  # `first` at the version bob saw
    assert response.status_code == 200
    assert f'data-card="{first.pk}" data-status="409"'.encode() in response.content
    assert b"already approved by rita" in response.content
    assert b"1 of 2 cards decided" in response.content
    assert Decision.objects.filter(approval=first).count() == 1
    assert Approval.objects.get(pk=second.pk).status == "approved"


@pytest.mark.parametrize("who", ["carol", "dave"])
def test_bulk_by_someone_who_approves_nothing(client, request, reviewers, payments, who):
    c = card(payments)
    client.force_login(request.getfixturevalue(who))
    response = bulk(client, [c])
    assert f'data-card="{c.pk}" data-status="404"'.encode() in response.content
    assert Approval.objects.get(pk=c.pk).status == "pending"


def test_bulk_by_the_admin(client, alice, reviewers, payments):
    c = card(payments)
    client.force_login(alice)
    assert bulk(client, [c]).status_code == 200
    assert Approval.objects.get(pk=c.pk).status == "approved"


def test_bulk_needs_login_and_post(client, reviewers, payments):
    c = card(payments)
    response = bulk(client, [c])
    assert response.status_code == 302
    client.force_login(reviewers["bob"])
    assert client.get("/approvals/bulk").status_code == 405
    assert bulk(client, []).status_code == 400
    assert Approval.objects.get(pk=c.pk).status == "pending"


def test_bulk_without_javascript_redirects_to_the_inbox(client, reviewers, payments):
    c = card(payments)
    client.force_login(reviewers["bob"])
    response = bulk(client, [c], htmx=False)
    assert response.status_code == 302 and response["Location"] == "/"
    assert Approval.objects.get(pk=c.pk).status == "approved"


def test_a_card_the_user_approved_waits_for_a_second_person_elsewhere(client, reviewers, payments):
    """Two-person rule: after bob's approval the card stays open, but only for someone else."""
    payments.required_approvals = 2
    payments.save()
    c = card(payments)
    rita = User.objects.create_user("rita")
    assign_perm("core.approve_channel", rita, payments)
    client.force_login(reviewers["bob"])
    assert bulk(client, [c]).status_code == 200
    assert Approval.objects.get(pk=c.pk).status == "pending"
    response = client.get("/")
    assert shown(response) == []
    assert facet_count(response, "channel", "payments") == 0
    client.force_login(rita)
    assert shown(client.get("/")) == [c.pk]
    c.refresh_from_db()
    assert bulk(client, [c]).status_code == 200
    assert Approval.objects.get(pk=c.pk).status == "approved"


# --- what a row shows is what bulk approves (issue 24) ----------------------------------------------------------


def row_of(response, c: Approval) -> str:
    return response.content.decode().split(f'id="row-{c.pk}"', 1)[1].split("</tr>", 1)[0]


def with_proposal(c: Approval, proposed: dict, current: dict | None = None) -> Approval:
    """The card with another proposal (an external agent's arguments: its display paths chose the headline and the
    amount, and the rest is whatever it sends)."""
    Approval.objects.filter(pk=c.pk).update(proposed=proposed, current=current)
    return Approval.objects.get(pk=c.pk)


def test_a_row_that_cannot_show_all_that_runs_says_so_and_offers_no_approve(client, reviewers, payments):
    full = card(payments)
    hidden = with_proposal(
        card(payments), {"refund": {"amount_cents": 12_500, "currency": "EUR", "iban": "XX00 0000 0000 0000"}}
    )
    client.force_login(reviewers["bob"])
    response = client.get("/")
    row = row_of(response, hidden)
    assert "125.00 EUR" in row  # what the row does show
    assert "1 field not shown here" in row and 'data-not-shown="1"' in row
    assert "data-not-shown" not in row_of(response, full)


def test_a_row_says_when_the_agent_says_the_target_already_has_the_values(client, reviewers, payments):
    c = card(payments)
    with_proposal(c, c.proposed, c.proposed)
    client.force_login(reviewers["bob"])
    row = row_of(client.get("/"), c)
    assert "The agent says the target already has these values" in row
    assert "data-not-shown" not in row  # both fields are the row's amount and currency


def test_bulk_approve_naming_a_card_its_row_cannot_show_in_full_is_refused(client, reviewers, payments):
    full = card(payments)
    hidden = with_proposal(
        card(payments), {"refund": {"amount_cents": 12_500, "currency": "EUR", "iban": "XX00 0000 0000 0000"}}
    )
    same = card(payments)  # an agent's current equal to its arguments: every field must be shown, and one is not
    same = with_proposal(same, {"amount_cents": 12_500, "to": "x"}, {"amount_cents": 12_500, "to": "x"})
    client.force_login(reviewers["bob"])
    response = bulk(client, [full, hidden, same])
    assert response.status_code == 200
    html = response.content.decode()
    for refused in (hidden, same):
        assert f'data-card="{refused.pk}" data-status="409"' in html
        assert Approval.objects.get(pk=refused.pk).status == "pending"
        assert not Decision.objects.filter(approval=refused).exists()
    assert "cannot be approved from the inbox" in html and "open" in html
    assert "1 of 3 cards decided" in html
    assert Approval.objects.get(pk=full.pk).status == "approved"
    # Without JavaScript too; and rejecting them in bulk runs nothing, so it stays possible.
    assert bulk(client, [hidden], htmx=False).status_code == 302
    assert Approval.objects.get(pk=hidden.pk).status == "pending"
    assert bulk(client, [hidden, same], decision="reject", comment="no", reason="policy").status_code == 200
    assert set(Approval.objects.filter(pk__in=[hidden.pk, same.pk]).values_list("status", flat=True)) == {"rejected"}
