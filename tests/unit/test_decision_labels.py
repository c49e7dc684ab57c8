"""What a card calls its decisions (approvals.labels): the card page's buttons and the email's links agree."""

from __future__ import annotations

from types import SimpleNamespace

from approvals import labels


def card(kind: str, shadow: bool = False):
    return SimpleNamespace(kind=kind, shadow=shadow)


def test_each_kind_has_its_words():
    assert labels.for_card(card("action")) == {"approve": "Approve", "edit": "Edit", "reject": "Reject"}
    assert labels.for_card(card("reconcile"))["approve"] == "It happened"
    assert labels.for_card(card("reconcile"))["edit"] == ""  # not offered
    assert labels.for_card(card("budget"))["reject"] == "Stop the run"


def test_a_shadow_card_says_what_the_reviewer_did():
    assert labels.for_card(card("action", shadow=True))["approve"] == "I did it as proposed"


def test_an_unknown_kind_reads_as_an_action_and_the_table_is_not_shared():
    words = labels.for_card(card("something-new"))
    words["edit"] = ""
    assert labels.for_card(card("action"))["edit"] == "Edit"
