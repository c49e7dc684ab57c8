"""Evaluating a candidate approval rule over recorded cards (issue 28, item 3): 200 cards of a seeded generator,
closed every way a card closes (approved unchanged by one or two people, edited, rejected, expired, cancelled,
rejected by the SLA's safe default), and the figures the evaluation reports equal to those this test computes
from the generated data itself, in plain Python; bad input refused with nothing saved; the command, the pages,
the API."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from approvals.models import Approval, Decision
from core.models import ApiToken, AuditEntry, Channel
from evals.errors import CandidateInvalid, EmptyPeriod
from evals.models import Evaluation
from evals.rules import Candidate
from runs.models import Run

CHANNELS = ("payments", "email", "crm")
CURRENCIES = ("EUR", "EUR", "USD", "GBP")
WORKFLOWS = ("refund", "dunning", "kyc")
RISKS = ("low", "medium", "high")
RULE_IDS = ("tool:refund_order", "tool:send_email", "R-12", "")
# How a card closed, with its weight: (status, whose decisions)
ENDINGS = [
    ("approved", "one", 40),
    ("approved", "two", 10),
    ("edited", "one", 12),
    ("edited", "edit_then_approve", 5),
    ("rejected", "one", 18),
    ("rejected", "system", 5),  # the SLA's safe default
    ("expired", "none", 6),
    ("cancelled", "none", 4),
]


@dataclass
class Spec:
    """One generated card, as the test knows it (never read back from the database for the expectations)."""

    channel: str
    workflow: str
    risk: str
    rule_id: str
    amount: int | None
    currency: str
    status: str
    who: str
    created_at: datetime
    waited: timedelta
    deciders: list[str] = field(default_factory=list)
    comment: str = ""
    pk: int = 0

    @property
    def by_person(self) -> bool:
        return self.status in ("approved", "edited", "rejected") and self.who != "system"


@pytest.fixture
def world(db):
    """Three channels, three reviewers, ops (carol) and an admin (alice), and 200 closed cards in the period,
    plus cards that are not of it (closed before it, still open)."""
    for name in CHANNELS:
        Channel.objects.create(name=name)
    reviewers = [User.objects.create_user(name) for name in ("rita", "sam", "tom")]
    rng = random.Random(20261206)
    start = timezone.now() - timedelta(days=20)
    specs = []
    for i in range(200):
        status, who, _ = rng.choices(ENDINGS, weights=[w for *_, w in ENDINGS])[0]
        amount = None if rng.random() < 0.1 else rng.choice([rng.randint(1, 4999), rng.randint(5000, 200_000)])
        spec = Spec(
            channel=rng.choice(CHANNELS),
            workflow=rng.choice(WORKFLOWS),
            risk=rng.choice(RISKS),
            rule_id=rng.choice(RULE_IDS),
            amount=amount,
            currency=rng.choice(CURRENCIES) if amount is not None else "",
            status=status,
            who=who,
            created_at=start + timedelta(minutes=97 * i),
            waited=timedelta(seconds=rng.randint(20, 8 * 3600), microseconds=rng.randint(0, 999_999)),
        )
        specs.append(spec)
    # Not of the period: closed before it, and open.
    before = Spec("payments", "refund", "low", "", 100, "EUR", "rejected", "one", start - timedelta(days=30),
                  timedelta(hours=1))  # fmt: skip
    _make_cards([*specs, before], reviewers, rng)
    _open_card()
    return {"specs": specs, "since": start - timedelta(days=1), "until": timezone.now()}


_seq = iter(range(1, 10**6))


def _make_cards(specs: list[Spec], reviewers: list[User], rng: random.Random) -> None:
    """The cards of `specs`, closed as each says, with their decisions (in bulk: the fixture of every test)."""
    channels = {c.name: c for c in Channel.objects.all()}
    runs = Run.objects.bulk_create(
        Run(workflow=s.workflow, workflow_version=1, input={}, status=Run.Status.SUCCEEDED, finished_at=timezone.now())
        for s in specs
    )
    cards = Approval.objects.bulk_create(
        Approval(
            run=run,
            workflow=spec.workflow,
            step_seq=next(_seq),
            channel=channels[spec.channel],
            proposed={"amount_cents": spec.amount},
            amount_minor=spec.amount,
            currency=spec.currency,
            rule_id=spec.rule_id,
            risk=spec.risk,
            status=spec.status,
            args_hash="h",
            due_at=spec.created_at + timedelta(days=1),
            decided_at=spec.created_at + spec.waited,
        )
        for run, spec in zip(runs, specs, strict=True)
    )
    with connection.cursor() as cursor:  # created_at is auto_now_add: set it after
        cursor.executemany(
            "UPDATE approvals_approval SET created_at = %s WHERE id = %s",
            [(spec.created_at, card.pk) for card, spec in zip(cards, specs, strict=True)],
        )
    decisions = []
    for card, spec in zip(cards, specs, strict=True):
        first, second = rng.sample(reviewers, 2)
        steps = {
            ("approved", "one"): [(first, "approve", "")],
            ("approved", "two"): [(first, "approve", "ok"), (second, "approve", "ok too")],
            ("edited", "one"): [(first, "edit", "lowered the amount")],
            ("edited", "edit_then_approve"): [(first, "edit", "fixed the address"), (second, "approve", "")],
            ("rejected", "one"): [(first, "reject", "wrong customer")],
            ("rejected", "system"): [(None, "reject", "No decision in time: the safe default.")],
        }.get((spec.status, spec.who), [])
        for actor, decision, comment in steps:
            decisions.append(Decision(approval=card, actor=actor, decision=decision, comment=comment))
            if actor is not None:
                spec.deciders.append(actor.username)
            spec.comment = comment
        spec.pk = card.pk
    Decision.objects.bulk_create(decisions)


def _open_card() -> None:
    run = Run.objects.create(workflow="refund", workflow_version=1, input={}, status=Run.Status.WAITING_HUMAN)
    Approval.objects.create(
        run=run,
        step_seq=next(_seq),
        channel=Channel.objects.get(name="payments"),
        proposed={},
        amount_minor=10,
        currency="EUR",
        args_hash="h",
        due_at=timezone.now() + timedelta(hours=1),
    )


def _expected(specs: list[Spec], action_of, quorum_of=lambda s: 0) -> dict:
    """The figures, computed here from the generated cards: what the evaluation must report."""
    decided = [s for s in specs if s.by_person]
    matrix = {a: {"approved": 0, "edited": 0, "rejected": 0} for a in ("auto_approve", "refuse", "ask")}
    for s in decided:
        matrix[action_of(s)][s.status] += 1
    itself = [s for s in decided if action_of(s) != "ask"]
    agreed = sum(
        1 for s in itself if (action_of(s), s.status) in {("auto_approve", "approved"), ("refuse", "rejected")}
    )
    waits = [s.waited for s in itself]
    return {
        "total": len(specs),
        "decided_by_person": len(decided),
        "not_decided_by_person": {
            "expired": sum(s.status == "expired" for s in specs),
            "cancelled": sum(s.status == "cancelled" for s in specs),
            "by_system": sum(s.who == "system" for s in specs),
        },
        "matrix": matrix,
        "candidate_decided": len(itself),
        "agreed": agreed,
        "agreement": agreed / len(itself) if itself else None,
        "dangerous": sorted(s.pk for s in itself if action_of(s) == "auto_approve" and s.status != "approved"),
        "refused_approved": sorted(s.pk for s in itself if action_of(s) == "refuse" and s.status != "rejected"),
        "time_saved": {
            "cards": len(itself),
            "total_seconds": sum(waits, timedelta()).total_seconds(),
            "median_seconds": statistics.median(waits).total_seconds() if waits else None,
        },
        "quorum_short": sorted(
            s.pk
            for s in decided
            if action_of(s) == "ask" and s.status != "rejected" and len(set(s.deciders)) < quorum_of(s)
        ),
    }


def _check(figures: dict, expected: dict, specs: list[Spec]) -> None:
    ids = lambda listed: sorted(c["card"] for c in listed["cards"])  # noqa: E731
    for name in ("total", "decided_by_person", "not_decided_by_person", "matrix", "candidate_decided", "agreed"):
        assert figures[name] == expected[name], name
    assert figures["agreement"] == expected["agreement"]
    assert figures["time_saved"] == expected["time_saved"]
    assert ids(figures["dangerous"]) == expected["dangerous"]
    assert figures["dangerous"]["count"] == len(expected["dangerous"])
    assert ids(figures["refused_approved"]) == expected["refused_approved"]
    by_pk = {s.pk: s for s in specs}
    for listed in figures["dangerous"]["cards"]:
        spec = by_pk[listed["card"]]
        assert listed["decided_by"] == list(dict.fromkeys(spec.deciders))
        assert (listed["channel"], listed["amount_minor"], listed["currency"], listed["comment"]) == (
            spec.channel,
            spec.amount,
            spec.currency,
            spec.comment,
        )


AUTO_UNDER = 5000


def _auto_under(s: Spec) -> str:
    small = s.amount is not None and s.amount < AUTO_UNDER
    return "auto_approve" if s.channel == "payments" and s.currency == "EUR" and small else "ask"


def test_it_reports_exactly_the_counts_of_auto_approve_under_x(world):
    candidate = {
        "name": "auto-approve payments under 50 EUR",
        "rules": [
            {"if": {"channel": "payments", "currency": "EUR", "amount_below": AUTO_UNDER}, "then": "auto_approve"}
        ],
    }
    evaluation = Evaluation.of_rule(candidate, world["since"], world["until"])
    expected = _expected(world["specs"], _auto_under)
    assert expected["dangerous"] and expected["candidate_decided"] > expected["agreed"] > 0  # the data has them all
    _check(evaluation.figures, expected, world["specs"])
    saved = Evaluation.objects.get()
    assert saved.figures["matrix"] == expected["matrix"] and saved.kind == "rule"
    assert saved.candidate == candidate and saved.name == candidate["name"]
    entry = AuditEntry.objects.get(action="evaluation.create")
    assert entry.target == f"evaluation:{saved.pk}" and entry.data["headline"]["dangerous"] == len(
        expected["dangerous"]
    )


def test_it_reports_exactly_a_refusing_rule_and_a_quorum(world):
    candidate = {
        "rules": [
            {"if": {"risk": "high", "workflow": ["refund", "kyc"]}, "then": "refuse"},
            {"if": {"tool": "refund_order", "amount_at_least": 100, "amount_below": 20_000}, "then": "auto_approve"},
        ],
        "otherwise": "ask",
        "quorum": {"channel": "payments", "approvers": 2},
    }

    def action_of(s: Spec) -> str:
        if s.risk == "high" and s.workflow in ("refund", "kyc"):
            return "refuse"
        if s.rule_id == "tool:refund_order" and s.amount is not None and 100 <= s.amount < 20_000:
            return "auto_approve"
        return "ask"

    figures = Evaluation.of_rule(candidate, world["since"], world["until"], save=False).figures
    expected = _expected(world["specs"], action_of, lambda s: 2 if s.channel == "payments" else 0)
    assert expected["refused_approved"] and expected["quorum_short"]
    _check(figures, expected, world["specs"])
    assert sorted(c["card"] for c in figures["quorum_short"]["cards"]) == expected["quorum_short"]
    assert not Evaluation.objects.exists()  # save=False


def test_an_empty_period_is_a_clear_error_and_saves_nothing(world):
    since = world["since"] - timedelta(days=400)
    with pytest.raises(EmptyPeriod, match="no card was decided by a person"):
        Evaluation.of_rule({"otherwise": "ask"}, since, since + timedelta(days=1))
    assert not Evaluation.objects.exists()
    assert not AuditEntry.objects.filter(action="evaluation.create").exists()


@pytest.mark.parametrize(
    ("candidate", "path"),
    [
        ("{not json", "$: not valid JSON"),
        ("[]", "$: must be an object"),
        ({"rules": [{"if": {"chanel": "payments"}, "then": "ask"}]}, "$.rules[0].if.chanel: unknown key"),
        ({"rules": [{"if": {}, "then": "approve"}]}, "$.rules[0].then: unknown action 'approve'"),
        ({"rules": [{"if": {"amount_below": "50"}, "then": "refuse"}]}, "$.rules[0].if.amount_below: must be"),
        ({"rules": [{"if": {"risk": "extreme"}, "then": "refuse"}]}, "$.rules[0].if.risk: unknown value"),
        ({"rules": [{"if": {"channel": 3}, "then": "refuse"}]}, "$.rules[0].if.channel: must be a string"),
        ({"rules": {}}, "$.rules: must be a list"),
        ({"rules": [{"if": {}}]}, "$.rules[0].then: required"),
        ({"otherwise": "ask", "quorum": {"approvers": 0}}, "$.quorum.approvers"),
        ({"otherwise": "ask", "colour": "red"}, "$.colour: unknown key"),
        ({}, "a candidate needs rules"),
    ],
)
def test_an_invalid_candidate_names_its_path_and_saves_nothing(db, candidate, path):
    with pytest.raises(CandidateInvalid) as caught:
        Evaluation.of_rule(candidate, timezone.now() - timedelta(days=30), timezone.now())
    assert any(error.startswith(path) or path in error for error in caught.value.errors), caught.value.errors
    assert not Evaluation.objects.exists()


def test_a_card_without_an_amount_never_matches_an_amount_condition():
    candidate = Candidate.parse({"rules": [{"if": {"amount_at_least": 0}, "then": "refuse"}]})
    no_amount = type("Card", (), {"amount_minor": None, "channel": "x"})()
    assert candidate.action_for(no_amount) == "ask"


# --- the command ----------------------------------------------------------------------------------------------


def test_the_command_evaluates_the_shorthand_saves_and_prints_json(world, capsys):
    call_command(
        "evaluate",
        "--auto-approve-under",
        str(AUTO_UNDER),
        "--channel",
        "payments",
        "--currency",
        "EUR",
        "--since",
        world["since"].isoformat(),
        "--json",
    )
    printed = json.loads(capsys.readouterr().out)
    _check(printed["figures"], _expected(world["specs"], _auto_under), world["specs"])
    saved = Evaluation.objects.get()
    assert printed["id"] == saved.pk and saved.name == "auto-approve under 5000 EUR on payments"
    assert AuditEntry.objects.filter(action="evaluation.create", actor="system").count() == 1


def test_the_command_reads_a_rule_file_and_prints_a_summary_without_saving(world, tmp_path, capsys):
    rule = tmp_path / "rule.json"
    rule.write_text(json.dumps({"name": "refuse high risk", "rules": [{"if": {"risk": "high"}, "then": "refuse"}]}))
    call_command("evaluate", "--rule", str(rule), "--since", "30d", "--no-save")
    out = capsys.readouterr().out
    assert "refuse high risk" in out and "Agreement:" in out and "Time saved:" in out
    assert not Evaluation.objects.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rule", '{"rules": [{"then": "yes"}]}', "--since", "30d"], "$.rules[0].then: unknown action"),
        (["--rule", "/no/such/file.json", "--since", "30d"], "cannot read"),
        (["--since", "30d"], "give one candidate"),
        (["--auto-approve-under", "5", "--since", "yesterday"], "neither an age"),
        (["--auto-approve-under", "5", "--since", "2000-01-01", "--until", "2000-01-02"], "no card was decided"),
        (["--rule", '{"otherwise": "ask"}', "--channel", "email", "--since", "30d"], "go with --auto-approve-under"),
    ],
)
def test_the_command_refuses_bad_input_and_saves_nothing(world, args, message):
    with pytest.raises(CommandError) as caught:
        call_command("evaluate", *args)
    assert message in str(caught.value)
    assert not Evaluation.objects.exists()


# --- the API --------------------------------------------------------------------------------------------------


def _bearer(user) -> dict:
    return {"Authorization": f"Bearer {ApiToken.issue(user)[1]}"}


def test_ops_evaluate_through_the_api_and_read_it_back(world, client, carol):
    rule = {"if": {"channel": "payments", "currency": "EUR", "amount_below": 5000}, "then": "auto_approve"}
    body = {"candidate": {"rules": [rule]}, "since": world["since"].isoformat(), "name": "api run"}
    headers = _bearer(carol)
    response = client.post("/api/evaluations", body, content_type="application/json", headers=headers)
    assert response.status_code == 201, response.content
    made = response.json()
    _check(made["figures"], _expected(world["specs"], _auto_under), world["specs"])
    assert made["created_by"] == "carol" and made["name"] == "api run"
    listed = client.get("/api/evaluations", headers=headers).json()
    assert [e["id"] for e in listed] == [made["id"]] and listed[0]["headline"]["dangerous"] == len(
        made["figures"]["dangerous"]["cards"]
    )
    one = client.get(f"/api/evaluations/{made['id']}", headers=headers).json()
    assert one["figures"] == made["figures"]


@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        ({"candidate": {"rules": [{"if": {"amount": 5}, "then": "ask"}]}, "since": "30d"}, 400, "$.rules[0].if.amount"),
        ({"candidate": {"otherwise": "ask"}, "since": "soon"}, 400, "neither an age"),
        ({"candidate": {"otherwise": "ask"}, "since": "2000-01-01", "until": "2000-02-01"}, 409, "no card was decided"),
    ],
)
def test_the_api_refuses_bad_input_and_saves_nothing(world, client, carol, body, status, detail):
    response = client.post("/api/evaluations", body, content_type="application/json", headers=_bearer(carol))
    assert response.status_code == status
    assert detail in json.dumps(response.json()["detail"])
    assert not Evaluation.objects.exists()


def test_reviewers_and_outsiders_get_404_from_the_api(world, client, bob, dave):
    evaluation = Evaluation.of_rule({"otherwise": "ask"}, world["since"], world["until"])
    for user in (bob, dave):
        headers = _bearer(user)
        assert client.get("/api/evaluations", headers=headers).status_code == 404
        assert client.get(f"/api/evaluations/{evaluation.pk}", headers=headers).status_code == 404
        body = {"candidate": {"otherwise": "ask"}, "since": "30d"}
        response = client.post("/api/evaluations", body, content_type="application/json", headers=headers)
        assert response.status_code == 404
    assert Evaluation.objects.count() == 1


# --- the pages ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("user", "status"), [("alice", 200), ("carol", 200), ("bob", 404), ("dave", 404)])
def test_who_sees_the_evaluations(world, client, request, user, status):
    evaluation = Evaluation.of_rule({"otherwise": "ask"}, world["since"], world["until"])
    client.force_login(request.getfixturevalue(user))
    assert client.get("/evaluations/").status_code == status
    assert client.get(f"/evaluations/{evaluation.pk}/").status_code == status
    if status == 200:
        assert b'href="/evaluations/"' in client.get("/dashboard/").content  # in the nav


def test_the_page_shows_the_chart_and_the_dangerous_cards(world, client, carol):
    candidate = {"rules": [{"if": {"channel": "payments", "amount_below": AUTO_UNDER}, "then": "auto_approve"}]}
    evaluation = Evaluation.of_rule(candidate, world["since"], world["until"])
    client.force_login(carol)
    page = client.get(f"/evaluations/{evaluation.pk}/").content.decode()
    assert "<svg" in page and 'class="outcome-rejected"' in page
    for card in evaluation.figures["dangerous"]["cards"]:
        assert f'data-card="{card["card"]}"' in page
    assert f'data-figure="dangerous">{evaluation.figures["dangerous"]["count"]}<' in page


def test_two_evaluations_side_by_side(world, client, carol):
    a = Evaluation.of_rule({"otherwise": "auto_approve", "name": "approve all"}, world["since"], world["until"])
    b = Evaluation.of_rule({"otherwise": "refuse", "name": "refuse all"}, world["since"], world["until"])
    client.force_login(carol)
    page = client.get(f"/evaluations/?compare={a.pk}&compare={b.pk}").content.decode()
    assert "evaluations-compared" in page
    assert f'data-dangerous="{a.pk}">{a.figures["dangerous"]["count"]}<' in page
    assert f'data-dangerous="{b.pk}">0<' in page
