"""The JSON Schema an external agent sends (issue 24, defect 6; external.schemas): it runs in the web thread, on
the ask and on every reviewer's edit of the card, so nothing in it may stall the server, reach the network or the
filesystem, or answer 500. Driven through the API as the agent and the reviewer use it.

These tests assert answers, not times: a backtracking pattern or an exponential schema that came back would make
them hang (for hours), not fail quietly; tests/system/test_external_schemas_server.py bounds the time against the
real server, and the report of issue 24 has the figures."""

from __future__ import annotations

import pytest

from approvals.models import Approval
from external import schemas
from external.models import ActionRequest
from runs.models import Run
from tests.integration.external.test_external_requests import Api

ARGUMENTS = {"order_id": "ord_42", "amount_cents": 12_500, "code": "aaaa"}
CATASTROPHIC = "^(a+)+$"  # Python's re backtracks 2**n times on n a's and a character that fails it
EVIL = "a" * 32 + "!"


def schema_with(**code) -> dict:
    return {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ord_[0-9]+$"},
            "amount_cents": {"type": "integer", "minimum": 1, "maximum": 20_000},
            "code": {"type": "string", **code},
        },
        "required": ["order_id", "amount_cents"],
        "additionalProperties": False,
    }


@pytest.fixture
def agent(client, demo):
    return Api(client, demo["agent"])


@pytest.fixture
def reviewer(client, demo):
    return Api(client, demo["reviewer"])


def ask(agent, schema, arguments=ARGUMENTS, key="refund-42"):
    return agent.post(
        "/api/approval-requests",
        {
            "channel": "payments",
            "action": "refund_order",
            "arguments": arguments,
            "rationale": "The parcel never arrived.",
            "schema": schema,
            "idempotency_key": key,
        },
    )


def edit(reviewer, card_id, payload):
    (card,) = [c for c in reviewer.get("/api/approvals")[1] if c["id"] == card_id]
    return reviewer.post(
        f"/api/approvals/{card_id}/decision",
        {"decision": "edit", "version": card["version"], "payload": payload, "comment": "fixed"},
    )


def refused(code, body, loc, *words) -> bool:
    """A 422 with an error at `loc` whose message has each of `words`."""
    assert code == 422, (code, body)
    assert body["error"] == "invalid", body
    return any(e["loc"] == loc and all(w in e["msg"] for w in words) for e in body["detail"])


def nothing_opened() -> bool:
    return not ActionRequest.objects.exists() and not Approval.objects.exists() and not Run.objects.exists()


def test_a_catastrophic_pattern_is_answered_as_a_mismatch_at_the_ask_and_at_an_edit(agent, reviewer):
    code, body = ask(agent, schema_with(pattern=CATASTROPHIC), {**ARGUMENTS, "code": EVIL})
    assert refused(code, body, "arguments.code", "does not match"), body
    assert nothing_opened()
    code, request = ask(agent, schema_with(pattern=CATASTROPHIC))
    assert code == 202, request
    code, body = edit(reviewer, request["card_id"], {**ARGUMENTS, "code": EVIL})
    assert refused(code, body, "code", "does not match"), body
    assert edit(reviewer, request["card_id"], {**ARGUMENTS, "code": "a" * 40})[0] == 200


@pytest.mark.parametrize(
    "pattern, why",
    [
        (r"^(a)\1$", "invalid escape sequence"),
        ("^(?=a)a$", "invalid perl operator"),
        ("^(?<!b)a$", "perl operator"),
        (r"^[\p{L}\p{N}]{1,200}$", "pattern too large"),
    ],
    ids=["backreference", "lookahead", "lookbehind", "too large"],
)
def test_a_pattern_re2_cannot_compile_is_refused_at_the_ask_naming_it(agent, pattern, why):
    code, body = ask(agent, schema_with(pattern=pattern))
    assert refused(code, body, "schema.properties.code.pattern", repr(pattern), why, "RE2"), body
    named = schema_with()
    named["patternProperties"] = {pattern: {"type": "string"}}
    code, body = ask(agent, named, key="named")
    assert refused(code, body, "schema.patternProperties", repr(pattern), why), body
    assert nothing_opened()


@pytest.mark.parametrize(
    "ref",
    [
        "http://127.0.0.1:9/schema.json",
        "https://json-schema.org/draft/2020-12/schema",
        "file:///etc/passwd",
        "other.json#/$defs/code",
        "urn:example:code",
    ],
    ids=["http", "a metaschema's URL", "file", "relative", "urn"],
)
def test_a_ref_outside_the_schema_is_refused_and_nothing_is_fetched(agent, ref):
    schema = schema_with()
    schema["properties"]["code"] = {"$ref": ref}
    code, body = ask(agent, schema)
    assert refused(code, body, "schema.properties.code.$ref", repr(ref), "outside the schema"), body
    assert nothing_opened()


@pytest.mark.parametrize("ref", ["#/$defs/nowhere", "#/properties/nothing", "#nowhere"])
def test_a_ref_to_nothing_in_the_schema_is_refused_at_the_ask(agent, ref):
    schema = {**schema_with(), "$defs": {"code": {"type": "string"}}}
    schema["properties"]["code"] = {"$ref": ref}
    code, body = ask(agent, schema)
    assert refused(code, body, "schema.properties.code.$ref", repr(ref), "points at nothing"), body
    assert nothing_opened()


def test_local_refs_and_anchors_resolve_as_before(agent, reviewer):
    schema = {**schema_with(), "$defs": {"code": {"$anchor": "code", "type": "string", "pattern": "^a+$"}}}
    schema["properties"]["code"] = {"$ref": "#code"}
    schema["properties"]["again"] = {"$ref": "#/$defs/code"}
    code, request = ask(agent, schema)
    assert code == 202, request
    assert refused(*edit(reviewer, request["card_id"], {**ARGUMENTS, "again": "b"}), "again", "does not match")
    assert edit(reviewer, request["card_id"], {**ARGUMENTS, "again": "aa"})[0] == 200


def test_a_schema_of_many_anchors_is_checked_as_quickly_as_any_other(agent, reviewer):
    """Each `#anchor` looked up in a registry not crawled ahead crawls the whole document again: 480 of them
    (31 KB) took 2.4 s to check when asked, and more than MAX_CPU to check the arguments, so this very schema was
    refused. Crawled once, they take 0.2 s and 0.02 s."""
    n = 450
    schema = {
        "$defs": {f"d{i}": {"$anchor": f"a{i}", "type": "string"} for i in range(n)},
        "properties": {f"p{i}": {"$ref": f"#a{i}"} for i in range(n)},
    }
    arguments = {f"p{i}": "x" for i in range(n)}
    code, request = ask(agent, schema, arguments)
    assert code == 202, request
    assert refused(*edit(reviewer, request["card_id"], {**arguments, "p7": 7}), "p7", "is not of type 'string'")


def test_a_schema_too_large_or_too_deep_is_refused(agent):
    large = schema_with()
    large["description"] = "x" * schemas.MAX_BYTES
    code, body = ask(agent, large)
    assert refused(code, body, "schema", f"at most {schemas.MAX_BYTES}"), body
    deep: dict = {"type": "string"}
    for _ in range(schemas.MAX_DEPTH):  # each `not` one level deeper: past MAX_DEPTH in all
        deep = {"not": deep}
    code, body = ask(agent, {**schema_with(), "properties": {"code": deep}}, key="deep")
    assert refused(code, body, "schema", f"at most {schemas.MAX_DEPTH}"), body
    assert nothing_opened()


def test_a_schema_whose_work_grows_exponentially_or_without_end_is_refused(agent):
    # Each level: anyOf two references to the next. Checked naively, a value the last level refuses is tried
    # 2**30 times: a schema of 2 KiB, and no pattern in it.
    levels = {f"l{i}": {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}, {"$ref": f"#/$defs/l{i + 1}"}]} for i in range(30)}
    exponential = {**schema_with(), "$defs": {**levels, "l30": {"type": "integer"}}}
    exponential["properties"]["code"] = {"$ref": "#/$defs/l0"}
    code, body = ask(agent, exponential)
    # Stopped after MAX_STEPS steps, or MAX_CPU seconds of CPU on a slow or busy machine: whichever comes first.
    assert refused(code, body, "schema", "takes more than", "to check this value"), body
    # The same on a large value: each failure writes the value into its message, so the CPU time stops it first.
    large = {**ARGUMENTS, "code": {f"k{i}": "v" * 40 for i in range(1_000)}}
    code, body = ask(agent, exponential, large, key="large")
    assert refused(code, body, "schema", "takes more than", "to check this value"), body
    endless = schema_with()
    endless["properties"]["code"] = {"$ref": "#/properties/code"}
    code, body = ask(agent, endless, key="endless")
    assert code == 422 and any(e["loc"] == "schema" for e in body["detail"]), body
    assert nothing_opened()


def test_a_schema_whose_patterns_take_long_to_compile_is_refused(agent):
    """RE2 takes milliseconds to compile a counted repetition of a Unicode class: 600 of them (27 KB) would take
    15 s; the check of a schema charges each pattern by its RE2 program's size and stops after MAX_CHECK_STEPS."""
    schema = {"properties": {f"p{i}": {"pattern": rf"^[\p{{L}}\p{{N}}]{{1,{10 + i}}}$"} for i in range(600)}}
    code, body = ask(agent, schema, {})
    assert refused(code, body, "schema", f"takes more than {schemas.MAX_CHECK_STEPS} steps to check"), body
    assert nothing_opened()


def test_a_schema_gets_the_same_answer_on_a_busy_machine(agent, reviewer, monkeypatch):
    """The check of a schema was stopped by its CPU time: 0.4-0.75 s for this one on a quiet machine, more than
    its 1 s under CI's load, so the same card's edits were refused although its ask had been accepted (in CI, on
    2026-12-06). It counts steps now: a thread whose every reading of its CPU time says a further second has gone
    gets the answer a quiet one does. (A check of a value still watches the CPU: MAX_CPU.)"""
    n = 450
    schema = {
        "$defs": {f"d{i}": {"$anchor": f"a{i}", "type": "string"} for i in range(n)},
        "properties": {f"p{i}": {"$ref": f"#a{i}"} for i in range(n)},
    }
    with_empties = {"allOf": [{}] * 10_000}  # 30 KB: 270,000 steps (5 s of CPU), stopped at MAX_CHECK_STEPS
    clock = iter(range(10**9))
    with monkeypatch.context() as busy:
        busy.setattr(schemas.time, "thread_time", lambda: float(next(clock)))
        schemas._checked.cache_clear()
        assert schemas.problems(schema) == []
        assert schemas.problems(with_empties) == [
            {"loc": "schema", "msg": f"takes more than {schemas.MAX_CHECK_STEPS} steps to check: simplify it"}
        ]
    arguments = {f"p{i}": "x" for i in range(n)}
    code, request = ask(agent, schema, arguments)
    assert code == 202, request
    schemas._checked.cache_clear()  # as in another web process: checked again, with the same answer
    assert refused(*edit(reviewer, request["card_id"], {**arguments, "p7": 7}), "p7", "is not of type 'string'")


def test_a_subschema_saying_its_own_draft_is_checked_on_re2_and_counted_too(agent, reviewer):
    """jsonschema gives a subschema with a `$schema` of its own that draft's stock validator: Python's `re`,
    nothing counted. `^(a|a)+$` then took 1.7 s on 24 a's (doubling with each a), and an exponential `anyOf`
    ran to its end. Now that draft's validator from this module: RE2 (whose `$` does not match before a final
    newline, as Python's does) and the same budget."""
    draft = {"$schema": "https://json-schema.org/draft/2019-09/schema"}
    schema = schema_with()
    schema["properties"]["code"] = {**draft, "type": "string", "pattern": "^(a|a)+$"}
    code, request = ask(agent, schema, {**ARGUMENTS, "code": "a" * 40 + "!"})
    assert refused(code, request, "arguments.code", "does not match"), request
    code, request = ask(agent, schema, {**ARGUMENTS, "code": "aaa"}, key="fits")
    assert code == 202, request
    assert refused(*edit(reviewer, request["card_id"], {**ARGUMENTS, "code": "a\n"}), "code", "does not match")
    levels = {f"l{i}": {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}, {"$ref": f"#/$defs/l{i + 1}"}]} for i in range(16)}
    exponential = {**schema_with(), "$defs": {**levels, "l16": {"type": "integer"}}}
    exponential["properties"]["code"] = {**draft, "$ref": "#/$defs/l0"}
    code, body = ask(agent, exponential, key="exponential")  # 2**16 evaluations of l16, 20,000 allowed
    assert refused(code, body, "schema", "takes more than", "to check this value"), body


def test_many_patterns_over_many_keys_are_stopped_too(agent):
    """patternProperties and additionalProperties search each key with each pattern, all in one keyword's
    evaluation: 1,000 patterns by 4,000 keys are 4 million searches (1.7 s of CPU with Python's `re`, 5.7 s at
    the body's limit; more with RE2, whose calls cost more): each search is a step. (1,200 patterns are refused
    before: their check against the metaschema takes more than MAX_CHECK_STEPS.)"""
    schema = {"patternProperties": {f"^p{i}$": {} for i in range(1_000)}, "additionalProperties": False}
    code, body = ask(agent, schema, {f"k{i}": 0 for i in range(4_000)})
    assert refused(code, body, "schema", "takes more than", "to check this value"), body
    assert nothing_opened()


def test_unique_items_compares_json_values_in_linear_time(agent, reviewer):
    """jsonschema compares the items pairwise when they cannot be sorted (mixed types, objects): 64 KiB of them
    took about 25 s. The same answers, from one pass."""
    schema = {**schema_with(), "properties": {**schema_with()["properties"], "tags": {"uniqueItems": True}}}
    mixed = [i if i % 2 else str(i) for i in range(7_000)]  # ints and strings: unsortable
    code, request = ask(agent, schema, {**ARGUMENTS, "tags": mixed})
    assert code == 202, request
    card = request["card_id"]
    for duplicated in ([*mixed, "2"], [{"a": 1, "b": [1, {"c": None}]}, 0, {"b": [1, {"c": None}], "a": 1}]):
        assert refused(*edit(reviewer, card, {**ARGUMENTS, "tags": duplicated}), "tags", "non-unique elements")
    assert edit(reviewer, card, {**ARGUMENTS, "tags": [True, 1, "1", [1], {"1": 1}, None, 0, False]})[0] == 200


def test_unevaluated_properties_beside_pattern_properties_is_refused(agent):
    schema = schema_with()
    del schema["additionalProperties"]
    schema["patternProperties"] = {"^x_": {"type": "string"}}
    schema["unevaluatedProperties"] = False
    code, body = ask(agent, schema)
    assert refused(code, body, "schema.unevaluatedProperties", "patternProperties"), body


def test_a_schema_with_patterns_checks_arguments_and_edits_as_before(agent, reviewer):
    schema = schema_with(pattern="^[a-z]+$")
    schema["patternProperties"] = {"^x_": {"type": "string", "maxLength": 5}}  # beside additionalProperties: False
    code, body = ask(agent, schema, {**ARGUMENTS, "order_id": "42"})
    assert refused(code, body, "arguments.order_id", "does not match"), body
    code, body = ask(agent, schema, {**ARGUMENTS, "note": "hi"}, key="extra")
    assert refused(code, body, "arguments", "'note' does not match any of the regexes: '^x_'"), body
    code, request = ask(agent, schema, {**ARGUMENTS, "x_note": "hi"}, key="fine")
    assert code == 202, request
    card = request["card_id"]
    assert refused(*edit(reviewer, card, {**ARGUMENTS, "code": "A1"}), "code", "does not match")
    assert refused(*edit(reviewer, card, {**ARGUMENTS, "x_note": "too long"}), "x_note", "is too long")
    assert refused(*edit(reviewer, card, {**ARGUMENTS, "y": 1}), "payload", "'y' does not match")
    assert edit(reviewer, card, {**ARGUMENTS, "code": "abc", "x_note": "ok"})[0] == 200
    assert Approval.objects.get(pk=card).to_execute == {**ARGUMENTS, "code": "abc", "x_note": "ok"}


@pytest.mark.parametrize(
    "stored",
    [
        {"$ref": "#/$defs/nowhere"},
        {"$ref": "http://127.0.0.1:9/schema.json"},
        {"properties": {"code": {"pattern": r"^(a)\1$"}}},
        {"type": "object", "properties": {"code": {"type": "not-a-type"}}},
        {"properties": {"code": {"$ref": "#/properties/code"}}},
    ],
    ids=["missing ref", "remote ref", "backreference", "invalid", "endless"],
)
def test_an_edit_of_a_card_whose_stored_schema_is_unusable_is_422_not_500(agent, reviewer, stored):
    """A card opened before these checks may hold any schema: its edit is refused, saying why, and the card can
    still be approved or rejected."""
    code, request = ask(agent, schema_with())
    assert code == 202, request
    ActionRequest.objects.filter(pk=request["id"]).update(schema=stored)
    code, body = edit(reviewer, request["card_id"], {**ARGUMENTS, "code": "aa"})
    assert refused(code, body, "schema", "the agent's schema for this action is unusable"), body
    assert Approval.objects.get(pk=request["card_id"]).status == "pending"
    (card,) = [c for c in reviewer.get("/api/approvals")[1] if c["id"] == request["card_id"]]
    decision = {"decision": "reject", "version": card["version"], "comment": "the schema is broken"}
    assert reviewer.post(f"/api/approvals/{card['id']}/decision", decision)[0] == 200


def test_the_card_page_of_a_card_whose_stored_schema_is_unusable_refuses_its_edit_with_422(agent, client, demo):
    code, request = ask(agent, schema_with())
    assert code == 202, request
    ActionRequest.objects.filter(pk=request["id"]).update(schema={"$ref": "#/$defs/nowhere"})
    card = Approval.objects.get(pk=request["card_id"])
    client.force_login(demo["reviewer"])
    assert client.get(f"/approvals/{card.pk}/").status_code == 200
    fields = {f"p:{key}": value for key, value in {**ARGUMENTS, "code": "aa"}.items()}
    response = client.post(
        f"/approvals/{card.pk}/decide",
        {"decision": "edit", "version": card.version, "comment": "fixed", **fields},
        headers={"HX-Request": "true"},
    )
    assert response.status_code == 422 and "unusable" in response.content.decode()
    assert Approval.objects.get(pk=card.pk).status == "pending"
