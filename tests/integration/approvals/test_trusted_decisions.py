"""What executes is what a person with the right to say yes saw and was allowed to approve: workflow inputs and
proposals are typed, one validator checks every edit (card form, API, bulk), the two-person rule counts
approvals given after the last change, and the demo never auto-approves on the model's output alone."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

import tests.workflows  # noqa: F401 - registers test_float_gate
from approvals.models import Approval, Decision
from core.models import Channel
from demo import sandbox
from demo.model import ScriptedModel
from runs import submission
from runs.gates import ApprovalRequest
from runs.models import Run
from runs.workflow import Display, Workflow, register
from tests.engine_helpers import REFUND, SMALL_REFUND, drive
from tests.integration.approvals.test_api_approvals import bearer, decide, snapshot


@pytest.fixture
def demo(demo, rita):
    """The demo's users and Rita."""
    return {**demo, "rita": rita}


def parked_refund(amount_cents: int = 12_500) -> tuple[Run, Approval]:
    run = drive(submission.submit(workflow="refund", input={**REFUND, "amount_cents": amount_cents})[0])
    assert run.status == Run.Status.WAITING_HUMAN
    return run, Approval.objects.get(run=run)


def edited(card: Approval, **changes) -> dict:
    payload = json.loads(json.dumps(card.proposed))
    for path, value in changes.items():
        section, key = path.split("__")
        payload[section][key] = value
    return payload


# --- workflow input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"amount_cents": "12500"}, "input.amount_cents"),  # text is not a number
        ({"amount_cents": -5}, "input.amount_cents"),
        ({"amount_cents": 10**30}, "input.amount_cents"),
        ({"amount_cents": True}, "input.amount_cents"),
        ({"currency": "ZZZ"}, "input.currency"),
        ({"customer_id": ""}, "input.customer_id"),
        ({"surprise": 1}, "input.surprise"),
    ],
)
def test_it_refuses_a_run_whose_input_does_not_fit_the_workflow(client, demo, change, field):
    body = {"workflow": "refund", "input": {**REFUND, **change}}
    response = client.post(
        "/api/runs", data=json.dumps(body), content_type="application/json", headers=bearer(demo["agent"])
    )
    assert response.status_code == 422, response.content
    # The field is named (by the workflow's schema, or by the API's parser for numbers beyond 2**53).
    assert any(field.split(".")[-1] in str(error["loc"]) for error in response.json()["detail"])
    assert not Run.objects.exists()


def test_fault_injection_is_refused_and_never_honoured_outside_development(client, demo, settings):
    settings.DEMO_FAULTS_ENABLED = False  # what CONSOLE_ENV=production sets
    body = {"workflow": "refund", "input": {**REFUND, "faults": {"issue_refund": ["hang"]}}}
    response = client.post(
        "/api/runs", data=json.dumps(body), content_type="application/json", headers=bearer(demo["agent"])
    )
    assert response.status_code == 422 and "input.faults" in [e["loc"] for e in response.json()["detail"]]
    # A run already stored with faults (from before) is not slowed down by them either.
    run = Run.objects.create(workflow="refund", workflow_version=1, input={**SMALL_REFUND, "faults": {"x": ["hang"]}})
    assert sandbox.next_fault(run, "payments", "x") == "ok"


def test_the_openapi_document_shows_each_workflows_input_schema(client, demo):
    document = client.get("/api/openapi.json").json()
    operation = document["paths"]["/api/runs"]["post"]
    refund = operation["x-workflow-input-schemas"]["refund"]
    assert set(refund["required"]) == {"customer_id", "amount_cents", "currency", "reason"}


# --- one validator for every edit -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field", "in_the_form"),
    [
        # Fields the card form does not even offer (customer, recipient): only the API could send them.
        ({"refund__customer_id": "cus_other"}, "refund.customer_id", False),
        ({"email__to": "attacker@example.com"}, "email.to", False),
        ({"refund__amount_cents": "100"}, "refund.amount_cents", False),  # the form's field parses text
        # Fields it offers, with values it refuses.
        ({"refund__amount_cents": -500_000}, "refund.amount_cents", True),
        ({"refund__amount_cents": 0}, "refund.amount_cents", True),
        ({"refund__amount_cents": 12_501}, "refund.amount_cents", True),  # more than proposed
        ({"refund__currency": "ZZZ"}, "refund.currency", True),
        ({"email__subject": ""}, "email.subject", True),
    ],
)
def test_every_edit_the_card_refuses_the_api_refuses_and_the_card_stays_pending(
    client, demo, changes, field, in_the_form
):
    run, card = parked_refund()
    before = snapshot(card)
    response = decide(client, demo["reviewer"], card, decision="edit", comment="", payload=edited(card, **changes))
    assert response.status_code == 422, response.content
    assert field in [error["loc"] for error in response.json()["detail"]]
    assert snapshot(card) == before
    if in_the_form:
        client.force_login(demo["reviewer"])
        form = {f"p:{path}": value for path, value in _leaves(edited(card, **changes)).items()}
        page = client.post(f"/approvals/{card.pk}/decide", {"decision": "edit", "version": card.version, **form})
        assert page.status_code == 422 and snapshot(card) == before


def _leaves(value: dict, prefix: str = "") -> dict:
    out = {}
    for key, item in value.items():
        path = f"{prefix}.{key}" if prefix else key
        out.update(_leaves(item, path) if isinstance(item, dict) else {path: item})
    return out


@pytest.mark.parametrize("payload", [{"email": {}}, {"refund": None}, {}, {"refund": {}, "email": {}, "x": 1}])
def test_an_edit_without_the_proposals_shape_is_refused(client, demo, payload):
    run, card = parked_refund()
    before = snapshot(card)
    response = decide(client, demo["reviewer"], card, decision="edit", comment="", payload=payload)
    assert response.status_code == 422 and snapshot(card) == before


def test_an_allowed_edit_is_what_executes(client, demo):
    run, card = parked_refund()
    payload = edited(card, refund__amount_cents=9_000, email__subject="Part of your refund")
    response = decide(client, demo["reviewer"], card, decision="edit", comment="partial", payload=payload)
    assert response.status_code == 200, response.content
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED
    assert run.steps.get(name="issue_refund").output["amount_cents"] == 9_000


def test_a_budget_edit_is_bounded_by_the_spent_cost_and_the_ceiling(client, demo, settings):
    settings.BUDGET_CEILING = 5
    run = drive(submission.submit(workflow="refund", input=SMALL_REFUND, cost_limit="0.000001")[0])
    card = Approval.objects.get(run=run, kind="budget")
    before = snapshot(card)
    for limit in ["0", "6", "abc", "NaN", "-1", 4.5]:
        response = decide(client, demo["reviewer"], card, decision="edit", comment="", payload={"cost_limit": limit})
        assert response.status_code == 422, limit
    assert snapshot(card) == before
    response = decide(client, demo["reviewer"], card, decision="edit", comment="", payload={"cost_limit": "4.5"})
    assert response.status_code == 200


def test_a_reconcile_card_is_not_edited(client, demo):
    run, _ = submission.submit(workflow="refund", input={**SMALL_REFUND, "faults": {"notify_customer": ["timeout"]}})
    with pytest.raises(Exception):  # noqa: B017 - the ambiguous write, retried by the job
        drive(run)
    run = drive(run, attempts=1)
    card = Approval.objects.get(run=run, kind="reconcile")
    response = decide(client, demo["reviewer"], card, decision="edit", comment="", payload={"receipt": "x"})
    assert response.status_code == 422


@pytest.mark.parametrize("number", [1e-7, -0.0, 1.5e-300, 0.1, 123456789.123])
def test_an_edit_holding_an_awkward_float_leaves_the_audit_log_verifiable(client, demo, number):
    """jsonb rewrites numbers (1e-07 comes back as 0.0000001): the chain must hash what is stored. (1e16, which
    it also rewrites, is refused at the API, beyond ±2**53: tests/integration/console/test_bad_input.py.)"""
    run = drive(submission.submit(workflow="test_float_gate", input={})[0])
    card = Approval.objects.get(run=run)
    response = decide(client, demo["reviewer"], card, decision="edit", comment="", payload={"factor": number})
    assert response.status_code == 200, response.content
    call_command("audit_verify", stdout=StringIO())  # exits non-zero (SystemExit) on an entry it finds altered


# --- the two-person rule with edits -----------------------------------------------------------------------------


@pytest.fixture
def two_person(demo):
    Channel.objects.filter(name="payments").update(required_approvals=2)
    return demo


def test_approve_then_edit_needs_another_approval_of_the_edit(client, two_person):
    run, card = parked_refund()
    assert decide(client, two_person["reviewer"], card, decision="approve", comment="").status_code == 200
    card.refresh_from_db()
    payload = edited(card, refund__amount_cents=100)
    assert decide(client, two_person["rita"], card, decision="edit", comment="", payload=payload).status_code == 200
    card.refresh_from_db()
    assert card.status == "pending"  # rita's edit is approved by nobody but rita
    assert drive(run).status == Run.Status.WAITING_HUMAN and sandbox.stats()["channels"]["payments"] == 0
    # The first reviewer approves the edited proposal: now two people said yes to it.
    assert decide(client, two_person["reviewer"], card, decision="approve", comment="").status_code == 200
    card.refresh_from_db()
    assert card.status == "edited"
    run = drive(run)
    assert run.status == Run.Status.SUCCEEDED and run.steps.get(name="issue_refund").output["amount_cents"] == 100


def test_edit_then_edit_restarts_the_count(client, two_person):
    run, card = parked_refund()
    first = edited(card, refund__amount_cents=5_000)
    assert decide(client, two_person["reviewer"], card, decision="edit", comment="", payload=first).status_code == 200
    card.refresh_from_db()
    second = edited(card, refund__amount_cents=4_000)
    assert decide(client, two_person["rita"], card, decision="edit", comment="", payload=second).status_code == 200
    card.refresh_from_db()
    assert card.status == "pending"
    # Rita cannot approve her own edit; the reviewer can.
    assert decide(client, two_person["rita"], card, decision="approve", comment="").status_code == 409
    assert decide(client, two_person["reviewer"], card, decision="approve", comment="").status_code == 200
    run = drive(run)
    assert run.steps.get(name="issue_refund").output["amount_cents"] == 4_000
    assert run.steps.get(name="approve_refund").output["by"] == "rita, reviewer"


def test_edit_then_approve_completes_with_the_edit(client, two_person):
    run, card = parked_refund()
    payload = edited(card, refund__amount_cents=7_000)
    assert decide(client, two_person["reviewer"], card, decision="edit", comment="", payload=payload).status_code == 200
    card.refresh_from_db()
    assert decide(client, two_person["rita"], card, decision="approve", comment="").status_code == 200
    card.refresh_from_db()
    assert card.status == "edited" and Decision.objects.filter(approval=card).count() == 2
    assert drive(run).steps.get(name="issue_refund").output["amount_cents"] == 7_000


def test_approve_then_edit_through_the_card_page(client, two_person):
    run, card = parked_refund()
    client.force_login(two_person["reviewer"])
    assert client.post(f"/approvals/{card.pk}/decide", {"decision": "approve", "version": card.version}).status_code
    card.refresh_from_db()
    client.force_login(two_person["rita"])
    form = {f"p:{p}": v for p, v in _leaves(edited(card, refund__amount_cents=50)).items()}
    client.post(f"/approvals/{card.pk}/decide", {"decision": "edit", "version": card.version, **form})
    card.refresh_from_db()
    assert card.status == "pending" and card.decisions.count() == 2


# --- auto-decisions ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tamper",
    [
        {"customer_id": "cus_someone_else"},
        {"amount_cents": -100},
        {"amount_cents": 950},  # more than the 900 requested
        {"currency": "USD"},
    ],
)
def test_a_small_refund_whose_draft_does_not_match_the_request_asks_a_person(demo, monkeypatch, tamper):
    draft = ScriptedModel._draft_refund

    def tampered(self, rng, **payload):
        answer = draft(self, rng, **payload)
        answer["refund"].update(tamper)
        return answer

    monkeypatch.setattr(ScriptedModel, "_draft_refund", tampered)
    run = drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    assert run.status == Run.Status.WAITING_HUMAN
    assert Approval.objects.filter(run=run, status="pending").exists()
    assert sandbox.stats()["channels"]["payments"] == 0


def test_a_small_refund_that_matches_the_request_is_approved_by_itself(demo):
    assert drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0]).status == Run.Status.SUCCEEDED


# --- a user's own workflow --------------------------------------------------------------------------------------


class Invoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vendor: StrictStr
    total_cents: StrictInt
    currency: StrictStr
    memo: StrictStr


class InvoiceProposal(BaseModel):
    model_config = ConfigDict(extra="forbid")

    invoice: Invoice


def _memo_only_shorter_totals(proposed: dict, edited: dict) -> list[dict]:
    if not 0 < edited["invoice"]["total_cents"] <= proposed["invoice"]["total_cents"]:
        return [{"loc": "invoice.total_cents", "msg": "must be between 1 and the proposed total"}]
    return []


pay_invoice = register(Workflow("test_pay_invoice"))


@pay_invoice.gate(
    "payments",
    proposal=InvoiceProposal,
    editable=("invoice.total_cents", "invoice.memo"),
    check_edit=_memo_only_shorter_totals,
    display=Display(headline="invoice.vendor", amount_minor="invoice.total_cents", currency="invoice.currency"),
)
def approve_invoice(ctx):
    proposal = {"invoice": {"vendor": "Acme Ltd", "total_cents": 420_000, "currency": "GBP", "memo": "Q3"}}
    return ctx.gate(ApprovalRequest(channel="payments", proposed=proposal, summary="Pay Acme's Q3 invoice"))


def test_a_second_workflows_card_shows_its_headline_and_amount_and_allows_only_its_declared_edits(client, demo):
    run = drive(submission.submit(workflow="test_pay_invoice", input={})[0])
    card = Approval.objects.get(run=run)
    assert (card.headline, card.amount_minor, card.currency) == ("Acme Ltd", 420_000, "GBP")

    client.force_login(demo["reviewer"])
    inbox = client.get("/").content.decode()
    row = inbox.split(f'id="row-{card.pk}"', 1)[1].split("</tr>", 1)[0]
    assert "Acme Ltd" in row and "4,200.00 GBP" in row
    page = client.get(f"/approvals/{card.pk}/").content.decode()
    assert 'name="p:invoice.total_cents"' in page and 'name="p:invoice.memo"' in page
    assert 'name="p:invoice.vendor"' not in page  # shown, not editable

    before = snapshot(card)
    other_vendor = {"invoice": {**card.proposed["invoice"], "vendor": "Evil Corp"}}
    assert decide(client, demo["reviewer"], card, decision="edit", comment="", payload=other_vendor).status_code == 422
    more = {"invoice": {**card.proposed["invoice"], "total_cents": 500_000}}
    assert decide(client, demo["reviewer"], card, decision="edit", comment="", payload=more).status_code == 422
    assert snapshot(card) == before
    fine = {"invoice": {**card.proposed["invoice"], "memo": "Q3, less the credit note", "total_cents": 400_000}}
    assert decide(client, demo["reviewer"], card, decision="edit", comment="", payload=fine).status_code == 200
