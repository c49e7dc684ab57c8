"""The candidate language of an offline evaluation (docs/evaluate.md): a candidate approval rule, read from JSON and
checked here with errors that name the path of what is wrong, and what it would have done with one recorded card.

A pure module (no database): `Candidate.parse` checks a candidate, `Candidate.action_for` answers for one card as
evals.records reads it, so that the rule is tested in milliseconds (tests/unit/test_eval_candidates.py).

    {"name": "auto-approve refunds under 50 EUR",
     "rules": [{"if": {"channel": "payments", "currency": "EUR", "amount_below": 5000}, "then": "auto_approve"}],
     "otherwise": "ask",
     "quorum": {"channel": "payments", "approvers": 2}}

The first rule whose every condition holds decides; none: `otherwise` (default "ask"). A card without an amount
never matches an amount condition. A string condition takes one value or a list of them (any of them matches).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from approvals.models import Risk
from core.periods import parse_when, period  # noqa: F401 - the period of an evaluation
from evals.errors import CandidateInvalid
from runs.gates import Kind


class Action:
    AUTO_APPROVE = "auto_approve"
    REFUSE = "refuse"
    ASK = "ask"


ACTIONS = (Action.AUTO_APPROVE, Action.REFUSE, Action.ASK)
# What the candidate decides by itself, without a person: the cards whose reviewer time it would have saved.
DECIDES_ITSELF = (Action.AUTO_APPROVE, Action.REFUSE)

# The conditions of a rule's `if`: the card's column each one reads, and the values it may take (None: any string).
TEXT_CONDITIONS = {
    "channel": None,
    "workflow": None,
    "kind": tuple(Kind.values),
    "risk": tuple(Risk.values),
    "tool": None,  # an agent's tool card: its rule_id is "tool:<name>"
    "rule_id": None,
    "currency": None,
}
AMOUNT_CONDITIONS = ("amount_below", "amount_at_least")  # minor units (cents), as the card's amount_minor
TOP_KEYS = ("name", "rules", "otherwise", "quorum")
QUORUM_KEYS = ("channel", "approvers")
MAX_RULES = 100
MAX_APPROVERS = 10


@dataclass(frozen=True)
class Rule:
    """One `{"if": {...}, "then": action}`: text conditions as sets of accepted values, amounts as bounds."""

    then: str
    text: dict[str, frozenset[str]] = field(default_factory=dict)
    amount_below: int | None = None
    amount_at_least: int | None = None

    def matches(self, card) -> bool:
        for name, accepted in self.text.items():
            if _card_value(card, name) not in accepted:
                return False
        if self.amount_below is not None or self.amount_at_least is not None:
            amount = card.amount_minor
            if amount is None:
                return False
            if self.amount_below is not None and not amount < self.amount_below:
                return False
            if self.amount_at_least is not None and not amount >= self.amount_at_least:
                return False
        return True


@dataclass(frozen=True)
class Quorum:
    """A quorum change: the cards of `channel` (every channel when empty) need `approvers` distinct people."""

    approvers: int
    channel: str = ""

    def applies_to(self, card) -> bool:
        return not self.channel or card.channel == self.channel


@dataclass(frozen=True)
class Candidate:
    name: str
    rules: tuple[Rule, ...]
    otherwise: str = Action.ASK
    quorum: tuple[Quorum, ...] = ()

    @classmethod
    def parse(cls, raw: str | bytes | dict) -> Candidate:
        """The candidate in `raw` (JSON text or its parsed object), or CandidateInvalid listing every error, each
        with the path of the value it is about ("rules[0].if.amount_below")."""
        if isinstance(raw, str | bytes):
            try:
                raw = json.loads(raw)
            except ValueError as exc:
                raise CandidateInvalid([f"$: not valid JSON ({exc})"]) from None
        errors: list[str] = []
        candidate = _candidate(raw, errors)
        if errors:
            raise CandidateInvalid(errors)
        return candidate

    def action_for(self, card) -> str:
        """What the candidate does with `card` (an object with the columns evals.records reads)."""
        for rule in self.rules:
            if rule.matches(card):
                return rule.then
        return self.otherwise

    def quorum_for(self, card) -> int:
        """How many distinct people the candidate asks to approve `card` (0: its quorum says nothing of it)."""
        return max((q.approvers for q in self.quorum if q.applies_to(card)), default=0)


def _card_value(card, name: str) -> str:
    if name == "tool":
        return card.rule_id[len("tool:") :] if card.rule_id.startswith("tool:") else ""
    return getattr(card, name)


def _candidate(raw, errors: list[str]) -> Candidate | None:
    if not isinstance(raw, dict):
        errors.append(f"$: must be an object, not {_type(raw)}")
        return None
    _unknown(raw, TOP_KEYS, "$", errors)
    name = raw.get("name", "")
    if not isinstance(name, str) or len(name) > 200:
        errors.append("$.name: must be a string of at most 200 characters")
        name = ""
    rules = raw.get("rules", [])
    parsed: list[Rule] = []
    if not isinstance(rules, list):
        errors.append(f"$.rules: must be a list, not {_type(rules)}")
    elif len(rules) > MAX_RULES:
        errors.append(f"$.rules: at most {MAX_RULES} rules")
    else:
        for i, rule in enumerate(rules):
            one = _rule(rule, f"$.rules[{i}]", errors)
            if one is not None:
                parsed.append(one)
    otherwise = _action(raw.get("otherwise", Action.ASK), "$.otherwise", errors)
    quorum = _quorum(raw.get("quorum"), errors)
    if not rules and not quorum and "otherwise" not in raw and not errors:
        errors.append("$: a candidate needs rules, an `otherwise` or a quorum (else it changes nothing)")
    return Candidate(name=name, rules=tuple(parsed), otherwise=otherwise, quorum=quorum)


def _rule(raw, path: str, errors: list[str]) -> Rule | None:
    if not isinstance(raw, dict):
        errors.append(f"{path}: must be an object, not {_type(raw)}")
        return None
    _unknown(raw, ("if", "then"), path, errors)
    if "then" not in raw:
        errors.append(f"{path}.then: required (one of {', '.join(ACTIONS)})")
    then = _action(raw.get("then"), f"{path}.then", errors) if "then" in raw else Action.ASK
    conditions = raw.get("if", {})
    if not isinstance(conditions, dict):
        errors.append(f"{path}.if: must be an object, not {_type(conditions)}")
        return None
    _unknown(conditions, (*TEXT_CONDITIONS, *AMOUNT_CONDITIONS), f"{path}.if", errors)
    text = {}
    for name, allowed in TEXT_CONDITIONS.items():
        if name in conditions:
            text[name] = _texts(conditions[name], allowed, f"{path}.if.{name}", errors)
    amounts = {}
    for name in AMOUNT_CONDITIONS:
        if name in conditions:
            amounts[name] = _amount(conditions[name], f"{path}.if.{name}", errors)
    return Rule(then=then, text=text, **amounts)


def _texts(raw, allowed: tuple[str, ...] | None, path: str, errors: list[str]) -> frozenset[str]:
    values = raw if isinstance(raw, list) else [raw]
    if not values:
        errors.append(f"{path}: an empty list matches no card")
    for value in values:
        if not isinstance(value, str):
            errors.append(f"{path}: must be a string or a list of strings, not {_type(value)}")
        elif allowed is not None and value not in allowed:
            errors.append(f"{path}: unknown value {value!r} (one of {', '.join(allowed)})")
    return frozenset(v for v in values if isinstance(v, str))


def _amount(raw, path: str, errors: list[str]) -> int | None:
    # bool is an int to Python, never an amount here.
    if not isinstance(raw, int) or isinstance(raw, bool) or not 0 <= raw <= 2**53:
        errors.append(f"{path}: must be a whole number of minor units (cents) from 0 to 2**53, not {raw!r}")
        return None
    return raw


def _action(raw, path: str, errors: list[str]) -> str:
    if raw not in ACTIONS:
        errors.append(f"{path}: unknown action {raw!r} (one of {', '.join(ACTIONS)})")
        return Action.ASK
    return raw


def _quorum(raw, errors: list[str]) -> tuple[Quorum, ...]:
    if raw is None:
        return ()
    many = raw if isinstance(raw, list) else [raw]
    found = []
    for i, one in enumerate(many):
        path = f"$.quorum[{i}]" if isinstance(raw, list) else "$.quorum"
        if not isinstance(one, dict):
            errors.append(f"{path}: must be an object, not {_type(one)}")
            continue
        _unknown(one, QUORUM_KEYS, path, errors)
        approvers, channel = one.get("approvers"), one.get("channel", "")
        if not isinstance(approvers, int) or isinstance(approvers, bool) or not 1 <= approvers <= MAX_APPROVERS:
            errors.append(f"{path}.approvers: required, a whole number from 1 to {MAX_APPROVERS}, not {approvers!r}")
            continue
        if not isinstance(channel, str):
            errors.append(f"{path}.channel: must be a string, not {_type(channel)}")
            continue
        found.append(Quorum(approvers=approvers, channel=channel))
    return tuple(found)


def _unknown(raw: dict, known: tuple[str, ...], path: str, errors: list[str]) -> None:
    for key in raw:
        if key not in known:
            errors.append(f"{path}.{key}: unknown key (known: {', '.join(known)})")


def _type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
