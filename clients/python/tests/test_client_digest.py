from __future__ import annotations

import math

import pytest

from hitl_client import arguments_digest, canonical_json

# sha256 of the literal bytes {"amount_cents":500,"note":"café ☕","order_id":"o-42"} in UTF-8, computed apart.
KNOWN = "da2631f49bf4949a7774929360e5d05991beba4140d4d39684d64bcd3b025caf"


def test_it_hashes_the_canonical_json_the_contract_defines():
    arguments = {"order_id": "o-42", "note": "café ☕", "amount_cents": 500}
    assert canonical_json(arguments) == '{"amount_cents":500,"note":"café ☕","order_id":"o-42"}'.encode()
    assert arguments_digest(arguments) == KNOWN


def test_key_order_and_nesting_order_do_not_change_it():
    one = {"b": {"y": 1, "x": [3, {"q": 1, "p": 2}]}, "a": None}
    other = {"a": None, "b": {"x": [3, {"p": 2, "q": 1}], "y": 1}}
    assert arguments_digest(one) == arguments_digest(other)


def test_non_ascii_text_is_hashed_as_utf8_not_escaped():
    assert b"\\u" not in canonical_json({"name": "Zoë"})
    assert arguments_digest({"name": "Zoë"}) != arguments_digest({"name": "Zoe"})


def test_list_order_and_values_count():
    assert arguments_digest({"x": [1, 2]}) != arguments_digest({"x": [2, 1]})
    assert arguments_digest({"x": 1}) != arguments_digest({"x": "1"})


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
def test_it_refuses_what_is_not_json(number):
    with pytest.raises(ValueError):
        arguments_digest({"amount": number})
    with pytest.raises(TypeError):
        arguments_digest({"when": object()})
