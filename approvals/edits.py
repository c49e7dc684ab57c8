"""The one validator of an edit decision, called inside Approval.decide() (so the card form, the API and bulk
decisions all pass through it): what executes is a payload the card's declaration allows.

- action cards: the gate's declaration in its workflow (runs.workflow.GateSpec: proposal schema, editable leaves,
  bounds); a gate that declares nothing may change values but not the proposal's shape (keys and types).
- budget cards: only `cost_limit`, a decimal at least the run's spent cost and at most BUDGET_CEILING; or, for an
  agent's turn limit (runs.agent), only `max_turns`, a whole number above the turns taken, at most AGENT_MAX_TURNS.
- reconcile cards: not edited (approve: it happened; reject: it did not).

Errors are [{loc, msg}], loc a dotted path into the payload.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from django.conf import settings

from runs import workflow as workflows
from runs.gates import Kind
from runs.workflow import ANY_LEAF, GateSpec, UnknownWorkflow

if TYPE_CHECKING:
    from approvals.models import Approval


def gate_spec(card: Approval) -> GateSpec | None:
    """The declaration of the gate this card belongs to (the run's pinned workflow version), if any."""
    if card.kind != Kind.ACTION:
        return None
    try:
        step = workflows.get(card.run.workflow, card.run.workflow_version).step_of(card.run, card.step_seq)
    except UnknownWorkflow:
        return None
    return step.gate if step is not None else None


def editable_paths(card: Approval) -> tuple[str, ...] | None:
    """The leaves a person may change, or None when the gate declares none (every leaf, same shape)."""
    if card.kind == Kind.BUDGET:
        return ("max_turns",) if "max_turns" in card.proposed else ("cost_limit",)
    spec = gate_spec(card)
    return spec.editable if spec is not None and spec.editable and spec.editable != ANY_LEAF else None


def edit_errors(card: Approval, payload: Any) -> list[dict]:
    if card.kind == Kind.RECONCILE:
        return [{"loc": "decision", "msg": "a reconcile card is approved (it happened) or rejected, not edited"}]
    if card.kind == Kind.BUDGET:
        return _budget_errors(card, payload)
    spec = gate_spec(card)
    if spec is not None and (spec.proposal is not None or spec.editable):
        return spec.edit_errors(card.proposed, payload)
    return [{"loc": loc or "payload", "msg": msg} for loc, msg in type_errors(card.proposed, payload)]


def _budget_errors(card: Approval, payload: Any) -> list[dict]:
    if "max_turns" in card.proposed:
        return _turn_limit_errors(card, payload)
    if not isinstance(payload, dict) or set(payload) != {"cost_limit"}:
        return [{"loc": "payload", "msg": "must be {cost_limit} and nothing else"}]
    raw = payload["cost_limit"]
    try:
        if isinstance(raw, bool) or not isinstance(raw, str | int):
            raise InvalidOperation
        limit = Decimal(str(raw))
        if not limit.is_finite():
            raise InvalidOperation
    except InvalidOperation:
        return [{"loc": "cost_limit", "msg": 'must be a decimal number, such as "2.50"'}]
    if limit < card.run.cost:
        return [{"loc": "cost_limit", "msg": f"must be at least what the run has spent ({card.run.cost})"}]
    if limit > settings.BUDGET_CEILING:
        return [{"loc": "cost_limit", "msg": f"must be at most {settings.BUDGET_CEILING} (BUDGET_CEILING)"}]
    if limit.as_tuple().exponent < -6:
        return [{"loc": "cost_limit", "msg": "has at most 6 decimal places"}]
    return []


def _turn_limit_errors(card: Approval, payload: Any) -> list[dict]:
    if not isinstance(payload, dict) or set(payload) != {"max_turns"}:
        return [{"loc": "payload", "msg": "must be {max_turns} and nothing else"}]
    value, taken = payload["max_turns"], (card.current or {}).get("turns", 0)
    if isinstance(value, bool) or not isinstance(value, int):
        return [{"loc": "max_turns", "msg": "must be a whole number"}]
    if value <= taken:
        return [{"loc": "max_turns", "msg": f"must be more than the turns taken ({taken})"}]
    if value > settings.AGENT_MAX_TURNS:
        return [{"loc": "max_turns", "msg": f"must be at most {settings.AGENT_MAX_TURNS} (AGENT_MAX_TURNS)"}]
    return []


def type_errors(proposed: Any, edited: Any, path: str = "") -> list[tuple[str, str]]:
    """Where `edited` does not keep the shape of `proposed`: a missing or added key, or a value of another type."""
    if isinstance(proposed, dict):
        if not isinstance(edited, dict):
            return [(path, "must be an object")]
        errors = []
        for key in edited.keys() - proposed.keys():
            errors.append((f"{path}.{key}" if path else str(key), "is not part of the proposal"))
        for key, value in proposed.items():
            child = f"{path}.{key}" if path else str(key)
            if key not in edited:
                errors.append((child, "is required"))
            else:
                errors += type_errors(value, edited[key], child)
        return errors
    if proposed is None:
        return []
    expected = type(proposed)
    if expected is float and type(edited) is int:
        return []  # 10 for 10.0 is the same number
    if type(edited) is not expected:
        names = {bool: "true or false", int: "a whole number", float: "a number", str: "text", list: "a list"}
        return [(path, f"must be {names.get(expected, expected.__name__)}")]
    return []


def as_text(errors: list[dict]) -> str:
    return "; ".join(f"{e['loc']} {e['msg']}" for e in errors)
