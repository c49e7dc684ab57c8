"""Decisions from email: the escalation email's Approve and Reject links (approvals.links). The links open the card
after the console's login with the choice pre-selected; only the card's own decide form decides; a link works
once, for its recipient, while its card is open and before its deadline; every refusal changes nothing."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.core import mail
from django.core.mail import EmailMultiAlternatives
from django.test import Client
from django.utils import formats, timezone
from guardian.shortcuts import assign_perm, remove_perm

from approvals import links, sla
from approvals.errors import LinkRefused
from approvals.models import Approval, Decision, DecisionLink, Notification
from approvals.tasks import send_notification
from core.models import AuditEntry, Channel
from runs import submission
from runs.models import Run
from tests.engine_helpers import REFUND, drive

SECOND = timedelta(seconds=1)
CONSOLE = "https://console.example.com"
LINK = re.compile(r"^(Approve|Reject): (\S+)$", re.MULTILINE)


@pytest.fixture
def leads(demo, settings):
    """The payments channel escalates to `payments-leads`: Lena and Mia, who may approve payments, and Noah, a
    member who may not (the group says who is told, approve_channel who may decide)."""
    settings.NOTIFY_BACKENDS = ["email"]
    settings.CONSOLE_URL = CONSOLE
    group = Group.objects.create(name="payments-leads")
    payments = Channel.objects.get(name="payments")
    Channel.objects.filter(pk=payments.pk).update(escalation_policy="escalate", escalation_group=group)
    people = {}
    for name in ("lena", "mia", "noah"):
        people[name] = User.objects.create_user(name, email=f"{name}@example.com", password="password")
        people[name].groups.add(group)
        if name != "noah":
            assign_perm("core.approve_channel", people[name], payments)
    return people


def escalate(created_by=None) -> Approval:
    run = drive(submission.submit(workflow="refund", input=REFUND, created_by=created_by)[0])
    card = Approval.objects.get(run=run)
    assert sla.apply_sla(card.pk, card.due_at + SECOND) == "escalate"
    card.refresh_from_db()
    assert send_notification(notification_id=Notification.objects.get(approval=card).pk) == "sent"
    return card


def email_links(to: str) -> dict[str, str]:
    """The paths of the Approve and Reject links in the email sent to `to`."""
    (message,) = [m for m in mail.outbox if m.to == [to]]
    found = {kind.lower(): url for kind, url in LINK.findall(message.body)}
    assert set(found) == {"approve", "reject"}
    assert all(url.startswith(CONSOLE + "/approvals/email/") for url in found.values())
    return {kind: url.removeprefix(CONSOLE) for kind, url in found.items()}


def token_of(path: str) -> str:
    return path.removeprefix("/approvals/email/").rstrip("/")


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def unchanged(card: Approval) -> None:
    """Nothing happened to the card: still escalated, no decision, no decision audited, every link unused."""
    card.refresh_from_db()
    assert card.status == Approval.Status.ESCALATED and card.decided_at is None
    assert not Decision.objects.filter(approval=card).exists()
    assert not AuditEntry.objects.filter(approval_id=card.pk, action__startswith="approval.").exists()
    assert not DecisionLink.objects.filter(approval=card, used_at__isnull=False).exists()
    assert Run.objects.get(pk=card.run_id).status == Run.Status.WAITING_HUMAN


def decide(client: Client, card: Approval, path: str, decision: str = "approve", **fields):
    data = {"decision": decision, "version": card.version, "link": token_of(path), **fields}
    return client.post(f"/approvals/{card.pk}/decide", data)


# --- the email ---------------------------------------------------------------------------------------------------


def test_it_emails_each_recipient_their_own_approve_and_reject_links(leads):
    card = escalate()

    assert sorted(m.to[0] for m in mail.outbox) == ["lena@example.com", "mia@example.com", "noah@example.com"]
    lena, mia = email_links("lena@example.com"), email_links("mia@example.com")
    assert len({*lena.values(), *mia.values()}) == 4  # one link per recipient per decision
    message = next(m for m in mail.outbox if m.to == ["lena@example.com"])
    assert f"{CONSOLE}/approvals/{card.pk}/" in message.body
    assert "Nothing is decided until you log in and press the button there." in " ".join(message.body.split())
    card.refresh_from_db()
    deadline = formats.date_format(timezone.localtime(card.due_at), "j M Y, H:i T")
    assert f"New deadline: {deadline}\n" in message.body  # readable, in the console's time zone, not ISO 8601
    (html, mimetype), *_ = message.alternatives
    assert mimetype == "text/html"
    assert f'href="{CONSOLE}{lena["approve"]}"' in html and f'href="{CONSOLE}{lena["reject"]}"' in html

    rows = DecisionLink.objects.filter(approval=card)
    assert rows.count() == 6
    assert {(row.recipient.username, row.decision) for row in rows} == {
        (name, decision) for name in ("lena", "mia", "noah") for decision in ("approve", "reject")
    }
    assert all(row.expires_at == card.due_at and row.emailed_at and row.used_at is None for row in rows)
    assert links.find(token_of(lena["approve"])).recipient == leads["lena"]


def test_the_links_say_what_the_card_calls_its_decisions(leads):
    """A shadow card's approve is "I did it as proposed": the email says so, as the card's buttons do."""
    Channel.objects.filter(name="payments").update(shadow=True)
    card = escalate()
    assert card.shadow
    message = next(m for m in mail.outbox if m.to == ["lena@example.com"])
    assert re.search(r"^I did it as proposed: \S+/approvals/email/\S+$", message.body, re.MULTILINE)
    assert re.search(r"^I did not do it: \S+/approvals/email/\S+$", message.body, re.MULTILINE)
    assert "Approve" not in message.body
    (html, _), *_ = message.alternatives
    assert "I did it as proposed…</a>" in html and "I did not do it…</a>" in html


def test_a_retry_after_a_failure_part_way_mails_only_those_not_mailed_yet(leads, monkeypatch):
    sent, real_send = [], EmailMultiAlternatives.send

    def send_then_fail(message, *args, **kwargs):
        if message.to == ["mia@example.com"] and not sent.count("mia-failed"):
            sent.append("mia-failed")
            raise ConnectionError("the SMTP server went away")
        sent.append(message.to[0])
        return real_send(message, *args, **kwargs)

    monkeypatch.setattr(EmailMultiAlternatives, "send", send_then_fail)
    run = drive(submission.submit(workflow="refund", input=REFUND)[0])
    card = Approval.objects.get(run=run)
    sla.apply_sla(card.pk, card.due_at + SECOND)
    notification = Notification.objects.get(approval=card)
    with pytest.raises(Exception, match="went away"):
        send_notification(notification_id=notification.pk)
    assert [m.to for m in mail.outbox] == [["lena@example.com"]]
    first = email_links("lena@example.com")

    assert send_notification(notification_id=notification.pk) == "sent"
    assert sorted(m.to[0] for m in mail.outbox) == ["lena@example.com", "mia@example.com", "noah@example.com"]
    assert email_links("lena@example.com") == first  # Lena was not mailed twice, and her links still work
    assert DecisionLink.objects.filter(approval=card).count() == 6


# --- opening a link ----------------------------------------------------------------------------------------------


def test_a_logged_out_visitor_goes_through_the_login_and_lands_on_the_card_with_approve_pre_selected(leads):
    card = escalate()
    path = email_links("lena@example.com")["approve"]
    client = Client()

    response = client.get(path)
    assert response.status_code == 302
    assert response["Location"] == f"/accounts/login/?next={path}"
    assert "lena" not in response.content.decode() and str(card.summary) not in response.content.decode()

    response = client.post("/accounts/login/", {"username": "lena", "password": "password", "next": path})
    assert response.status_code == 302 and response["Location"] == path
    response = client.get(path)
    assert response.status_code == 200
    html = response.content.decode()
    assert f'id="card-{card.pk}"' in html
    assert 'class="card-via-link"' in html and 'data-link-decision="approve"' in html
    assert re.search(r'<form class="card-approve card-preselected"', html)
    assert f'<input type="hidden" name="link" value="{token_of(path)}">' in html
    assert html.count('name="link"') == 1  # in the approve form only
    assert '<details class="card-reject">' in html  # the reject form stays closed
    assert response["Cache-Control"].startswith("max-age=0") and "no-store" in response["Cache-Control"]
    unchanged(card)


def test_the_reject_link_opens_the_reject_form(leads):
    card = escalate()
    path = email_links("lena@example.com")["reject"]
    html = logged_in(leads["lena"]).get(path).content.decode()
    assert 'data-link-decision="reject"' in html
    assert '<details class="card-reject" open>' in html
    assert re.search(r'<form class="card-reject-form card-preselected"', html)
    assert f'<input type="hidden" name="link" value="{token_of(path)}">' in html
    assert not re.search(r'<form class="card-approve card-preselected"', html)
    unchanged(card)


def test_opening_decides_nothing_and_uses_nothing_up_however_often(leads):
    """A mail scanner fetches every link of a message, maybe several times, before the person reads it."""
    card = escalate()
    paths = email_links("lena@example.com")
    anonymous, lena = Client(), logged_in(leads["lena"])
    for _ in range(3):
        for path in paths.values():
            assert anonymous.get(path).status_code == 302
            assert anonymous.head(path).status_code in (302, 405)
            assert lena.get(path).status_code == 200
    assert lena.post(paths["approve"]).status_code == 405  # the link's address takes no POST
    unchanged(card)


# --- deciding through it -----------------------------------------------------------------------------------------


def test_approving_through_the_link_decides_uses_it_and_audits_via_email(leads):
    card = escalate()
    paths = email_links("lena@example.com")
    lena = logged_in(leads["lena"])
    assert lena.get(paths["approve"]).status_code == 200

    response = decide(lena, card, paths["approve"])
    assert response.status_code == 302 and response["Location"] == f"/approvals/{card.pk}/"
    card.refresh_from_db()
    assert card.status == Approval.Status.APPROVED
    assert Decision.objects.get(approval=card).actor == leads["lena"]
    assert Run.objects.get(pk=card.run_id).status == Run.Status.QUEUED
    entry = AuditEntry.objects.get(approval_id=card.pk, action="approval.approve")
    assert entry.actor == "lena" and entry.data["via"] == "email"
    link = links.find(token_of(paths["approve"]))
    assert link.used_at is not None
    assert DecisionLink.objects.filter(used_at__isnull=False).count() == 1  # only the one followed


def test_an_htmx_decision_through_the_link_leaves_the_link_for_the_cards_address(leads):
    card = escalate()
    path = email_links("lena@example.com")["approve"]
    response = logged_in(leads["lena"]).post(
        f"/approvals/{card.pk}/decide",
        {"decision": "approve", "version": card.version, "link": token_of(path)},
        headers={"HX-Request": "true"},
    )
    assert response.status_code == 200 and response["HX-Replace-Url"] == f"/approvals/{card.pk}/"
    card.refresh_from_db()
    assert card.status == Approval.Status.APPROVED


def test_rejecting_through_the_link_needs_the_reason_and_comment_as_ever(leads):
    card = escalate()
    path = email_links("lena@example.com")["reject"]
    lena = logged_in(leads["lena"])

    response = decide(lena, card, path, "reject", reason="policy")  # no comment
    assert response.status_code == 422
    html = response.content.decode()
    assert "A rejection needs a comment" in html
    assert f'<input type="hidden" name="link" value="{token_of(path)}">' in html  # kept for the second try
    unchanged(card)

    response = decide(lena, card, path, "reject", reason="policy", comment="Not without the customer's consent.")
    assert response.status_code == 302
    card.refresh_from_db()
    assert card.status == Approval.Status.REJECTED
    entry = AuditEntry.objects.get(approval_id=card.pk, action="approval.reject")
    assert entry.data["via"] == "email" and entry.data["reason"] == "policy"
    assert links.find(token_of(path)).used_at is not None


def test_a_decision_in_the_console_itself_is_not_audited_via_email(leads):
    card = escalate()
    response = logged_in(leads["lena"]).post(f"/approvals/{card.pk}/decide", {"decision": "approve", "version": 1})
    assert response.status_code == 302
    assert "via" not in AuditEntry.objects.get(approval_id=card.pk, action="approval.approve").data
    assert not DecisionLink.objects.filter(used_at__isnull=False).exists()


# --- refused: nothing changes ------------------------------------------------------------------------------------


def test_a_used_link_is_refused_when_opened_or_posted_again(leads):
    Channel.objects.filter(name="payments").update(required_approvals=2)  # the card stays open after one approval
    card = escalate()
    path = email_links("lena@example.com")["approve"]
    lena = logged_in(leads["lena"])
    assert decide(lena, card, path).status_code == 302
    card.refresh_from_db()
    assert card.status == Approval.Status.ESCALATED and card.decisions.count() == 1

    response = lena.get(path)
    assert response.status_code == 410
    assert "This link was already used" in response.content.decode()
    assert f'href="/approvals/{card.pk}/"' in response.content.decode()  # the recipient may go to the card

    response = decide(lena, card, path, "approve")
    assert response.status_code == 410 and "already used" in response.content.decode()
    card.refresh_from_db()
    assert card.decisions.count() == 1
    assert AuditEntry.objects.filter(approval_id=card.pk, action="approval.approve").count() == 1


@pytest.mark.parametrize("how", ["decided", "cancelled", "safe-default"])
def test_a_link_to_a_closed_card_is_refused(leads, how):
    card = escalate()
    path = email_links("lena@example.com")["approve"]
    if how == "decided":
        card.decide(leads["mia"], "approve", version=card.version)
    elif how == "cancelled":
        Run.objects.get(pk=card.run_id).cancel()
    else:
        Channel.objects.filter(name="payments").update(escalation_policy="safe_default")
        card.refresh_from_db()
        assert sla.apply_sla(card.pk, card.due_at + SECOND) == "safe_default"
    card.refresh_from_db()
    before = (card.status, card.version, card.decisions.count(), AuditEntry.objects.count())
    lena = logged_in(leads["lena"])

    response = lena.get(path)
    assert response.status_code == 410
    assert f"This card is already {card.get_status_display().lower()}" in response.content.decode()
    assert decide(lena, card, path).status_code in (409, 410)
    card.refresh_from_db()
    assert (card.status, card.version, card.decisions.count(), AuditEntry.objects.count()) == before
    assert not DecisionLink.objects.filter(used_at__isnull=False).exists()


def test_a_link_past_the_cards_deadline_is_refused(leads):
    card = escalate()
    path = email_links("lena@example.com")["approve"]
    # Time moves by moving the deadline: the card's (whose timer has not fired yet) and so the link's.
    past = timezone.now() - SECOND
    Approval.objects.filter(pk=card.pk).update(due_at=past)
    DecisionLink.objects.filter(approval=card).update(expires_at=past)
    lena = logged_in(leads["lena"])

    response = lena.get(path)
    assert response.status_code == 410 and "This link expired" in response.content.decode()
    assert decide(lena, card, path).status_code == 410
    card.refresh_from_db()
    assert card.status == Approval.Status.ESCALATED and not card.decisions.exists()
    assert not DecisionLink.objects.filter(used_at__isnull=False).exists()


def test_a_link_expires_at_the_deadline_the_card_had_when_it_was_sent(leads):
    card = escalate()
    token = token_of(email_links("lena@example.com")["approve"])
    assert links.check(token, leads["lena"], now=card.due_at - SECOND).expires_at == card.due_at
    with pytest.raises(LinkRefused, match="expired") as refused:
        links.check(token, leads["lena"], now=card.due_at)
    assert refused.value.status == 410


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),
        lambda t: ("0" if t[0] != "0" else "1") + t[1:],
        lambda t: t[:-4],
    ],
    ids=["signature", "id", "cut-short"],
)
def test_a_tampered_link_is_refused(leads, change):
    card = escalate()
    token = change(token_of(email_links("lena@example.com")["approve"]))
    lena = logged_in(leads["lena"])

    response = lena.get(f"/approvals/email/{token}/")
    assert response.status_code == 404
    assert "This link is not valid" in response.content.decode()
    assert f"/approvals/{card.pk}/" not in response.content.decode()
    response = lena.post(f"/approvals/{card.pk}/decide", {"decision": "approve", "version": 1, "link": token})
    assert response.status_code == 404
    unchanged(card)


def test_a_link_carried_to_another_card_or_decision_is_refused(leads):
    card = escalate()
    other = escalate()
    paths = email_links_for(other, "lena@example.com")
    lena = logged_in(leads["lena"])
    assert decide(lena, card, paths["approve"]).status_code == 404  # the link of another card
    assert decide(lena, other, paths["approve"], "reject", reason="policy", comment="no").status_code == 422
    unchanged(card)
    unchanged(other)


def email_links_for(card: Approval, to: str) -> dict[str, str]:
    """The links of the email about `card` sent to `to` (when several cards were escalated)."""
    mine = [m for m in mail.outbox if m.to == [to] and f"/approvals/{card.pk}/\n" in m.body]
    (message,) = mine
    return {kind.lower(): url.removeprefix(CONSOLE) for kind, url in LINK.findall(message.body)}


def test_another_logged_in_user_is_refused(leads):
    card = escalate()
    path = email_links("lena@example.com")["approve"]
    mia = logged_in(leads["mia"])  # she may approve the card, but this link was sent to Lena

    response = mia.get(path)
    assert response.status_code == 403
    assert "This link was sent to someone else" in response.content.decode()
    assert f"/approvals/{card.pk}/" not in response.content.decode()
    assert decide(mia, card, path).status_code == 403
    unchanged(card)
    assert links.check(token_of(path), leads["lena"])  # still good for Lena


def test_a_recipient_without_the_permission_is_refused_by_the_usual_check(leads):
    """Noah is in the escalation group, so he is emailed, but may not approve payments: the link gives him no
    more than the console does (the card is not his to see: 404, as its own page answers)."""
    card = escalate()
    path = email_links("noah@example.com")["approve"]
    noah = logged_in(leads["noah"])
    assert noah.get(path).status_code == 404
    assert decide(noah, card, path).status_code == 404
    unchanged(card)
    assert links.check(token_of(path), leads["noah"])  # the link itself is fine; the console said no


def test_the_runs_creator_opens_the_link_but_may_not_decide(leads):
    """Separation of duties, as ever: Lena started the run, sees its card, and may not decide it (403)."""
    card = escalate(created_by=leads["lena"])
    path = email_links("lena@example.com")["approve"]
    lena = logged_in(leads["lena"])
    response = lena.get(path)
    assert response.status_code == 200
    assert "You started this run: someone else must decide this card." in response.content.decode()
    assert decide(lena, card, path).status_code == 403
    unchanged(card)


def test_a_permission_taken_away_after_opening_refuses_the_decision(leads):
    card = escalate()
    path = email_links("lena@example.com")["approve"]
    lena = logged_in(leads["lena"])
    assert lena.get(path).status_code == 200
    remove_perm("core.approve_channel", leads["lena"], Channel.objects.get(name="payments"))
    assert decide(lena, card, path).status_code == 404
    unchanged(card)


def test_a_link_used_by_another_request_meanwhile_rolls_the_decision_back(leads):
    """The link is checked before the decision and used after it, in its transaction: a request that used it in
    between (checked the same moment, committed first) makes this decision roll back whole."""
    Channel.objects.filter(name="payments").update(required_approvals=2)
    card = escalate()
    path = email_links("lena@example.com")["approve"]
    checked = links.check(token_of(path), leads["lena"], card_id=card.pk, decision="approve")
    DecisionLink.objects.filter(pk=checked.pk).update(used_at=timezone.now())  # the other request's commit

    with pytest.raises(LinkRefused) as refused:
        links.decide_through(checked, card, leads["lena"], "approve", version=card.version)
    assert refused.value.status == 410
    card.refresh_from_db()
    assert card.version == 1 and not card.decisions.exists()
    assert not AuditEntry.objects.filter(approval_id=card.pk, action__startswith="approval.").exists()


def test_django_admin_lists_the_links_read_only(leads, alice):
    card = escalate()
    admin = logged_in(alice)
    response = admin.get("/admin/approvals/decisionlink/")
    assert response.status_code == 200
    html = response.content.decode()
    assert html.count(f'href="/approvals/{card.pk}/"') == 6
    assert "/admin/approvals/decisionlink/add/" not in html
    link = DecisionLink.objects.filter(approval=card).first()
    assert links.token_for(link) not in html
    page = admin.get(f"/admin/approvals/decisionlink/{link.pk}/change/")
    assert page.status_code == 200 and links.token_for(link) not in page.content.decode()
    assert admin.post(f"/admin/approvals/decisionlink/{link.pk}/delete/", {"post": "yes"}).status_code == 403
    assert DecisionLink.objects.filter(pk=link.pk).exists()
