"""Decisions from email: the Approve and Reject links a notification email carries (approvals.models.DecisionLink).

A link is `/approvals/email/<token>/`, the token the link's id signed with SECRET_KEY (django.core.signing, its
own salt): nothing secret is stored, a changed character is refused, and a SECRET_KEY rotation keeps old links
working through SECRET_KEY_FALLBACKS. What a link does, and does not:

- it opens the card in the console with its decision pre-selected; the person is who the console's login says
  (a link opened logged out goes through the login page and back), never who the link was sent to: a link opened
  by anyone but its recipient is refused;
- it decides nothing: a GET never does (so a mail scanner that fetches every link changes nothing, and uses
  nothing up); the person presses the button of the card page's own decide form, which posts the token along,
  and every rule of a decision (approvals.access.card_for, Approval.decide) applies as to any other decision;
- it is good once: marked used in the transaction of the decision made through it (DecisionLink.use), so a
  decision that is refused leaves it usable and one that commits uses it up;
- it expires with its card: refused once the card is closed (decided, expired, cancelled) or past the deadline
  it had when the email was sent (an escalation sends new links with the new deadline).
"""

from __future__ import annotations

import uuid
from datetime import datetime

from django.core import signing
from django.db import transaction
from django.utils import timezone

from approvals.errors import Expired, LinkRefused
from approvals.models import Approval, DecisionLink, Notification, card_overdue
from approvals.rules import DecisionKind

SALT = "approvals.decision-link"
DECISIONS = (DecisionKind.APPROVE, DecisionKind.REJECT)


def _signer() -> signing.Signer:
    # "." keeps the token one path segment of URL-safe characters (the signature is URL-safe base64).
    return signing.Signer(salt=SALT, sep=".")


def token_for(link: DecisionLink) -> str:
    return _signer().sign(str(link.pk))


def path_for(link: DecisionLink) -> str:
    return f"/approvals/email/{token_for(link)}/"


def link_id(token: str) -> uuid.UUID | None:
    """The id `token` carries, or None when its signature does not verify (changed, truncated, made up)."""
    try:
        return uuid.UUID(_signer().unsign(token))
    except (signing.BadSignature, ValueError):
        return None


def find(token: str) -> DecisionLink | None:
    """The link `token` names, or None (a bad signature, or a link that is no more)."""
    pk = link_id(token)
    return None if pk is None else DecisionLink.objects.select_related("approval").filter(pk=pk).first()


def for_recipient(notification: Notification, recipient) -> dict[str, DecisionLink]:
    """The approve and reject links of `recipient` for `notification`, made on its first send and the same on a
    retry; each expires at the card's deadline as it stands (an escalated card's new one)."""
    card = notification.approval
    links = {}
    for decision in DECISIONS:
        links[decision.value], _ = DecisionLink.objects.get_or_create(
            notification=notification,
            recipient=recipient,
            decision=decision.value,
            defaults={"approval": card, "expires_at": card.due_at},
        )
    return links


def check(token: str, user, *, card_id: int | None = None, decision: str | None = None, now: datetime | None = None):
    """The link `token` if `user` may follow it now, else LinkRefused with the reason and its status. The order
    tells the recipient the most precise reason and nobody else anything about the card."""
    link = find(token)
    if link is None or (card_id is not None and link.approval_id != card_id):
        raise LinkRefused(
            "This link is not valid: it was changed or cut short. Open the card from your inbox instead.", 404
        )
    if link.recipient_id != user.pk:
        raise LinkRefused(
            "This link was sent to someone else. Log in as the person it was sent to, or open the card from your"
            " inbox.",
            403,
        )
    if decision is not None and decision != link.decision:
        raise LinkRefused(f"This link is for {link.decision}, not {decision}.", 422)
    card = link.approval
    when = "%Y-%m-%d %H:%M:%S %Z"
    if link.used_at is not None:
        at = timezone.localtime(link.used_at).strftime(when)
        raise LinkRefused(f"This link was already used, at {at}: each link works once.", 410)
    if card.status not in Approval.OPEN:
        raise LinkRefused(f"This card is already {card.get_status_display().lower()}: there is nothing to decide.", 410)
    if (now or timezone.now()) >= link.expires_at:
        at = timezone.localtime(link.expires_at).strftime(when)
        raise LinkRefused(f"This link expired at {at}, with the card's deadline. Open the card from your inbox.", 410)
    return link


def decide_through(link: DecisionLink, card: Approval, user, decision: str, **fields) -> Approval:
    """Approval.decide, audited `via: email`, and the link used, in one transaction: if either is refused (the
    decision by its rules, the link because another request used it meanwhile), neither happens."""
    try:
        with transaction.atomic():
            decided = card.decide(user, decision, via="email", **fields)
            if not link.use():
                raise LinkRefused("This link was already used: each link works once.", 410)
    except Expired:
        # The card's expiry, which the decision applied, was rolled back with the link: it applies on its own.
        card_overdue.send(Approval, card=card, now=timezone.now())
        raise
    return decided
