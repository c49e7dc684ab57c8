"""What approve, edit and reject are called on a card, per kind of card: the card page's buttons and the
escalation email's links say the same words. A leaf: it reads a card's `kind` and `shadow`, nothing else."""

from __future__ import annotations

from runs.gates import Kind

LABELS = {
    Kind.ACTION: {"approve": "Approve", "edit": "Edit", "reject": "Reject"},
    Kind.RECONCILE: {"approve": "It happened", "edit": "", "reject": "It did not happen"},
    Kind.BUDGET: {"approve": "Extend the limit", "edit": "Edit the limit", "reject": "Stop the run"},
    # Undo (runs.compensations): whether to undo what a run did (or one gated compensation), and a compensation
    # that failed for good (try it again, or a person did it by hand). Neither is edited.
    Kind.UNDO: {"approve": "Undo it", "edit": "", "reject": "Leave it done"},
    Kind.UNDO_FAILED: {"approve": "Try again", "edit": "", "reject": "Done by hand"},
}
# "Reject and undo" (Approval.decide(undo=True)): on an action card, and a budget card's stop.
UNDO_LABELS = {Kind.ACTION: "Reject and undo", Kind.BUDGET: "Stop and undo"}
# On a shadow card nothing is sent: the reviewer does the action by hand, and the decision says what they did.
SHADOW_LABELS = {"approve": "I did it as proposed", "edit": "I did it differently", "reject": "I did not do it"}


def undo_label(card) -> str:
    """The words of a rejection that also undoes what the run did, or "" for a card that offers none by kind."""
    return "" if card.shadow else UNDO_LABELS.get(card.kind, "")


def for_card(card) -> dict[str, str]:
    """{approve, edit, reject}: the words for this card's decisions ("" for one it does not offer by kind)."""
    return dict(SHADOW_LABELS if card.shadow else LABELS.get(card.kind, LABELS[Kind.ACTION]))
