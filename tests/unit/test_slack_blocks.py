"""The card as a Slack message (slackapp.blocks), the click's parsing and the signature scheme: no database."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from slack_sdk.signature import Clock, SignatureVerifier

from approvals.diff import changes
from slackapp import blocks, interactions
from tests import slack_fake

DUE = datetime(2026, 12, 2, 10, 30, tzinfo=UTC)


def view(**overrides) -> blocks.CardView:
    values = {
        "id": 42,
        "version": 3,
        "channel": "payments",
        "workflow": "refund",
        "headline": "Refund order 1234",
        "summary": "The customer was charged twice for order 1234; refund the second charge.",
        "risk": "high",
        "due_at": DUE,
        "url": "https://console.example.com/approvals/42/",
        "status": "pending",
        "is_open": True,
        "decidable": True,
        "changes": changes({"refund": {"amount_cents": 0}}, {"refund": {"amount_cents": 4200, "currency": "EUR"}}),
        "amount": "42.00 EUR",
    }
    return blocks.CardView(**{**values, **overrides})


def elements(message: dict, kind: str) -> list[dict]:
    return [
        e for block in message["blocks"] if block["type"] == "actions" for e in block["elements"] if e["type"] == kind
    ]


def text_of(message: dict) -> str:
    return json.dumps(message["blocks"], ensure_ascii=False)


def test_it_offers_approve_and_reject_carrying_the_card_and_its_version():
    message = blocks.message(view())
    approve, reject, link = elements(message, "button")
    assert (approve["action_id"], approve["style"], approve["text"]["text"]) == ("hitl_approve", "primary", "Approve")
    assert (reject["action_id"], reject["style"], reject["text"]["text"]) == ("hitl_reject", "danger", "Reject")
    assert json.loads(approve["value"]) == json.loads(reject["value"]) == {"card": 42, "version": 3}
    assert link["text"]["text"] == "Edit in console" and link["url"] == "https://console.example.com/approvals/42/"
    assert "value" not in link  # a link, nothing to decide
    assert message["text"] == "Card 42 on payments: Refund order 1234"


def test_it_shows_the_rationale_the_diff_the_deadline_and_a_comment_box():
    message = blocks.message(view())
    text = text_of(message)
    assert "The customer was charged twice for order 1234" in text
    assert "~ `refund.amount_cents`: 0 → 4200" in text and "+ `refund.currency`: EUR" in text
    assert f"<!date^{int(DUE.timestamp())}^" in text and "2026-12-02 10:30 UTC" in text
    assert "42.00 EUR" in text and "high" in text
    (comment,) = [b for b in message["blocks"] if b["type"] == "input"]
    assert comment["block_id"] == "hitl_comment" and comment["element"]["action_id"] == "comment"
    assert comment["optional"] is True


def test_what_the_agent_wrote_cannot_mention_or_link():
    message = blocks.message(
        view(summary="<!channel> pay now <https://evil.example|click> & more", headline="<@U123> refund")
    )
    # mrkdwn everywhere but the header, whose plain_text Slack shows as it is
    text = json.dumps([message["text"], *(b for b in message["blocks"] if b["type"] != "header")])
    assert "<!channel>" not in text and "<https://evil" not in text and "<@U123>" not in text
    assert "&lt;!channel&gt; pay now &lt;https://evil.example|click&gt; &amp; more" in text
    assert message["text"] == "Card 42 on payments: &lt;@U123&gt; refund"


def test_a_long_diff_is_shown_whole_in_sections_that_fit():
    """Issue 24: no field is cut any more (it was 10 fields of 80 characters): every one, whole, in sections of at
    most MAX_TEXT characters; one line longer than a section is left out and counted."""
    many = changes({}, {f"field{i:02d}": "x" * 500 for i in range(15)})
    sections, left_out = blocks.change_sections(many)
    assert left_out == 0 and len(sections) > 1
    assert all(len(text) <= blocks.MAX_TEXT for text in sections)
    assert "\n".join(sections).count("x" * 500) == 15
    too_long = changes({}, {"memo": "y" * (blocks.MAX_TEXT + 1), "ok": 1})
    assert blocks.change_sections(too_long) == (["+ `ok`: 1"], 1)


def test_a_closed_card_shows_its_outcome_and_no_buttons():
    message = blocks.message(view(is_open=False, status="approved", outcome="Approved by bob at 2026-12-02 10:02 UTC"))
    (link,) = elements(message, "button")
    assert link["text"]["text"] == "Open in console" and "url" in link
    assert not [b for b in message["blocks"] if b["type"] == "input"]
    assert "Approved by bob at 2026-12-02 10:02 UTC" in text_of(message)


def test_a_card_decided_only_in_the_console_has_no_buttons():
    message = blocks.message(view(decidable=False))  # a shadow, budget or reconcile card
    (link,) = elements(message, "button")
    assert link["text"]["text"] == "Open in console"
    assert "This card is decided in the console." in text_of(message)


def test_a_click_is_read_from_slacks_block_actions_payload():
    payload = slack_fake.click(42, 3, action="reject", user="U0BOB", comment="wrong amount")
    click = interactions.click_of(payload)
    assert click == interactions.Click(
        team_id=slack_fake.TEAM,
        slack_user_id="U0BOB",
        card_id=42,
        version=3,
        decision="reject",
        comment="wrong amount",
        response_url="https://hooks.slack.com/actions/T0TESTTEAM/1/abc",
    )


def test_other_interactions_are_acknowledged_and_ignored():
    link_click = slack_fake.click(42, 3)
    link_click["actions"][0].update(action_id="hitl_open", value=None)
    assert interactions.click_of(link_click) is None
    assert interactions.click_of({"type": "view_submission"}) is None
    assert interactions.click_of({"type": "block_actions", "actions": []}) is None


def test_a_button_value_we_did_not_make_names_no_card():
    payload = slack_fake.click(42, 3)
    payload["actions"][0]["value"] = "click_me_123"
    assert (interactions.click_of(payload).card_id, interactions.click_of(payload).version) == (0, 0)


@pytest.mark.parametrize(
    "body", [b"", b"payload=", b"payload=not-json", b"token=x", b"payload=%5B1%5D", b"\xff\xfe", b"a=1&" * 20]
)
def test_a_body_that_is_not_a_payload_is_refused(body):
    with pytest.raises(interactions.Refused) as refused:
        interactions.parse(body)
    assert refused.value.status == 400


# Slack's worked example (docs.slack.dev/authentication/verifying-requests-from-slack).
DOC_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
DOC_TIMESTAMP = "1531420618"
DOC_BODY = (
    b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&"
    b"channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url="
    b"https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&"
    b"trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c"
)
DOC_SIGNATURE = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"


def test_the_tests_sign_as_slack_documents_and_the_library_agrees():
    assert slack_fake.signature(DOC_SECRET, DOC_TIMESTAMP, DOC_BODY) == DOC_SIGNATURE

    class Then(Clock):
        def now(self) -> float:
            return int(DOC_TIMESTAMP) + 60

    verifier = SignatureVerifier(DOC_SECRET, clock=Then())
    assert verifier.is_valid(body=DOC_BODY, timestamp=DOC_TIMESTAMP, signature=DOC_SIGNATURE)
    assert not verifier.is_valid(body=DOC_BODY + b"x", timestamp=DOC_TIMESTAMP, signature=DOC_SIGNATURE)
