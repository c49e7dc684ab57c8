"""The token of an email's decision link (approvals.links): the link's id, signed; anything changed is refused."""

from __future__ import annotations

import uuid

import pytest
from django.core import signing

from approvals import links
from approvals.models import DecisionLink


def link() -> DecisionLink:
    return DecisionLink(id=uuid.uuid4())  # unsaved: the token is built from the id alone


def test_it_round_trips():
    made = link()
    token = links.token_for(made)
    assert links.link_id(token) == made.pk
    assert links.path_for(made) == f"/approvals/email/{token}/"


def test_it_is_one_url_safe_path_segment():
    token = links.token_for(link())
    assert "/" not in token and "?" not in token and "#" not in token and ":" not in token
    assert token.split(".", 1)[0] == token[:36]  # the id, then the signature


def test_each_link_has_its_own_token():
    assert links.token_for(link()) != links.token_for(link())


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),  # one character of the signature
        lambda t: ("0" if t[0] != "0" else "1") + t[1:],  # one character of the id
        lambda t: t[:-5],  # cut short
        lambda t: t.split(".")[0],  # no signature
        lambda t: t + "x",
        lambda t: "",
        lambda t: "not-a-token",
    ],
)
def test_a_changed_token_is_refused(change):
    token = links.token_for(link())
    assert links.link_id(change(token)) is None


def test_a_validly_signed_value_that_is_not_an_id_is_refused():
    signed = signing.Signer(salt=links.SALT, sep=".").sign("not-a-uuid")
    assert links.link_id(signed) is None


def test_a_value_signed_for_another_purpose_is_refused():
    made = link()
    other = signing.Signer(salt="something-else", sep=".").sign(str(made.pk))
    assert links.link_id(other) is None


def test_another_secret_key_is_refused_and_a_rotated_one_still_works(settings):
    made = link()
    token, old = links.token_for(made), settings.SECRET_KEY
    settings.SECRET_KEY = "a-new-secret-key-after-a-rotation-0123456789"
    assert links.link_id(token) is None
    settings.SECRET_KEY_FALLBACKS = [old]
    assert links.link_id(token) == made.pk
