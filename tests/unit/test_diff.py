"""approvals.diff: field-level JSON diff and line-level text diff (pure, no database)."""

from __future__ import annotations

from approvals.diff import ADDED, CHANGED, REMOVED, SAME, against_current, diff_json, diff_lines, display, summarize
from approvals.inbox import ROW_HEADLINE, row_shows


def ops(diffs) -> dict[str, str]:
    return {d.path: d.op for d in diffs}


def test_it_diffs_nested_objects_by_dotted_path():
    current = {"refund": {"amount_cents": 0, "currency": "EUR", "note": "x"}, "email": {"to": "a@b.c"}}
    proposed = {"refund": {"amount_cents": 12_500, "currency": "EUR", "reason": "damaged"}, "email": {"to": "a@b.c"}}

    diffs = diff_json(current, proposed)

    assert ops(diffs) == {
        "refund.amount_cents": CHANGED,
        "refund.currency": SAME,
        "refund.reason": ADDED,
        "refund.note": REMOVED,
        "email.to": SAME,
    }
    amount = next(d for d in diffs if d.path == "refund.amount_cents")
    assert (amount.old, amount.new, amount.marker) == (0, 12_500, "~")
    assert [d.path for d in diffs][:3] == ["email.to", "refund.amount_cents", "refund.currency"]  # sorted
    assert [d.marker for d in diffs if d.op in (ADDED, REMOVED)] == ["\u2212", "+"]
    assert summarize(diffs) == {ADDED: 1, REMOVED: 1, CHANGED: 1, SAME: 2}


def test_nothing_current_means_every_field_is_added():
    diffs = diff_json(None, {"cost_limit": "2.00", "nested": {"a": 1}})
    assert ops(diffs) == {"cost_limit": ADDED, "nested.a": ADDED}
    assert all(d.old is None for d in diffs)


def test_a_whole_object_added_or_removed_lists_its_fields():
    diffs = diff_json({"old": {"x": 1}}, {"new": {"y": {"z": True}}})
    assert ops(diffs) == {"new.y.z": ADDED, "old.x": REMOVED}
    assert next(d for d in diffs if d.path == "old.x").old == 1


def test_a_change_of_type_is_a_change():
    assert ops(diff_json({"n": 1}, {"n": 1.0})) == {"n": CHANGED}
    assert ops(diff_json({"n": 1}, {"n": True})) == {"n": CHANGED}
    assert ops(diff_json({"n": {"a": 1}}, {"n": 5})) == {"n": CHANGED}


def test_lists_compare_as_whole_values():
    assert ops(diff_json({"tags": [1, 2]}, {"tags": [1, 2]})) == {"tags": SAME}
    diff = diff_json({"tags": [1, 2]}, {"tags": [2, 1]})[0]
    assert (diff.op, diff.old_text, diff.new_text) == (CHANGED, "[1, 2]", "[2, 1]")


def test_non_objects_diff_as_one_value():
    assert ops(diff_json("a", "b")) == {"(value)": CHANGED}


def test_multiline_strings_get_a_line_diff():
    old = "Hello Ann,\n\nWe refunded 10.00 EUR.\n\nBye"
    new = "Hello Ann,\n\nWe refunded 5.00 EUR.\n\nBye\nP.S. sorry"

    diff = diff_json({"body": old}, {"body": new})[0]

    assert diff.op == CHANGED
    assert [(line.marker, line.text) for line in diff.lines] == [
        (" ", "Hello Ann,"),
        (" ", ""),
        ("\u2212", "We refunded 10.00 EUR."),
        ("+", "We refunded 5.00 EUR."),
        (" ", ""),
        (" ", "Bye"),
        ("+", "P.S. sorry"),
    ]


def test_a_multiline_string_added_to_an_empty_one_is_all_added_lines():
    diff = diff_json({"body": ""}, {"body": "one\ntwo"})[0]
    assert [(line.op, line.text) for line in diff.lines] == [(ADDED, "one"), (ADDED, "two")]


def test_single_line_strings_and_unchanged_text_have_no_line_diff():
    assert diff_json({"s": "a"}, {"s": "b"})[0].lines == []
    assert diff_json({"s": "a\nb"}, {"s": "a\nb"})[0].lines == []


def test_diff_lines_of_identical_text_is_all_same():
    assert {line.op for line in diff_lines("a\nb", "a\nb")} == {SAME}


def test_display_keeps_strings_and_dumps_the_rest_untouched():
    assert display("<script>alert(1)</script>") == "<script>alert(1)</script>"  # escaping is the template's job
    assert display(None) == "null"
    assert display({"b": 1, "a": "é"}) == '{"a": "é", "b": 1}'


# --- what every view shows (issue 24) ---------------------------------------------------------------------------


def test_against_current_shows_every_field_that_runs_changed_first():
    shown = against_current({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4})
    assert [(d.path, d.op) for d in shown.to_show] == [("b", "changed"), ("c", "added"), ("a", "same")]
    assert not shown.claims_unchanged


def test_a_current_equal_to_what_runs_is_the_agents_claim_not_no_change():
    shown = against_current({"a": 1, "b": {"c": "x"}}, {"a": 1, "b": {"c": "x"}})
    assert shown.claims_unchanged and not shown.changed
    assert [d.path for d in shown.to_show] == ["a", "b.c"]  # every field is still shown
    assert not against_current(None, {}).claims_unchanged  # nothing runs: nothing to claim


def test_a_row_shows_a_field_only_by_its_exact_value_and_type():
    def left_out(runs, headline="late", amount=4200, currency="EUR", current=None):
        return row_shows(current, runs, headline, amount, currency).left_out

    assert left_out({"amount_cents": 4200, "currency": "EUR", "reason": "late"}) == 0
    assert left_out({"amount_cents": "4200", "currency": "EUR"}) == 1  # a string is not the amount
    assert left_out({"amount_cents": True}, amount=1) == 1  # nor is a boolean
    assert left_out({"amount_cents": 4200, "also": 4200}) == 1  # one column shows one field
    assert left_out({"amount_cents": 4200, "currency": "JPY"}, currency="JPY") == 1  # printed as 42.00 JPY
    long = "x" * (ROW_HEADLINE + 1)
    assert left_out({"reason": long}, headline=long) == 1  # the row cuts it
    assert left_out({"reason": "a\nb"}, headline="a\nb") == 1
    assert left_out({"amount_cents": 4200}, current={"amount_cents": 0, "gone": 1}) == 1  # a removed field
    claimed = row_shows({"amount_cents": 4200, "to": "x"}, {"amount_cents": 4200, "to": "x"}, "", 4200, "")
    assert claimed.claims_unchanged and claimed.left_out == 1 and claimed.fields == ("amount_cents",)
