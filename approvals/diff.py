"""What a card changes: a field-level diff of two JSON objects, and a line-level diff of multi-line text.

Pure functions returning plain data (no HTML): the card template renders them, escaped like any other text.
Paths join nested keys with dots (`refund.amount_cents`); lists and other non-objects compare as whole values.
A string that spans several lines (an email body) gets a line diff as well as its before/after values.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any

ADDED, REMOVED, CHANGED, SAME = "added", "removed", "changed", "same"
MARKERS = {ADDED: "+", REMOVED: "\u2212", CHANGED: "~", SAME: " "}

_MISSING = object()


@dataclass(frozen=True)
class Line:
    op: str  # added | removed | same
    text: str

    @property
    def marker(self) -> str:
        return MARKERS[self.op]


@dataclass(frozen=True)
class FieldDiff:
    path: str
    op: str  # added | removed | changed | same
    old: Any = None
    new: Any = None
    lines: list[Line] = field(default_factory=list)  # set for multi-line text

    @property
    def marker(self) -> str:
        return MARKERS[self.op]

    @property
    def old_text(self) -> str:
        return display(self.old)

    @property
    def new_text(self) -> str:
        return display(self.new)


def display(value: Any) -> str:
    """A value as a person reads it: strings as they are, anything else as compact JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def _multiline(value: Any) -> bool:
    return isinstance(value, str) and "\n" in value


def diff_lines(old: str, new: str) -> list[Line]:
    """Line-level diff (difflib): a replaced block shows its removed lines, then its added lines."""
    a, b = old.splitlines(), new.splitlines()
    lines: list[Line] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag == "equal":
            lines += [Line(SAME, text) for text in a[i1:i2]]
            continue
        lines += [Line(REMOVED, text) for text in a[i1:i2]]
        lines += [Line(ADDED, text) for text in b[j1:j2]]
    return lines


def _leaf(path: str, old: Any, new: Any) -> FieldDiff:
    if old is _MISSING:
        op, old = ADDED, None
    elif new is _MISSING:
        op, new = REMOVED, None
    elif type(old) is type(new) and old == new:
        op = SAME
    else:
        op = CHANGED  # 1 and 1.0 (or True) differ: the type is part of what executes
    lines: list[Line] = []
    if op != SAME and (_multiline(old) or _multiline(new)):
        lines = diff_lines(old if isinstance(old, str) else "", new if isinstance(new, str) else "")
    return FieldDiff(path, op, old, new, lines)


def diff_json(old: Any, new: Any, path: str = "") -> list[FieldDiff]:
    """Field-level diff of `new` (proposed) against `old` (current), by path in key order. `old` may be None
    (nothing yet): every field is then added."""
    if old is None and isinstance(new, dict):
        old = {}
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [_leaf(path or "(value)", old, new)]
    diffs: list[FieldDiff] = []
    # Sorted: the database (jsonb) does not keep the agent's key order, and a stable order reads best.
    keys = sorted({*new, *old}, key=str)
    for key in keys:
        child = f"{path}.{key}" if path else str(key)
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += diff_json(a, b, child)
        elif isinstance(b, dict) and a is _MISSING:
            diffs += [_leaf(p.path, _MISSING, p.new) for p in diff_json({}, b, child)]
        elif isinstance(a, dict) and b is _MISSING:
            diffs += [_leaf(p.path, p.new, _MISSING) for p in diff_json({}, a, child)]
        else:
            diffs.append(_leaf(child, a, b))
    return diffs


def changes(old: Any, new: Any) -> list[FieldDiff]:
    """The fields `new` changes, adds or removes against `old` (diff_json without the unchanged ones)."""
    return [d for d in diff_json(old, new) if d.op != SAME]


def summarize(diffs: list[FieldDiff]) -> dict[str, int]:
    counts = {ADDED: 0, REMOVED: 0, CHANGED: 0, SAME: 0}
    for d in diffs:
        counts[d.op] += 1
    return counts


# --- what approving a card runs, as every view shows it ----------------------------------------------------------

# Said wherever a card is shown (the card page, Slack, the inbox row) when the record of the target's current state
# holds every value that would run: the agent says so, which is not the same as "nothing happens". Approving still
# runs the action, with every one of these values, so they are all shown.
CLAIMS_UNCHANGED = (
    "The agent says the target already has these values: approving runs the action with them all the same."
)


@dataclass(frozen=True)
class Shown:
    """What approving runs, field by field, against the server's record of the target's current state (the card's
    `current`, as the card page shows it). The one diff of every view: the card page, Slack and the inbox row; a
    view offers an approve only when it shows every field of `to_show`, whole."""

    fields: list[FieldDiff]  # every field, unchanged ones included

    @property
    def changed(self) -> list[FieldDiff]:
        return [d for d in self.fields if d.op != SAME]

    @property
    def claims_unchanged(self) -> bool:
        """Every field of what runs equals the recorded current state: the agent's claim, not "no change"."""
        return bool(self.fields) and not self.changed

    @property
    def to_show(self) -> list[FieldDiff]:
        """What a view must show in full to offer an approve: every field that runs, the changed ones first. An
        unchanged field runs too, and that it is unchanged is only what the record of the current state says (an
        external agent's own word): a view that hid it would let an agent hide a field by claiming it."""
        return self.changed + [d for d in self.fields if d.op == SAME]

    @property
    def counts(self) -> dict[str, int]:
        return summarize(self.fields)


def against_current(current: Any, runs: Any) -> Shown:
    """`runs` (a proposal, an edit: what would execute) against `current` (the card's record of the target)."""
    return Shown(diff_json(current, runs))
