"""A click in Slack (`POST /api/slack/interactions`, slackapp.views): verified, mapped to one of our users, and
decided exactly as the console decides.

1. The request is Slack's: `X-Slack-Signature` is `v0=` HMAC-SHA256 of `v0:<X-Slack-Request-Timestamp>:<body>` under
   SLACK_SIGNING_SECRET, and the timestamp is within five minutes (slack_sdk's SignatureVerifier). Otherwise 401
   and nothing is read.
2. The clicker is the SlackIdentity an admin linked to (the payload's team id, user id): never a display name.
3. The decision goes through the console's own path: approvals.access.card_for(user, pk, to_decide=True) (who may
   see and decide the card) then Approval.decide with the version the button carries (the one the message showed),
   so every rule of a decision (permissions, separation of duties, the two-person count, a card already decided or
   changed since) applies as on the card page, and the decision is audited there, `via: slack`. An approval of a
   card whose message cannot show every changed field in full (slackapp.blocks.shows_in_full) is refused first.

A click that decides nothing gets an ephemeral answer (seen by the clicker only, through the payload's
response_url) saying why, and an audit entry `slack.refused`. A replayed click (the same signed request again,
within the five minutes) names a version the card has left: refused like any stale click, never decided twice.
A replayed click that was refused is refused again, whatever changed since: its audit entry keeps a digest of the
request's signature (`interaction`), and a request whose digest was refused is spent. Otherwise a click refused
because the policy's stage had not reached its person yet (which leaves the card's version as it was) would count
when replayed once the stage does."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import parse_qs

import structlog
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from slack_sdk.signature import SignatureVerifier
from slack_sdk.webhook import WebhookClient

from approvals.access import card_for
from approvals.errors import DecisionError
from core.access import Denied
from core.models import ActorType, AuditEntry
from slackapp import blocks, posting
from slackapp.models import SlackIdentity

log = structlog.get_logger("slackapp.interactions")

# Slack shows the clicker an error when its request is not answered within 3 s; the answer to a refusal is posted
# to the response_url before the request is answered, so it gets 2 s at most (the refusal stands either way).
RESPONSE_URL_TIMEOUT = 2
# How far back a refused interaction is looked for: Slack's signature is good for five minutes either side of the
# request's timestamp, so a replay arrives at most ten minutes after the original; the rest is a margin.
REPLAY_WINDOW = timedelta(minutes=15)


class Refused(Exception):
    """Not a request we act on: answered with `status` (401: not Slack's; 400: not a payload we can read)."""

    def __init__(self, status: int, error: str, detail: str):
        super().__init__(detail)
        self.status, self.error, self.detail = status, error, detail


@dataclass(frozen=True)
class Click:
    """One click on one of our decision buttons, as Slack's block_actions payload says it."""

    team_id: str
    slack_user_id: str
    card_id: int
    version: int
    decision: str  # approve | reject
    comment: str
    response_url: str
    interaction: str = ""  # a digest of the signed request (`fingerprint`): the same for a replay of it


@dataclass(frozen=True)
class Answer:
    """What the clicker is told: `text` ephemerally (blank: nothing), through `response_url`."""

    decided: bool
    text: str = ""
    response_url: str = ""


def verify(headers, body: bytes) -> None:
    """Refused (401) unless Slack signed this body within the last five minutes."""
    secret = settings.SLACK_SIGNING_SECRET
    if not secret:
        raise Refused(404, "not_found", "Slack is not configured here (SLACK_SIGNING_SECRET).")
    timestamp, signature = headers.get("X-Slack-Request-Timestamp"), headers.get("X-Slack-Signature")
    if not timestamp or not signature:
        raise Refused(401, "unauthorized", "X-Slack-Request-Timestamp and X-Slack-Signature are required.")
    if not timestamp.isascii() or not timestamp.isdigit():
        raise Refused(401, "unauthorized", "X-Slack-Request-Timestamp is not a unix time.")
    try:
        valid = SignatureVerifier(secret).is_valid(body=body, timestamp=timestamp, signature=signature)
    except UnicodeDecodeError:  # the library decodes the body as UTF-8 to sign it; Slack's are
        valid = False
    if not valid:
        raise Refused(401, "unauthorized", "The Slack signature does not verify, or its timestamp is too old.")


def fingerprint(headers) -> str:
    """What identifies one signed request: a digest of its signature (over its timestamp and body), so that a replay
    of it, and only a replay, has the same. A digest rather than the signature itself, which is kept nowhere."""
    return hashlib.sha256((headers.get("X-Slack-Signature") or "").encode()).hexdigest()


def parse(body: bytes) -> dict:
    """The `payload` field of the form-encoded body, as JSON: 400 when there is none."""
    try:
        fields = parse_qs(body.decode("utf-8"), strict_parsing=True, max_num_fields=10)
        payload = json.loads(fields["payload"][0])
    except (UnicodeDecodeError, ValueError, KeyError) as exc:
        raise Refused(400, "bad_request", f"The body is not a Slack interaction payload: {exc}") from None
    if not isinstance(payload, dict):
        raise Refused(400, "bad_request", "The payload is not an object.")
    return payload


def click_of(payload: dict, interaction: str = "") -> Click | None:
    """Our decision button in a block_actions payload, or None for anything else (the "Edit in console" link also
    reports its clicks; another app's action; another kind of interaction): acknowledged, nothing done."""
    if payload.get("type") != "block_actions":
        return None
    actions = payload.get("actions") or []
    action = actions[0] if isinstance(actions, list) and actions and isinstance(actions[0], dict) else {}
    decision = blocks.DECISIONS.get(action.get("action_id"))
    if decision is None:
        return None
    user, team = payload.get("user") or {}, payload.get("team") or {}
    try:
        value = json.loads(action.get("value") or "")
        card_id, version = int(value["card"]), int(value["version"])
    except (ValueError, KeyError, TypeError):
        card_id, version = 0, 0  # not a value we made: refused as an unknown card
    comment = (
        ((payload.get("state") or {}).get("values") or {})
        .get(blocks.COMMENT_BLOCK, {})
        .get(blocks.COMMENT_INPUT, {})
        .get("value")
    )
    return Click(
        team_id=str(user.get("team_id") or team.get("id") or ""),
        slack_user_id=str(user.get("id") or ""),
        card_id=card_id,
        version=version,
        decision=decision,
        comment=str(comment or ""),
        response_url=str(payload.get("response_url") or ""),
        interaction=interaction,
    )


def act(click: Click) -> Answer:
    """Decide `click` as the user its Slack account is linked to, through the console's path, or say why not."""
    user = SlackIdentity.user_for(click.team_id, click.slack_user_id)
    if spent(click):
        return _refuse(
            click, user, "This click was already refused: click again on the message as it now stands to decide."
        )
    if user is None:
        return _refuse(click, None, "Your Slack account is not linked to a console user: ask an admin to link it.")
    try:
        card = card_for(user, click.card_id, to_decide=True)
        # What is shown is what is approved: a message that could not show every field approving changes has no
        # Approve button, and a click on one (an older message's, a forged one) is refused the same way.
        if click.decision == "approve" and not blocks.shows_in_full(posting.view_of(card)):
            return _refuse(
                click, user, "Slack cannot show this card in full: open it in the console to read it and approve it."
            )
        card.decide(user, click.decision, comment=click.comment, version=click.version, via="slack")
    except Denied as exc:
        text = "You may not decide this card." if exc.status == 404 else f"You may not decide this card: {exc}."
        return _refuse(click, user, text)
    except DecisionError as exc:
        return _refuse(click, user, f"Not recorded: {exc}.")
    log.info("decided from slack", card_id=click.card_id, decision=click.decision, user=user.get_username())
    return Answer(decided=True)


def spent(click: Click) -> bool:
    """Whether this very request was refused before (a replay of it): its refusal's audit entry names it."""
    if not click.interaction:
        return False
    return AuditEntry.objects.filter(
        action="slack.refused",
        target=f"approval:{click.card_id}",
        at__gte=timezone.now() - REPLAY_WINDOW,
        data__interaction=click.interaction,
    ).exists()


def _refuse(click: Click, user, text: str) -> Answer:
    """Nothing was decided: the clicker is told why, and the audit log keeps that someone tried."""
    with transaction.atomic():
        AuditEntry.record(
            "slack.refused",
            # An account nobody linked is named by its Slack ids: a person, just not one of ours.
            actor=user if user is not None else f"slack:{click.team_id}/{click.slack_user_id}",
            actor_type=ActorType.HUMAN,
            target=f"approval:{click.card_id}",
            data={
                "decision": click.decision,
                "version": click.version,
                "team_id": click.team_id,
                "slack_user_id": click.slack_user_id,
                "interaction": click.interaction,
                "reason": text,
            },
        )
    log.info("slack click refused", card_id=click.card_id, slack_user_id=click.slack_user_id, reason=text)
    return Answer(decided=False, text=text, response_url=click.response_url)


def tell(answer: Answer) -> None:
    """Post the ephemeral answer to the click's response_url (Slack's own hooks host only)."""
    if not answer.text or not answer.response_url:
        return
    if not answer.response_url.startswith(settings.SLACK_RESPONSE_URL_PREFIX):
        log.warning("slack response_url refused", url=answer.response_url[:200])
        return
    try:
        WebhookClient(answer.response_url, timeout=RESPONSE_URL_TIMEOUT).send_dict(
            {"response_type": "ephemeral", "replace_original": False, "text": answer.text}
        )
    except OSError as exc:  # the refusal stands; only its explanation is lost
        log.warning("slack response_url failed", error=str(exc))
