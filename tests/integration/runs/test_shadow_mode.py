"""Shadow mode (issue 12): for a pilot's first weeks the agent recommends and the person does it. Cards are marked
shadow, effects are recorded and never reach the external systems, reviewers record what they did by hand and
whether they agree with the agent, and the dashboard shows the agreement rate per workflow and rule."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import Approval, Decision
from core.models import ApiToken, AuditEntry, Channel
from demo import sandbox
from runs import submission
from runs.models import Receipt, Run, ShadowEffect
from tests.engine_helpers import REFUND, SMALL_REFUND, drive

HTMX = {"HX-Request": "true"}


@pytest.fixture
def reviewer(client, demo):
    client.force_login(demo["reviewer"])
    return demo["reviewer"]


@pytest.fixture
def shadow_refunds(settings):
    settings.SHADOW_WORKFLOWS = frozenset({"refund"})


def shadow_channel(name: str, on: bool = True) -> None:
    Channel.objects.filter(name=name).update(shadow=on)


def park(demo, input: dict = REFUND) -> Approval:
    run = drive(submission.submit(workflow="refund", input=input, created_by=demo["agent"])[0])
    assert run.status == Run.Status.WAITING_HUMAN
    return Approval.objects.get(run=run)


def decide(client, card: Approval, **data):
    data.setdefault("version", card.version)
    return client.post(f"/approvals/{card.pk}/decide", data, headers=HTMX)


def api_decide(client, user, card: Approval, **body):
    _, raw = ApiToken.issue(user)
    return client.post(
        f"/api/approvals/{card.pk}/decision",
        data=json.dumps({"version": card.version, **body}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {raw}"},
    )


def sent() -> dict:
    return sandbox.stats()["channels"]


# --- effects ---------------------------------------------------------------------------------------------------


def test_it_a_shadow_card_done_by_hand_stays_shadow_when_the_channel_goes_live_before_its_effect(
    demo, client, reviewer
):
    shadow_channel("payments")
    card = park(demo)
    assert card.shadow
    response = decide(client, card, decision="approve", agreement="agree", done_by_hand="Refunded in Stripe by hand")
    assert response.status_code == 200
    shadow_channel("payments", on=False)  # the pilot goes live between the decision and the effect
    run = drive(Run.objects.get(pk=card.run_id))
    assert run.status == Run.Status.SUCCEEDED
    assert sent()["payments"] == 0  # the person did it by hand: it is not done again
    assert ShadowEffect.objects.filter(run=run, channel="payments").count() == 1


def test_it_a_live_card_approved_stays_live_if_the_channel_goes_shadow_first(demo, client, reviewer):
    card = park(demo)
    assert not card.shadow
    assert decide(client, card, decision="approve").status_code == 200
    shadow_channel("payments")  # shadow mode switched on between the decision and the effect
    run = drive(Run.objects.get(pk=card.run_id))
    assert run.status == Run.Status.SUCCEEDED
    assert sent()["payments"] == 1  # what a person approved live is done, not silently dropped
    assert not ShadowEffect.objects.filter(run=run, channel="payments").exists()


def test_it_a_shadow_run_never_reaches_the_external_systems(client, reviewer, demo, shadow_refunds):
    card = park(demo)
    assert card.shadow

    response = decide(client, card, decision="approve", agreement="agree", done_by_hand="Refunded in Stripe by hand")
    assert response.status_code == 200
    run = drive(Run.objects.get(pk=card.run_id))

    assert run.status == Run.Status.SUCCEEDED
    assert sent()["payments"] == 0 and sent()["email"] == 0
    effects = {e.step: e for e in ShadowEffect.objects.filter(run=run)}
    assert set(effects) == {"issue_refund", "notify_customer"}
    assert effects["issue_refund"].channel == "payments"
    assert effects["issue_refund"].preview == {
        "call": "payments.refund",
        "customer_id": "cus_1042",
        "amount_cents": 12_500,
        "currency": "EUR",
    }
    assert effects["notify_customer"].preview["call"] == "email.send"
    assert effects["notify_customer"].preview["to"] == card.proposed["email"]["to"]
    # The run went on with placeholder answers, kept by done receipts.
    for step in ("issue_refund", "notify_customer"):
        key = effects[step].key
        output = run.steps.get(name=step).output
        assert output == {"shadow": True, "id": f"shadow:{key}"}
        receipt = Receipt.objects.get(key=key)
        assert receipt.status == Receipt.Status.DONE and receipt.external_id == f"shadow:{key}"


def test_it_driving_a_finished_shadow_run_again_records_nothing_more(client, reviewer, demo, shadow_refunds):
    card = park(demo)
    decide(client, card, decision="approve", agreement="agree")
    run = drive(Run.objects.get(pk=card.run_id))
    assert run.status == Run.Status.SUCCEEDED
    drive(run)
    assert ShadowEffect.objects.count() == 2 and Receipt.objects.count() == 2
    assert sent()["payments"] == 0


def test_it_an_auto_approved_shadow_run_records_its_effects_too(demo, shadow_refunds):
    run = drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    assert run.status == Run.Status.SUCCEEDED and not Approval.objects.exists()
    assert ShadowEffect.objects.filter(run=run).count() == 2
    assert sent() == {"payments": 0, "email": 0, "crm": 1}  # reads are not effects: the agent still reads


def test_it_a_shadow_channel_keeps_its_own_effects_only(client, demo):
    shadow_channel("payments")
    card = park(demo)
    assert card.shadow
    response = api_decide(client, demo["reviewer"], card, decision="approve", agreement="agree")
    assert response.status_code == 200 and response.json()["shadow"] is True
    run = drive(Run.objects.get(pk=card.run_id))

    assert run.status == Run.Status.SUCCEEDED
    assert sent()["payments"] == 0 and sent()["email"] == 1  # email is not in shadow: the customer is told
    assert list(ShadowEffect.objects.values_list("channel", flat=True)) == ["payments"]


def test_it_a_channel_not_in_shadow_is_unaffected(client, reviewer, demo):
    card = park(demo)
    assert not card.shadow
    assert decide(client, card, decision="approve").status_code == 200
    run = drive(Run.objects.get(pk=card.run_id))
    assert run.status == Run.Status.SUCCEEDED
    assert sent() == {"payments": 1, "email": 1, "crm": 1}
    assert not ShadowEffect.objects.exists()
    assert not Decision.objects.exclude(agreement="").exists()


def test_it_turning_shadow_off_makes_new_effects_real(client, reviewer, demo, settings):
    settings.SHADOW_WORKFLOWS = frozenset({"refund"})
    first = drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    assert first.status == Run.Status.SUCCEEDED and sent()["payments"] == 0

    card = park(demo)  # opened in shadow: it stays a shadow card
    settings.SHADOW_WORKFLOWS = frozenset()
    assert decide(client, card, decision="approve", agreement="agree").status_code == 200
    run = drive(Run.objects.get(pk=card.run_id))

    assert run.status == Run.Status.SUCCEEDED
    # The payment the shadow card authorized follows the card (the reviewer did it by hand); the email, which no
    # card authorized, came after the switch: real.
    assert sent()["payments"] == 0 and sent()["email"] == 1
    assert list(ShadowEffect.objects.filter(run=run).values_list("channel", flat=True)) == ["payments"]
    assert ShadowEffect.objects.filter(run=first).count() == 2  # what was shadowed stays a record

    later = drive(submission.submit(workflow="refund", input={**SMALL_REFUND, "customer_id": "cus_2"})[0])
    assert later.status == Run.Status.SUCCEEDED and sent()["payments"] == 1  # a new run's effects are real


def test_it_turning_a_channel_out_of_shadow_makes_its_new_effects_real(demo):
    shadow_channel("payments")
    drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    assert sent()["payments"] == 0 and sent()["email"] == 1

    shadow_channel("payments", on=False)
    later = drive(submission.submit(workflow="refund", input={**SMALL_REFUND, "customer_id": "cus_2"})[0])
    assert later.status == Run.Status.SUCCEEDED and sent()["payments"] == 1
    assert not ShadowEffect.objects.filter(run=later).exists()


def test_it_kill_switches_still_stop_shadow_effects(demo, shadow_refunds):
    payments = Channel.objects.get(name="payments")
    payments.engage_kill_switch(demo["ops"], "incident")
    run = drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    assert run.status == Run.Status.PAUSED and not ShadowEffect.objects.exists()

    payments.release_kill_switch(demo["ops"], "all clear")
    run = drive(Run.objects.get(pk=run.pk))
    assert run.status == Run.Status.SUCCEEDED
    assert ShadowEffect.objects.filter(run=run).count() == 2 and sent()["payments"] == 0


def test_it_a_shadow_effect_cut_off_before_its_receipt_completes_finishes_without_asking(
    demo, shadow_refunds, monkeypatch
):
    """The worker stops between the receipt (with its shadow record) and its completion: nothing was sent, so the
    next attempt completes it, with no lookup and no reconcile card."""
    real_complete = Receipt.complete
    cut = []

    def complete_once_cut(self, response, **kwargs):
        if self.channel == "payments" and not cut:
            cut.append(self.key)
            raise ConnectionError("worker lost its database connection")
        return real_complete(self, response, **kwargs)

    monkeypatch.setattr(Receipt, "complete", complete_once_cut)
    run, _ = submission.submit(workflow="refund", input=SMALL_REFUND)
    with pytest.raises(ConnectionError):
        drive(run)
    assert Receipt.objects.get(key=cut[0]).status == Receipt.Status.PENDING

    run = drive(Run.objects.get(pk=run.pk), attempts=1)
    assert run.status == Run.Status.SUCCEEDED
    assert Receipt.objects.get(key=cut[0]).status == Receipt.Status.DONE
    assert not Approval.objects.exists() and sent()["payments"] == 0
    assert ShadowEffect.objects.filter(key=cut[0]).count() == 1


# --- cards -----------------------------------------------------------------------------------------------------


def test_it_marks_shadow_cards_on_the_card_page_and_in_the_inbox(client, reviewer, demo, shadow_refunds):
    shadow = park(demo)
    page = client.get(f"/approvals/{shadow.pk}/").content.decode()
    assert 'class="card-shadow badge shadow"' in page and ">Shadow</span>" in page
    assert "Shadow mode: the console does not do this action" in page
    assert 'name="agreement" value="agree"' in page and 'name="done_by_hand"' in page
    assert "I did it as proposed" in page and "I did not do it" in page

    inbox = client.get("/").content.decode()
    row = re.search(rf'<tr class="card-row[^"]*" id="row-{shadow.pk}".*?</tr>', inbox, re.S).group(0)
    assert '<span class="badge shadow"' in row


def test_it_does_not_mark_other_cards(client, reviewer, demo):
    card = park(demo)
    page = client.get(f"/approvals/{card.pk}/").content.decode()
    assert "badge shadow" not in page and 'name="agreement"' not in page
    assert "badge shadow" not in client.get("/").content.decode()


def test_it_records_and_audits_the_reviewers_agreement(client, reviewer, demo, shadow_refunds):
    card = park(demo)
    response = decide(
        client, card, decision="approve", agreement="disagree", done_by_hand="Refunded half: the box was opened"
    )
    assert response.status_code == 200

    decision = Decision.objects.get(approval=card)
    assert (decision.decision, decision.agreement, decision.done_by_hand) == (
        "approve",
        "disagree",
        "Refunded half: the box was opened",
    )
    entry = AuditEntry.objects.get(action="approval.approve", approval_id=card.pk)
    assert entry.actor == "reviewer"
    assert entry.data["shadow"] is True and entry.data["agreement"] == "disagree"
    assert entry.data["done_by_hand"] == "Refunded half: the box was opened"
    page = client.get(f"/approvals/{card.pk}/").content.decode()
    assert "I disagree with the agent" in page and "What they did: Refunded half: the box was opened" in page


def test_it_records_an_edit_as_what_was_done_by_hand(client, reviewer, demo, shadow_refunds):
    card = park(demo)
    fields = {
        "p:refund.amount_cents": 6_000,
        "p:refund.currency": "EUR",
        "p:email.subject": card.proposed["email"]["subject"],
        "p:email.body": card.proposed["email"]["body"],
    }
    preview = decide(client, card, decision="edit", preview="1", agreement="disagree", **fields)
    assert preview.status_code == 200
    confirm = preview.content.decode().split('class="card-confirm"', 1)[1].split("</form>", 1)[0]
    assert 'name="agreement" value="disagree" required checked' in confirm  # carried to the confirmation

    assert decide(client, card, decision="edit", agreement="disagree", **fields).status_code == 200
    card.refresh_from_db()
    decision = card.decisions.get()
    assert card.status == Approval.Status.EDITED and decision.agreement == "disagree"
    assert decision.payload["refund"]["amount_cents"] == 6_000
    run = drive(Run.objects.get(pk=card.run_id))
    assert ShadowEffect.objects.get(run=run, step="issue_refund").preview["amount_cents"] == 6_000
    assert sent()["payments"] == 0


def test_it_records_a_rejection_with_its_agreement(client, reviewer, demo, shadow_refunds):
    card = park(demo)
    response = decide(client, card, decision="reject", reason="policy", comment="Not refundable", agreement="disagree")
    assert response.status_code == 200
    assert Decision.objects.get(approval=card).agreement == "disagree"
    run = drive(Run.objects.get(pk=card.run_id))
    assert run.result["outcome"] == "rejected" and not ShadowEffect.objects.exists()


def test_it_refuses_a_shadow_decision_without_the_agreement(client, reviewer, demo, shadow_refunds):
    card = park(demo)
    response = decide(client, card, decision="approve")
    assert response.status_code == 422
    assert "say whether you agree with the agent" in response.content.decode()
    response = api_decide(client, demo["reviewer"], card, decision="approve")
    assert response.status_code == 422
    response = api_decide(client, demo["reviewer"], card, decision="approve", agreement="maybe")
    assert response.status_code == 422
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING and not card.decisions.exists()


def test_it_refuses_an_agreement_on_a_card_not_in_shadow(client, reviewer, demo):
    card = park(demo)
    response = api_decide(client, demo["reviewer"], card, decision="approve", agreement="agree")
    assert response.status_code == 422
    assert "shadow cards only" in response.json()["detail"]
    assert not card.decisions.exists()


def test_it_refuses_a_bulk_approval_of_shadow_cards(client, reviewer, demo, shadow_refunds):
    card = park(demo)
    # A card whose row shows everything that runs, so that the shadow rule is what refuses it (a refund card's
    # email is not in its row: approvals.inbox.row_shows refuses it first).
    proposal = {"refund": {"amount_cents": card.amount_minor, "currency": card.currency}}
    Approval.objects.filter(pk=card.pk).update(proposed=proposal, current=None)
    response = client.post(
        "/approvals/bulk", {"cards": [f"{card.pk}:{card.version}"], "decision": "approve"}, headers=HTMX
    )
    assert response.status_code == 200
    assert f'data-card="{card.pk}" data-status="422"' in response.content.decode()
    assert "say whether you agree" in response.content.decode()
    assert not card.decisions.exists()


# --- the dashboard and /metrics ----------------------------------------------------------------------------------


def _answer(client, card: Approval, agreement: str, rule_id: str) -> None:
    Approval.objects.filter(pk=card.pk).update(rule_id=rule_id)
    assert decide(client, card, decision="approve", agreement=agreement).status_code == 200


def test_it_shows_the_agreement_rate_per_workflow_and_rule(client, demo, shadow_refunds):
    client.force_login(demo["reviewer"])
    for n, (agreement, rule) in enumerate(
        [("agree", "R-damaged"), ("disagree", "R-damaged"), ("agree", "R-damaged"), ("agree", "R-late")]
    ):
        _answer(client, park(demo, {**REFUND, "customer_id": f"cus_{n}"}), agreement, rule)
    park(demo, {**REFUND, "customer_id": "cus_open"})  # an open card has no answer yet
    not_shadow = Approval.objects.create(
        run=submission.submit(workflow="refund", input={**REFUND, "customer_id": "cus_x"})[0],
        step_seq=3,
        channel=Channel.objects.get(name="payments"),
        proposed={},
        rule_id="R-damaged",
        args_hash="x",
        due_at=timezone.now() + timedelta(hours=1),
    )
    not_shadow.decide(demo["reviewer"], "approve")

    client.force_login(demo["ops"])
    page = client.get("/dashboard/").content.decode()
    damaged = re.search(r'<tr data-shadow="refund:R-damaged">(.*?)</tr>', page, re.S).group(1)
    assert re.findall(r"<td[^>]*>([^<]*)</td>", damaged) == ["refund", "R-damaged", "3", "2", "1", "67%"]
    late = re.search(r'<tr data-shadow="refund:R-late">(.*?)</tr>', page, re.S).group(1)
    assert re.findall(r"<td[^>]*>([^<]*)</td>", late) == ["refund", "R-late", "1", "1", "0", "100%"]

    metrics = client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode()
    assert 'hitl_shadow_agreement_ratio{rule="R-damaged",workflow="refund"} 0.6666666666666666' in metrics
    assert 'hitl_shadow_agreement_ratio{rule="R-late",workflow="refund"} 1.0' in metrics
    assert 'hitl_shadow_answers_total{agreement="disagree",rule="R-damaged",workflow="refund"} 1.0' in metrics


def test_it_counts_the_effects_shadow_mode_kept(client, demo, shadow_refunds):
    drive(submission.submit(workflow="refund", input=SMALL_REFUND)[0])
    client.force_login(demo["ops"])
    assert "effects recorded instead of sent: email 1, payments 1." in client.get("/dashboard/").content.decode()
    metrics = client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode()
    assert 'hitl_shadow_effects_total{channel="payments"} 1.0' in metrics


def test_it_lets_admins_put_a_channel_in_shadow(client, demo):
    client.force_login(demo["admin"])
    channel = Channel.objects.get(name="payments")
    url = f"/admin/core/channel/{channel.pk}/change/"
    form = client.get(url).context["adminform"].form
    data = {name: form[name].value() for name in form.fields if form[name].value() is not None}
    data.update(shadow="on", sla="01:00:00")
    response = client.post(url, data)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Channel.objects.get(name="payments").shadow
    entry = AuditEntry.objects.get(action="channel.change")
    assert entry.data["changed"]["shadow"] == {"before": False, "after": True}
