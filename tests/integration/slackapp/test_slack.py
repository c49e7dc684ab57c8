"""Decisions from Slack: cards posted as Block Kit messages (slackapp.posting), clicks on POST /api/slack/interactions
verified with the signing secret and decided through the console's own path (slackapp.interactions).

Slack is a local fake of its Web API (tests/slack_fake.py: slack_sdk's WebClient pointed at it, and the
response_urls); clicks are Slack's documented block_actions payloads signed with a test secret."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from guardian.shortcuts import assign_perm
from procrastinate.contrib.django.models import ProcrastinateJob

from approvals import sla
from approvals.models import Approval, Decision, Notification
from approvals.tasks import send_notification
from core import pii
from core.models import AuditEntry, Channel
from runs import submission
from runs.models import Run
from slackapp import blocks, posting
from slackapp.models import SlackIdentity, SlackMessage, SlackRoute
from tests import slack_fake
from tests.engine_helpers import REFUND, drive
from tests.integration.approvals.test_approval_policies import make_policy
from tests.integration.approvals.test_decide_permission import everything  # what a refused decision leaves as it was

URL = "/api/slack/interactions"


@pytest.fixture
def slack(settings):
    fake = slack_fake.FakeSlack()
    settings.SLACK_BOT_TOKEN = slack_fake.BOT_TOKEN
    settings.SLACK_SIGNING_SECRET = slack_fake.SIGNING_SECRET
    settings.SLACK_API_URL = fake.api_url
    settings.SLACK_RESPONSE_URL_PREFIX = fake.hooks_url
    settings.SLACK_DEFAULT_CHANNEL = ""
    settings.CONSOLE_URL = "https://console.example.com"
    yield fake
    fake.close()


@pytest.fixture
def linked(demo):
    """The demo's reviewer is U0BOB in Slack, its outsider U0DAVE; payments posts to C0PAYMENTS."""
    SlackRoute.objects.create(channel=Channel.objects.get(name="payments"), slack_channel="C0PAYMENTS")
    SlackIdentity.objects.create(user=demo["reviewer"], team_id=slack_fake.TEAM, slack_user_id="U0BOB")
    SlackIdentity.objects.create(user=demo["outsider"], team_id=slack_fake.TEAM, slack_user_id="U0DAVE")
    return demo


def send_slack_notifications() -> list[str]:
    """Run the queued `send_notification` jobs of Slack's notifications, as the outbound worker would: a job that
    returns is marked succeeded (which frees its queueing lock); one that raises stays queued, to be retried."""
    results = []
    jobs = ProcrastinateJob.objects.filter(task_name="approvals.tasks.send_notification", status="todo")
    for job in jobs.order_by("id"):
        notification_id = job.args["notification_id"]
        if not Notification.objects.filter(pk=notification_id, backend="slack").exists():
            continue
        results.append(send_notification(notification_id=notification_id))
        with connection.cursor() as cursor:
            cursor.execute("UPDATE procrastinate_jobs SET status = 'succeeded' WHERE id = %s", [job.id])
    return results


def new_card(demo, **submit) -> Approval:
    run = drive(submission.submit(workflow="refund", input=REFUND, created_by=demo["agent"], **submit)[0])
    assert run.status == Run.Status.WAITING_HUMAN
    return Approval.objects.get(run=run)


@pytest.fixture
def posted(slack, linked) -> Approval:
    """A card on payments, posted to Slack."""
    card = new_card(linked)
    assert send_slack_notifications() == ["sent"]
    return card


def click(slack: slack_fake.FakeSlack, card_id: int, version: int, **options) -> dict:
    """A signed click's payload whose response_url is the fake's (Slack's hooks host, as far as the test knows)."""
    options.setdefault("response_url", f"{slack.hooks_url}{slack_fake.TEAM}/1/abc")
    return slack_fake.click(card_id, version, **options)


def post_click(payload: dict, client: Client | None = None, **sign):
    body, headers = slack_fake.signed(payload, **sign)
    return (client or Client()).post(URL, data=body, content_type=headers.pop("Content-Type"), headers=headers)


def decisions_audited(card: Approval) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(action__startswith="approval.", approval_id=card.pk).order_by("id"))


# --- posting ----------------------------------------------------------------------------------------------------


def test_a_new_card_on_a_routed_channel_is_posted_with_its_buttons_link_and_rationale(slack, linked):
    card = new_card(linked)
    (notification,) = Notification.objects.filter(backend="slack")
    assert (notification.event, notification.status) == ("card.opened", "pending")  # in the card's transaction
    assert send_slack_notifications() == ["sent"]

    (post,) = slack.calls("chat.postMessage")
    assert post["channel"] == "C0PAYMENTS" and post["text"].startswith(f"Card {card.pk} on payments")
    buttons = [e for b in post["blocks"] if b["type"] == "actions" for e in b["elements"]]
    approve, reject, link = buttons
    assert approve["action_id"] == "hitl_approve" and reject["action_id"] == "hitl_reject"
    assert approve["value"] == reject["value"] == f'{{"card":{card.pk},"version":{card.version}}}'
    assert link["url"] == f"https://console.example.com/approvals/{card.pk}/"
    assert link["text"]["text"] == "Edit in console"
    text = str(post["blocks"])
    assert card.summary and pii.present(card.summary)[:60] in text  # the agent's rationale, the name masked
    assert "amount_cents" in text  # the diff's summary
    assert f"<!date^{int(card.due_at.timestamp())}^" in text  # the SLA's deadline
    (message,) = SlackMessage.objects.all()
    assert (message.approval_id, message.slack_channel) == (card.pk, "C0PAYMENTS") and message.ts


def test_a_channel_without_a_route_posts_to_the_default_or_nowhere(slack, demo, settings):
    new_card(demo)
    assert not Notification.objects.filter(backend="slack").exists()
    settings.SLACK_DEFAULT_CHANNEL = "U0LEAD"  # a person: a direct message
    card = new_card(demo, idempotency_key="second")
    assert send_slack_notifications() == ["sent"]
    (post,) = slack.calls("chat.postMessage")
    assert post["channel"] == "U0LEAD"
    assert SlackMessage.objects.get().slack_channel == "D0LEAD"  # where Slack put it, to update it there
    assert SlackMessage.objects.get().approval_id == card.pk


def test_nothing_is_posted_without_a_bot_token(slack, linked, settings):
    settings.SLACK_BOT_TOKEN = ""
    new_card(linked)
    assert not Notification.objects.filter(backend="slack").exists()


def test_a_failed_post_is_retried_by_its_job_and_posted_once(slack, linked):
    card = new_card(linked)
    slack.fail_next(1)
    with pytest.raises(Exception, match="internal_error"):
        send_slack_notifications()
    assert send_slack_notifications() == ["sent"]
    assert len(slack.calls("chat.postMessage")) == 2 and SlackMessage.objects.filter(approval=card).count() == 1


# --- a click that decides ------------------------------------------------------------------------------------------


def test_a_signed_approve_click_decides_the_card_and_updates_the_message(slack, posted, linked):
    before = slack.calls("chat.postMessage")[0]
    # Slack sends no CSRF token: the endpoint is exempt, and authenticated by its signature.
    response = post_click(click(slack, posted.pk, posted.version), Client(enforce_csrf_checks=True))
    assert response.status_code == 200

    card = Approval.objects.get(pk=posted.pk)
    assert card.status == "approved" and Run.objects.get(pk=card.run_id).status == Run.Status.QUEUED
    (decision,) = Decision.objects.filter(approval=card)
    assert (decision.actor, decision.decision) == (linked["reviewer"], "approve")
    (entry,) = decisions_audited(card)
    assert (entry.action, entry.actor, entry.actor_type) == ("approval.approve", "reviewer", "human")
    assert entry.data["via"] == "slack" and entry.data["version"] == posted.version + 1
    assert not slack.responses()  # nothing ephemeral: the message itself says it

    # One update queued (the card saved, then closed: the second waits behind the first's queueing lock).
    assert Notification.objects.filter(backend="slack", event="card.updated").count() == 1
    assert send_slack_notifications() == ["sent"]
    (update,) = slack.calls("chat.update")
    message = SlackMessage.objects.get()
    assert (update["channel"], update["ts"]) == (message.slack_channel, message.ts) == ("C0PAYMENTS", message.ts)
    text = str(update["blocks"])
    assert "Approved by reviewer at " in text
    assert "hitl_approve" not in text and "hitl_reject" not in text  # no buttons any more
    assert update["text"] == before["text"]


def test_a_reject_click_takes_the_comment_typed_in_the_message(slack, posted):
    assert (
        post_click(click(slack, posted.pk, posted.version, action="reject", comment="Wrong customer")).status_code
        == 200
    )
    card = Approval.objects.get(pk=posted.pk)
    assert card.status == "rejected" and card.decisions.get().comment == "Wrong customer"
    send_slack_notifications()
    assert "Rejected by reviewer at " in str(slack.calls("chat.update")[0]["blocks"])


def test_a_decision_in_the_console_updates_the_message_too(slack, posted, linked):
    posted.decide(linked["reviewer"], "reject", comment="Not this one", version=posted.version)
    assert send_slack_notifications() == ["sent"]
    (update,) = slack.calls("chat.update")
    assert "Rejected by reviewer at" in str(update["blocks"]) and "Not this one" in str(update["blocks"])
    assert "via" not in decisions_audited(posted)[0].data  # the console's own decisions are not marked


def test_a_safe_default_at_the_deadline_updates_the_message(slack, posted):
    Channel.objects.filter(name="payments").update(escalation_policy="safe_default")
    assert sla.apply_sla(posted.pk, posted.due_at + timedelta(seconds=1)) == "safe_default"
    assert send_slack_notifications() == ["sent"]
    blocks = str(slack.calls("chat.update")[0]["blocks"])
    assert "Rejected by the system at" in blocks and "hitl_approve" not in blocks


def test_a_cancelled_runs_card_loses_its_buttons(slack, posted, linked):
    Run.objects.get(pk=posted.run_id).cancel(by=linked["reviewer"])
    assert send_slack_notifications() == ["sent"]
    blocks = str(slack.calls("chat.update")[0]["blocks"])
    assert "hitl_approve" not in blocks and "hitl_reject" not in blocks
    assert "ancelled" in blocks


# --- replays and refusals: nothing changes, and the clicker is told why ----------------------------------------------


def test_a_replayed_click_does_not_decide_twice(slack, posted):
    body, headers = slack_fake.signed(click(slack, posted.pk, posted.version))
    content_type = headers.pop("Content-Type")
    assert Client().post(URL, data=body, content_type=content_type, headers=headers).status_code == 200
    decided = everything(posted)
    assert decided[0] == "approved"

    # The very same signed request, within Slack's five minutes: verified, and refused by the card's version.
    assert Client().post(URL, data=body, content_type=content_type, headers=headers).status_code == 200
    assert everything(posted) == decided
    assert len(decisions_audited(posted)) == 1
    (told,) = slack.responses()
    assert told["response_type"] == "ephemeral" and told["replace_original"] is False
    assert told["text"].startswith("Not recorded: this card was already approved by reviewer")
    (refused,) = AuditEntry.objects.filter(action="slack.refused")
    assert refused.actor == "reviewer" and refused.target == f"approval:{posted.pk}"


def test_a_replayed_first_approval_of_two_does_not_count_twice(slack, posted, linked):
    Channel.objects.filter(name="payments").update(required_approvals=2)
    body, headers = slack_fake.signed(click(slack, posted.pk, posted.version))
    content_type = headers.pop("Content-Type")
    Client().post(URL, data=body, content_type=content_type, headers=headers)
    once = everything(posted)
    assert once[0] == "pending" and once[4] == 1  # one approval of two: still open

    Client().post(URL, data=body, content_type=content_type, headers=headers)
    assert everything(posted) == once
    assert "the card changed" in slack.responses()[0]["text"]
    # The message is updated with the count and the new version, so the second person's click is current.
    send_slack_notifications()
    update = slack.calls("chat.update")[-1]
    assert "1 of 2 approvals so far: reviewer" in str(update["blocks"])
    assert f'"version":{posted.version + 1}' in str(update["blocks"])


def test_two_people_approve_from_slack_on_a_two_person_channel(slack, posted, rita):
    Channel.objects.filter(name="payments").update(required_approvals=2)
    SlackIdentity.objects.create(user=rita, team_id=slack_fake.TEAM, slack_user_id="U0RITA")
    post_click(click(slack, posted.pk, posted.version))
    assert Approval.objects.get(pk=posted.pk).status == "pending"
    send_slack_notifications()
    # The second person clicks on the message as updated: the version it now carries.
    (version,) = {b["value"] for b in slack.calls("chat.update")[-1]["blocks"][-1]["elements"] if "value" in b}
    post_click(click(slack, posted.pk, int(version.split('"version":')[1].rstrip("}")), user="U0RITA"))
    card = Approval.objects.get(pk=posted.pk)
    assert card.status == "approved" and not slack.responses()
    assert [d.actor.username for d in card.decisions.order_by("pk")] == ["reviewer", "rita"]
    assert [e.data["via"] for e in decisions_audited(card)] == ["slack", "slack"]
    send_slack_notifications()
    assert "Approved by rita at" in str(slack.calls("chat.update")[-1]["blocks"])


def test_a_click_on_a_card_that_changed_since_is_refused(slack, posted, linked, rita):
    Channel.objects.filter(name="payments").update(required_approvals=2)  # an edit leaves the card open
    posted.decide(rita, "edit", payload={**posted.proposed}, version=posted.version)  # and gives it a new version
    assert Approval.objects.get(pk=posted.pk).status == "pending"
    before = everything(posted)
    post_click(click(slack, posted.pk, posted.version))
    assert everything(posted) == before
    assert "the card changed (version" in slack.responses()[0]["text"]


def test_a_click_refused_before_the_stage_reached_its_person_is_not_decided_by_its_replay(slack, linked, rita):
    """Issue 24: a click refused because the policy's stage did not ask that person yet, replayed (the same signed
    request, within Slack's five minutes) once the stage has reached them, must not count: the refused interaction
    is spent. A fresh click from the message as it then stands does count."""
    stages = [{"name": "first", "users": [rita]}, {"name": "second", "users": [linked["reviewer"]]}]
    make_policy("rita-then-reviewer", stages)
    card = new_card(linked)
    assert card.policy["name"] == "rita-then-reviewer"
    send_slack_notifications()
    body, headers = slack_fake.signed(click(slack, card.pk, card.version))
    content_type = headers.pop("Content-Type")
    assert Client().post(URL, data=body, content_type=content_type, headers=headers).status_code == 200
    assert "does not ask you" in slack.responses()[0]["text"]

    card.decide(rita, "approve", version=card.version)  # the first stage: the card moves on to the reviewer's
    card.refresh_from_db()
    assert (card.status, card.stage) == ("pending", 1)
    before = everything(card)
    assert Client().post(URL, data=body, content_type=content_type, headers=headers).status_code == 200
    assert everything(card) == before
    assert "already refused" in slack.responses()[-1]["text"]
    assert AuditEntry.objects.filter(action="slack.refused", approval_id=None).count() == 2

    post_click(click(slack, card.pk, card.version))  # a new click: decided
    assert Approval.objects.get(pk=card.pk).status == "approved"


UNVERIFIED = {
    "unsigned": lambda body, headers: (body, {}),
    "no signature": lambda body, headers: (body, {"X-Slack-Request-Timestamp": headers["X-Slack-Request-Timestamp"]}),
    "a bad signature": lambda body, headers: (body, {**headers, "X-Slack-Signature": "v0=" + "0" * 64}),
    "another secret": lambda body, headers: (body, slack_fake.signed({}, secret="not-the-secret")[1]),
    "a changed body": lambda body, headers: (body.replace(b"approve", b"reject"), headers),
    "a timestamp that is not a number": lambda body, headers: (body, {**headers, "X-Slack-Request-Timestamp": "soon"}),
}


@pytest.mark.parametrize("tamper", UNVERIFIED.values(), ids=UNVERIFIED.keys())
def test_a_click_that_slack_did_not_sign_changes_nothing(slack, posted, tamper):
    before = everything(posted)
    body, headers = slack_fake.signed(click(slack, posted.pk, posted.version))
    content_type = headers.pop("Content-Type")
    body, headers = tamper(body, headers)
    response = Client().post(URL, data=body, content_type=content_type, headers=headers)
    assert response.status_code == 401 and response.json()["error"] == "unauthorized"
    assert everything(posted) == before
    assert not slack.responses() and not AuditEntry.objects.filter(action="slack.refused").exists()


# Slack refuses a timestamp more than 300 s from now either way. From the future by 310 s: by 301 (truncated to
# the second), the request itself could take the second that brings it back within 300 s, and it was accepted.
@pytest.mark.parametrize("age", [301, 3600, -310], ids=["five minutes old", "an hour old", "from the future"])
def test_a_stale_click_changes_nothing_even_signed(slack, posted, age):
    before = everything(posted)
    response = post_click(click(slack, posted.pk, posted.version), timestamp=int(time.time()) - age)
    assert response.status_code == 401
    assert everything(posted) == before and not slack.responses()


def test_an_unknown_slack_user_changes_nothing_and_is_told(slack, posted):
    before = everything(posted)
    assert post_click(click(slack, posted.pk, posted.version, user="U0NOBODY")).status_code == 200
    assert everything(posted) == before
    (told,) = slack.responses()
    assert told["response_type"] == "ephemeral" and "not linked to a console user" in told["text"]
    (refused,) = AuditEntry.objects.filter(action="slack.refused")
    assert (refused.actor, refused.actor_type) == (f"slack:{slack_fake.TEAM}/U0NOBODY", "human")


def test_the_same_user_id_in_another_workspace_is_unknown(slack, posted):
    before = everything(posted)
    post_click(click(slack, posted.pk, posted.version, user="U0BOB", team="T0OTHER"))
    assert everything(posted) == before and "not linked" in slack.responses()[0]["text"]


def test_a_deactivated_users_slack_account_decides_nothing(slack, posted, linked):
    User.objects.filter(username="reviewer").update(is_active=False)
    before = everything(posted)
    post_click(click(slack, posted.pk, posted.version))
    assert everything(posted) == before and "not linked" in slack.responses()[0]["text"]


def test_a_user_without_the_permission_changes_nothing_and_is_told(slack, posted):
    before = everything(posted)
    assert post_click(click(slack, posted.pk, posted.version, user="U0DAVE")).status_code == 200
    assert everything(posted) == before
    (told,) = slack.responses()
    assert told["response_type"] == "ephemeral" and told["text"] == "You may not decide this card."
    assert AuditEntry.objects.get(action="slack.refused").actor == "outsider"


def test_a_user_with_another_channels_permission_changes_nothing(slack, posted, linked):
    assign_perm("core.approve_channel", linked["outsider"], Channel.objects.get(name="email"))
    before = everything(posted)
    post_click(click(slack, posted.pk, posted.version, user="U0DAVE"))
    assert everything(posted) == before and slack.responses()[0]["text"] == "You may not decide this card."


def test_the_runs_creator_may_not_decide_its_card_from_slack(slack, linked):
    run = drive(submission.submit(workflow="refund", input=REFUND, created_by=linked["reviewer"])[0])
    card = Approval.objects.get(run=run)
    before = everything(card)
    post_click(click(slack, card.pk, card.version))
    assert everything(card) == before
    assert "you started this run" in slack.responses()[0]["text"]


def test_a_rejection_without_a_comment_is_refused_with_the_reason(slack, posted):
    before = everything(posted)
    post_click(click(slack, posted.pk, posted.version, action="reject", comment="   "))
    assert everything(posted) == before
    assert slack.responses()[0]["text"] == "Not recorded: a rejection needs a comment saying why."


def test_a_click_on_a_card_that_does_not_exist_is_refused(slack, posted):
    post_click(click(slack, 999_999, 1))
    assert slack.responses()[0]["text"] == "You may not decide this card."


def test_other_clicks_are_acknowledged_and_change_nothing(slack, posted):
    payload = click(slack, posted.pk, posted.version)
    payload["actions"][0].update(action_id="hitl_open", value=None)  # "Edit in console" reports its clicks too
    before = everything(posted)
    assert post_click(payload).status_code == 200
    assert everything(posted) == before and not slack.responses()


def test_a_response_url_off_slacks_host_is_not_called(slack, posted):
    post_click(click(slack, posted.pk, posted.version, user="U0NOBODY", response_url="http://127.0.0.1:9/x"))
    assert not slack.responses()  # refused all the same (audited), the answer not sent there
    assert AuditEntry.objects.filter(action="slack.refused").count() == 1


def test_the_endpoint_answers_post_only_and_only_when_configured(slack, posted, settings):
    assert Client().get(URL).status_code == 405
    settings.SLACK_SIGNING_SECRET = ""
    before = everything(posted)
    response = post_click(click(slack, posted.pk, posted.version))
    assert response.status_code == 404 and everything(posted) == before


def test_a_body_over_the_api_limit_is_refused(slack, posted, settings):
    settings.API_MAX_BODY_BYTES = 2000
    payload = click(slack, posted.pk, posted.version, comment="x" * 3000)
    before = everything(posted)
    assert post_click(payload).status_code == 413
    assert everything(posted) == before


def test_a_body_that_is_signed_but_not_a_payload_is_400(slack, posted):
    body = b"token=x&team_id=T0TESTTEAM"
    stamp = str(int(time.time()))
    headers = {
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": slack_fake.signature(slack_fake.SIGNING_SECRET, stamp, body),
    }
    response = Client().post(URL, data=body, content_type="application/x-www-form-urlencoded", headers=headers)
    assert response.status_code == 400 and response.json()["error"] == "bad_request"


# --- linking identities -----------------------------------------------------------------------------------------


def test_linking_and_unlinking_an_identity_in_admin_is_audited(admin_client, demo):
    response = admin_client.post(
        "/admin/slackapp/slackidentity/add/",
        {"user": demo["reviewer"].pk, "team_id": "T0TESTTEAM", "slack_user_id": "U0BOB"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    identity = SlackIdentity.objects.get()
    (linked,) = AuditEntry.objects.filter(action="slack_identity.link")
    assert linked.actor == "alice" and linked.data == {
        "user": "reviewer",
        "team_id": "T0TESTTEAM",
        "slack_user_id": "U0BOB",
    }

    admin_client.post(f"/admin/slackapp/slackidentity/{identity.pk}/delete/", {"post": "yes"})
    assert not SlackIdentity.objects.exists()
    assert AuditEntry.objects.get(action="slack_identity.unlink").data["slack_user_id"] == "U0BOB"


def test_one_slack_account_is_one_user(demo):
    SlackIdentity.objects.create(user=demo["reviewer"], team_id="T1", slack_user_id="U1")
    with pytest.raises(Exception, match="slackapp_slackidentity_one_account"):
        SlackIdentity.objects.create(user=demo["outsider"], team_id="T1", slack_user_id="U1")


def test_routing_a_channel_in_admin_is_audited(admin_client, demo):
    payments = Channel.objects.get(name="payments")
    response = admin_client.post("/admin/slackapp/slackroute/add/", {"channel": payments.pk, "slack_channel": "C0PAY"})
    assert response.status_code == 302
    entry = AuditEntry.objects.get(action="slack_route.set")
    assert (entry.channel, entry.data) == ("payments", {"slack_channel": "C0PAY", "before": None})


# --- what the message shows is what is approved (issue 24) -----------------------------------------------------


def reshaped(card: Approval, proposed: dict, current: dict | None) -> Approval:
    """The card with another proposal and current state (as an external agent could send them)."""
    Approval.objects.filter(pk=card.pk).update(proposed=proposed, current=current)
    return Approval.objects.select_related("channel").get(pk=card.pk)


def buttons_of(message: dict) -> list[str]:
    return [e["action_id"] for b in message["blocks"] if b["type"] == "actions" for e in b["elements"]]


def test_every_changed_field_is_shown_in_full_when_it_fits(slack, posted):
    """Twelve changed fields, values of 200 characters: all of them, whole, and the Approve button."""
    proposed = {f"field_{i:02d}": f"{i:02d}" + "x" * 198 for i in range(12)}
    card = reshaped(posted, proposed, {})
    message = blocks.message(posting.view_of(card))
    text = "".join(b["text"]["text"] for b in message["blocks"] if b["type"] == "section")
    for path, value in proposed.items():
        assert f"`{path}`: {value}" in text
    assert "more in the console" not in text and "not shown" not in text
    assert buttons_of(message) == ["hitl_approve", "hitl_reject", "hitl_open"]
    assert all(len(b["text"]["text"]) <= 3000 for b in message["blocks"] if b["type"] == "section")
    assert len(message["blocks"]) <= 50


@pytest.mark.parametrize(
    ("proposed", "left_out"),
    [
        ({"memo": "m" * 5000, "amount_cents": 100}, 1),  # one value longer than a Slack section
        ({f"line_{i:03d}": "v" * 500 for i in range(200)}, None),  # more than the message holds
    ],
    ids=["a long value", "too many fields"],
)
def test_a_card_slack_cannot_show_in_full_says_what_it_left_out_and_has_no_approve(slack, posted, proposed, left_out):
    card = reshaped(posted, proposed, {})
    message = blocks.message(posting.view_of(card))
    assert "hitl_approve" not in buttons_of(message)
    assert buttons_of(message) == ["hitl_reject", "hitl_open"]  # rejecting what was not shown in full is safe
    (link,) = [e for b in message["blocks"] if b["type"] == "actions" for e in b["elements"] if "url" in e]
    assert link["text"]["text"] == "Open in console to approve"
    text = str(message["blocks"])
    count = int(re.search(r"(\d+) fields? not shown here", text).group(1))
    if left_out is not None:
        assert count == left_out and "`amount_cents`: 100" in text
    else:
        assert 0 < count < len(proposed)
    assert all(len(b["text"]["text"]) <= 3000 for b in message["blocks"] if b["type"] == "section")
    assert len(message["blocks"]) <= 50


def test_a_click_on_approve_for_a_card_slack_cannot_show_in_full_is_refused(slack, posted):
    """A button posted before the card grew (or forged from another message) decides nothing either."""
    card = reshaped(posted, {"memo": "m" * 5000}, {})
    before = everything(card)
    post_click(click(slack, card.pk, card.version))
    assert everything(card) == before
    assert "cannot show this card in full" in slack.responses()[0]["text"]


def test_an_agents_current_equal_to_its_arguments_is_shown_as_such_not_as_no_change(slack, posted):
    arguments = {"to": "iban:DE89370400440532013000", "amount_cents": 990000}
    card = reshaped(posted, arguments, dict(arguments))
    message = blocks.message(posting.view_of(card))
    text = str(message["blocks"])
    assert "No change" not in text
    assert "The agent says the target already has these values" in text
    assert "`to`: iban:DE89370400440532013000" in text and "`amount_cents`: 990000" in text
