"""What a client may send (core.safe_input): the parser that refuses, naming the field, what must not reach the
database (NaN and the infinities, NUL characters, lone surrogates, deep nesting, integers beyond 2**53), the free
fields that take any valid JSON, and the same rules stated in the OpenAPI document. That the API answers such a body
422 and writes nothing: tests/integration/console/test_bad_input.py (and external/test_external_results.py for the
free fields); that the document's rules are the server's: tests/integration/console/test_openapi_document.py."""

from __future__ import annotations

import json
import math
import sys

import jsonschema_rs
import pytest
from django.db import DataError
from django.http import HttpResponse
from django.test import RequestFactory

from console.middleware import SafeInputMiddleware
from core import safe_input
from core.safe_input import ANY_JSON, MAX_FREE_DEPTH, MAX_FREE_DIGITS, NO_NUL, NOT_BLANK, UnsafeJson


def nested(depth: int) -> str:
    """A JSON value of `depth` nested containers (objects and arrays alternating)."""
    text = "1"
    for level in range(depth):
        text = f'{{"k": {text}}}' if level % 2 else f"[{text}]"
    return text


def runs_body(input_json: str) -> str:
    return f'{{"workflow": "refund", "input": {input_json}}}'


# Each body as a client sends it (raw text: json.dumps would refuse or escape some of these), and the path to the
# field the parser must name (at or above the offending value).
REFUSED_BODIES = {
    "NaN": (runs_body('{"customer_id": "c", "amount_cents": NaN}'), ["body", "input", "amount_cents"]),
    "Infinity": (runs_body('{"amount_cents": Infinity}'), ["body", "input", "amount_cents"]),
    "-Infinity": (runs_body('{"amount_cents": -Infinity}'), ["body", "input", "amount_cents"]),
    "a float too large (inf)": (runs_body('{"amount_cents": 1e400}'), ["body", "input", "amount_cents"]),
    "NUL in a value": (runs_body('{"reason": "a\\u0000b"}'), ["body", "input", "reason"]),
    "NUL in a key": (runs_body('{"rea\\u0000son": "x"}'), ["body", "input"]),
    "NUL in a top-level value": ('{"workflow": "ref\\u0000und", "input": {}}', ["body", "workflow"]),
    "lone high surrogate": (runs_body('{"reason": "\\ud800"}'), ["body", "input", "reason"]),
    "lone low surrogate in a key": (runs_body('{"\\udfff": 1}'), ["body", "input"]),
    "lone surrogate deep in a list": (runs_body('{"tags": ["ok", ["\\ud83d"]]}'), ["body", "input", "tags", 1, 0]),
    "integer beyond 2**53": (runs_body(f'{{"amount_cents": {2**53 + 1}}}'), ["body", "input", "amount_cents"]),
    "a float beyond 2**53 (an integer, to JSON)": (
        runs_body('{"amount_cents": 1e300}'),
        ["body", "input", "amount_cents"],
    ),
    "a float just beyond 2**53": (runs_body('{"n": 9007199254740994.0}'), ["body", "input", "n"]),
    "integer below -2**53": (runs_body(f'{{"amount_cents": {-(2**53) - 1}}}'), ["body", "input", "amount_cents"]),
    "integer of 30 digits": (runs_body('{"amount_cents": 1000000000000000000000000000000}'), ["body", "input"]),
    "integer of 5000 digits": (runs_body('{"amount_cents": ' + "9" * 5000 + "}"), ["body", "input"]),
    "33 levels deep": (runs_body(nested(32)), ["body", "input"]),
    "far too deep for the parser": (runs_body("[" * 20_000 + "]" * 20_000), ["body"]),
}


@pytest.mark.parametrize(("body", "loc"), REFUSED_BODIES.values(), ids=REFUSED_BODIES.keys())
def test_it_refuses_what_cannot_be_stored_naming_the_field(body, loc):
    with pytest.raises(UnsafeJson) as refused:
        safe_input.loads(body)
    assert refused.value.loc[: len(loc)] == loc, refused.value.loc
    assert refused.value.msg
    # The API's 422 names it as the client wrote it: the parser's root, "body", is not part of it.
    (error,) = refused.value.errors()
    expected = ".".join(map(str, loc[1:])) or "body"
    assert error["type"] == "unsafe_json"
    assert error["loc"] == expected or error["loc"].startswith(expected + "."), error["loc"]


def test_raw_utf8_encoded_surrogates_are_refused_too():
    """json.loads decodes bytes with 'surrogatepass': a surrogate written as raw bytes gets through it."""
    body = runs_body('{"reason": "x"}').encode().replace(b'"x"', b'"\xed\xa0\x80"')
    with pytest.raises(UnsafeJson) as refused:
        safe_input.loads(body)
    assert refused.value.errors()[0]["loc"] == "input.reason"


def test_text_that_is_not_json_is_a_value_error_of_its_own():
    with pytest.raises(ValueError) as raised:
        safe_input.loads(b'{"workflow": "refund", "input": \xff}')
    assert not isinstance(raised.value, UnsafeJson)


ACCEPTED_BODIES = {
    "32 levels deep": nested(32),
    "2**53": str(2**53),
    "-2**53": str(-(2**53)),
    "a float within 2**53": "-9007199254740992.0",
    "a tiny float": "1e-300",
    "a surrogate pair (one astral character)": '"\\ud83d\\ude00"',
    "unicode text": '"Grüße, 東京 \U0001f600"',
    "booleans and null": "[true, false, null]",
}


@pytest.mark.parametrize("text", ACCEPTED_BODIES.values(), ids=ACCEPTED_BODIES.keys())
def test_the_parser_accepts_what_can_be_stored(text):
    assert safe_input.loads(text) == json.loads(text)


def test_the_parser_reads_an_integral_number_within_2_53_as_an_integer():
    """JSON (and JSON Schema, which the OpenAPI document is written in) has one kind of number: 65.0 is the
    integer 65, which a strict integer field (a workflow's amount in cents) takes."""
    parsed = safe_input.loads("[65.0, 1e2, -0.0, 9007199254740992.0, 0.5]")

    assert parsed == [65, 100, 0, 2**53, 0.5]
    assert [type(number) for number in parsed] == [int, int, int, int, float]


def test_the_parser_names_the_path_in_its_message_for_form_fields():
    with pytest.raises(ValueError, match=r"^payload\.refund\.note: contains a NUL character$"):
        safe_input.loads('{"refund": {"note": "\\u0000"}}', root="payload")


def test_the_whole_body_is_named_by_its_root():
    with pytest.raises(UnsafeJson) as refused:
        safe_input.loads('"\\u0000"')
    assert refused.value.errors() == [{"type": "unsafe_json", "loc": "body", "msg": "contains a NUL character"}]


def test_a_python_value_is_checked_by_the_same_rules():
    safe_input.check({"a": [1, 2.5, "x", None, True]})
    for value, msg in [
        (math.inf, "the number is out of range"),
        (math.nan, "the number is out of range"),
        (2**53 + 1, "numbers beyond ±2**53 are not allowed"),
        ("\x00", "contains a NUL character"),
    ]:
        with pytest.raises(UnsafeJson) as refused:
            safe_input.check({"a": [value]}, root="input")
        assert (refused.value.loc, refused.value.msg) == (["input", "a", 0], msg)


def test_unsafe_characters_are_named():
    assert safe_input.unsafe_char("fine, 東京 \U0001f600") is None
    assert safe_input.unsafe_char("a\x00b") == "a NUL character"
    assert safe_input.unsafe_char("a\ud800") == "a lone surrogate"
    assert safe_input.field_path(["input", "tags", 1]) == "input.tags.1"


# --- free fields: any valid JSON ----------------------------------------------------------------------------------


def test_a_free_field_takes_what_the_rest_of_the_body_may_not():
    body = '{"ok": true, "result": {"big": ' + "9" * 40 + ', "nul": "a\\u0000b", "half": "\\ud800", "e": 1e400}}'
    parsed = safe_input.loads(body, free=["result"])
    assert parsed["result"] == {"big": int("9" * 40), "nul": "a\x00b", "half": "\ud800", "e": 10**400}
    # The rest of the body keeps the rules.
    with pytest.raises(UnsafeJson) as refused:
        safe_input.loads('{"ok": true, "error": "a\\u0000b", "result": 1}', free=["result"])
    assert refused.value.loc == ["body", "error"]


def test_a_free_fields_numbers_are_exact_integers_or_the_nearest_double():
    parsed = safe_input.loads('{"result": [1.39e16, 13900000000000001, 0.1, 2.5e-5]}', free=["result"])
    assert parsed["result"] == [13900000000000000, 13900000000000001, 0.1, 2.5e-5]
    assert [type(n) for n in parsed["result"]] == [int, int, float, float]


@pytest.mark.parametrize(
    ("value", "msg"),
    [
        ("9" * (MAX_FREE_DIGITS + 1), f"integers of more than {MAX_FREE_DIGITS} digits are not allowed"),
        (f"1e{MAX_FREE_DIGITS}", f"integers of more than {MAX_FREE_DIGITS} digits are not allowed"),
        ("1.5e400", None),  # an integer: 15 followed by 399 zeros
        ("0." + "0" * 400 + "1e400", None),  # 1e-401 * 1e400: 0.1
        ("1" * 400 + ".5", "a number with a fraction beyond ±1.8e308 cannot be kept"),
        ("NaN", "NaN is not a number JSON allows"),
    ],
)
def test_a_free_field_refuses_only_what_python_cannot_carry(value, msg):
    body = '{"result": {"n": ' + value + "}}"
    if msg is None:
        safe_input.loads(body, free=["result"])
        return
    with pytest.raises(UnsafeJson, match=msg) as refused:
        safe_input.loads(body, free=["result"])
    assert refused.value.loc == ["body", "result", "n"]


def test_a_free_field_nests_to_its_own_limit():
    within = '{"result": ' + nested(MAX_FREE_DEPTH - 1) + "}"
    safe_input.loads(within, free=["result"])
    with pytest.raises(UnsafeJson, match=f"nested deeper than {MAX_FREE_DEPTH} levels"):
        safe_input.loads('{"result": ' + nested(MAX_FREE_DEPTH) + "}", free=["result"])


# --- the middleware's answer to a value PostgreSQL refuses ---------------------------------------------------------


def test_a_data_error_on_a_console_page_is_a_400_page():
    middleware = SafeInputMiddleware(lambda request: HttpResponse())
    request = RequestFactory().get("/runs/")

    response = middleware.process_exception(request, DataError("integer out of range"))

    assert response.status_code == 400
    assert middleware.process_exception(request, ValueError("not ours")) is None


# --- the same rules, in the OpenAPI document -----------------------------------------------------------------------


def test_not_blank_is_what_strip_leaves_non_empty():
    """The pattern the document gives a required reason or comment and the server's `.strip()` agree on every
    character (ECMA's \\s does not: it has U+FEFF and lacks U+001C-U+001F and U+0085)."""
    validator = jsonschema_rs.Draft202012Validator({"type": "string", "pattern": NOT_BLANK})
    disagree = [
        hex(code)
        for code in range(sys.maxunicode + 1)
        if not 0xD800 <= code <= 0xDFFF and validator.is_valid(chr(code)) != bool(chr(code).strip())
    ]
    assert disagree == []


def _document(body_schema: dict, **components) -> dict:
    return {
        "paths": {
            "/api/things": {
                "post": {
                    "parameters": [{"name": "q", "in": "query", "schema": {"type": "string"}}],
                    "requestBody": {"content": {"application/json": {"schema": body_schema}}},
                    "responses": {"200": {"content": {"application/json": {"schema": {"type": "string"}}}}},
                },
                "summary": "not an operation",
            }
        },
        "components": {"schemas": components},
    }


def test_declare_states_the_rules_on_every_request_body_and_parameter():
    document = safe_input.declare(
        _document(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "reason": {"type": "string", "pattern": NOT_BLANK},
                    "kind": {"type": "string", "enum": ["a", "b"]},
                    "count": {"type": "integer"},
                    "positive": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
                    "tags": {"type": "array"},
                    "thing": {"$ref": "#/components/schemas/Thing"},
                    "anything": {ANY_JSON: True},
                },
            },
            Thing={"type": "object", "properties": {"note": {"type": "string"}}, "additionalProperties": False},
        )
    )
    operation = document["paths"]["/api/things"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    fields = body["properties"]
    assert operation["parameters"][0]["schema"] == {"type": "string", "pattern": NO_NUL}
    assert fields["name"] == {"type": "string", "pattern": NO_NUL}
    assert fields["reason"] == {"type": "string", "pattern": NOT_BLANK, "allOf": [{"pattern": NO_NUL}]}
    assert fields["kind"] == {"type": "string", "enum": ["a", "b"]}
    assert fields["count"] == {"type": "integer", "minimum": -(2**53), "maximum": 2**53}
    assert fields["positive"] == {"type": "number", "exclusiveMinimum": 0, "maximum": 10}
    assert fields["tags"] == {"type": "array", "items": {"$ref": "#/components/schemas/JsonValue"}}
    assert fields["anything"] == {ANY_JSON: True}
    assert body["propertyNames"] == {"pattern": NO_NUL}
    assert body["additionalProperties"] == {"$ref": "#/components/schemas/JsonValue"}
    # A schema a body refers to is walked once; its own closed shape stays closed.
    thing = document["components"]["schemas"]["Thing"]
    assert thing["properties"]["note"] == {"type": "string", "pattern": NO_NUL}
    assert thing["additionalProperties"] is False
    # Responses are left as they are.
    assert operation["responses"]["200"]["content"]["application/json"]["schema"] == {"type": "string"}


def test_the_json_value_schema_refuses_what_the_parser_refuses():
    document = safe_input.declare(_document({"type": "object"}))
    validator = jsonschema_rs.Draft202012Validator(
        {**document, "$ref": "#/components/schemas/JsonValue"}, validate_formats=True
    )
    for good in [None, True, 2**53, -(2**53), 0.5, "text", [1, {"a": "b"}]]:
        assert validator.is_valid(good), good
    for bad in [2**53 + 1, "a\x00b", {"a\x00": 1}, [[-(2**53) - 1]]]:
        assert not validator.is_valid(bad), bad


def test_declare_does_not_walk_into_not_or_if():
    """A constraint added there would widen what the schema admits."""
    inner = {"type": "string"}
    document = safe_input.declare(_document({"not": inner, "if": {"type": "integer"}}))
    body = document["paths"]["/api/things"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["not"] == {"type": "string"} and body["if"] == {"type": "integer"}
