"""Why a decision is refused: each error names the HTTP status it maps to (the card page, the API and bulk decisions
answer with it). A leaf, like runs/errors.py: the rules (approvals.rules, approvals.edits) raise these, the models
and the views catch them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.utils import timezone

if TYPE_CHECKING:
    from approvals.models import Approval


class DecisionError(Exception):
    """A decision that cannot be taken; `status` is the HTTP status it maps to."""

    status = 400


class InvalidDecision(DecisionError):
    status = 422

    def __init__(self, message: str, errors: list[dict] | None = None):
        super().__init__(message)
        self.errors = errors or []  # an edit's field errors, {loc, msg}


class AlreadyDecided(DecisionError):
    status = 409

    def __init__(self, card: Approval):
        last = card.decisions.order_by("-created_at").first()
        by = last.actor.username if last and last.actor else "system"
        when = (card.decided_at or timezone.now()).isoformat()
        super().__init__(f"this card was already {card.status} by {by} at {when}")
        self.card, self.by, self.at = card, by, when


class NotAllowed(DecisionError):
    """The actor may not take this decision (separation of duties, or the two-person rule)."""

    status = 403


class SecondApproverNeeded(DecisionError):
    """Two-person rule: the same person cannot give both approvals."""

    status = 409


class CannotCheckEdit(DecisionError):
    """This process cannot find the card's gate (approvals.edits.GateUnresolved), so it cannot check an edit:
    refused, not checked less. Asking again once web and workers run the same workflows will do."""

    status = 409


class StaleVersion(DecisionError):
    status = 409

    def __init__(self, card: Approval, version: int):
        super().__init__(f"the card changed (version {card.version}, you sent {version}): reload it")
        self.card = card


class Expired(DecisionError):
    """The decision came after the card's deadline: refused, and the card's expiry (approvals.sla.apply_sla) was
    applied in the same transaction. `card` is as that left it (escalated to someone, rejected, expired)."""

    status = 409
    code = "expired"

    def __init__(self, card: Approval, missed):
        super().__init__(
            f"this card's deadline ({missed.isoformat()}) has passed: the decision was not recorded, and the card's "
            "expiry was applied"
        )
        self.card = card


class LinkRefused(DecisionError):
    """An email's decision link (approvals.links) that cannot be followed, or carried into a decision: tampered
    (404), sent to someone else (403), used, expired or its card closed (410). Nothing is decided."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
