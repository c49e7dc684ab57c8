"""Where the engine hands a request for a person. The engine knows nothing of cards: the approvals app
registers a backend at start-up (`approvals.apps`), and the engine only calls this interface.

Here too is what both sides read of a gate: the request and its decision, and a gate's declaration (GateSpec:
what a person may change in a proposal, and the card's display hints), whose one validator of an edit serves the
card form, the API, bulk decisions (approvals.edits) and the engine. A leaf: it imports nothing of ours (the
engine's models call the backend, so the backend's `run` is typed as a model, not as runs.models.Run)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from django.db import models
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError


class Kind(models.TextChoices):
    """What a card asks."""

    ACTION = "action"  # approve what the agent wants to do
    RECONCILE = "reconcile"  # did an ambiguous write happen?
    BUDGET = "budget"  # the run crossed its cost limit: extend or stop
    UNDO = "undo"  # undo what the run did (runs.compensations): the run's undo, or one gated compensation
    UNDO_FAILED = "undo_failed"  # a compensation failed for good: try it again, or a person does it by hand


class Outcome(models.TextChoices):
    """What a decided card tells the engine (a gate step's output `decision`), which the engine, the agent loop and
    the dead-letter queue read: approved as proposed, approved as a person edited it, or rejected. A decided
    card's status (approvals.models.ApprovalStatus) is one of these values."""

    APPROVED = "approved"
    EDITED = "edited"
    REJECTED = "rejected"


@dataclass(frozen=True)
class ApprovalRequest:
    """What a person is asked to decide: the proposal, the current state it changes, and why."""

    channel: str
    proposed: dict
    current: dict | None = None
    summary: str = ""
    rule_id: str = ""
    confidence: float | None = None
    citations: list[dict] = field(default_factory=list)
    risk: str = "medium"
    kind: str = Kind.ACTION

    def args_hash(self) -> str:
        """Binds a decision to exactly what was proposed: a different proposal needs a new decision. A budget
        card's question is where the run crossed its limit (`current`: spent and limit), not its proposal, which
        depends on a ceiling that may be lowered while the card waits: the answer still stands (held to the
        ceiling by the engine)."""
        if self.kind == Kind.BUDGET:
            return canonical_hash({"kind": self.kind, "channel": self.channel, "current": self.current})
        return canonical_hash({"kind": self.kind, "channel": self.channel, "proposed": self.proposed})

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    decision: Outcome
    payload: dict | None
    comment: str = ""
    reason: str = ""
    by: str = ""
    # What the card proposed: the engine checks an edit against it again before the step acts on it
    # (runs.steps.check_decided_edit). Not part of the step's output.
    proposed: dict | None = None
    # A rejection that also asks for what the run did to be undone ("reject and undo": runs.compensations).
    undo: bool = False

    @property
    def rejected(self) -> bool:
        return self.decision == Outcome.REJECTED

    def as_output(self) -> dict[str, Any]:
        output = asdict(self)
        del output["proposed"]
        if not self.undo:
            del output["undo"]  # a gate's output is as it always was unless an undo was asked for
        return {**output, "decision": str(self.decision)}  # a plain string in the step's JSON


@dataclass(frozen=True)
class Display:
    """How a gate's card shows its proposal: paths into it (dotted) for the headline and the amount column."""

    headline: str | None = None
    amount_minor: str | None = None  # an amount in minor units (cents)
    currency: str | None = None

    def values(self, proposed: Any) -> dict:
        return {
            "headline": str(leaf(proposed, self.headline) or "")[:300],
            "amount_minor": _int_or_none(leaf(proposed, self.amount_minor)),
            "currency": str(leaf(proposed, self.currency) or "")[:3],
        }


ANY_LEAF = ("*",)  # GateSpec.editable: a person may change any leaf (keeping the proposal's schema)


@dataclass(frozen=True)
class GateSpec:
    """What a person may do with a gate's proposal: its schema, the leaves they may edit (dotted paths), a check
    of an edit against the proposal (bounds such as "no more than proposed"), and display hints. One validator,
    `edit_errors`, serves the card form, the API and bulk decisions (approvals.models.Approval.decide)."""

    proposal: type[BaseModel] | None = None
    editable: tuple[str, ...] = ()
    check_edit: Callable[[dict, dict], list[dict]] | None = None
    display: Display = field(default_factory=Display)
    # The approval policy (approvals.models.ApprovalPolicy, by name) its cards follow, over their channel's.
    policy: str = ""

    def accepts_edits(self) -> bool:
        """Whether a person may edit the proposal at all (the card offers an edit)."""
        return True

    def edit_errors(self, proposed: dict, edited: Any) -> list[dict]:
        if not isinstance(edited, dict):
            return [{"loc": "payload", "msg": "must be an object"}]
        if self.proposal is None and not self.editable:  # declares nothing: any value, the proposal's shape
            errors = shape_errors(proposed, edited)
        elif self.editable == ANY_LEAF:  # any value, but no leaf the proposal does not have
            errors = [
                {"loc": p, "msg": "is not part of the proposal"}
                for p in sorted(set(leaves(edited)) - set(leaves(proposed)))
            ]
        else:
            errors = [
                {"loc": path, "msg": "may not be changed"}
                for path in sorted(set(leaves(proposed)) | set(leaves(edited)))
                if path not in self.editable and leaf(proposed, path, _MISSING) != leaf(edited, path, _MISSING)
            ]
        if self.proposal is not None:
            errors += schema_errors(self.proposal, edited)
        if not errors and self.check_edit is not None:
            errors += self.check_edit(proposed, edited)
        return errors


_MISSING = object()


def schema_errors(schema: type[BaseModel], value: Any, prefix: str = "") -> list[dict]:
    """The field errors of `value` against a pydantic model, each {loc: "a.b", msg}; [] when it is valid."""
    try:
        schema.model_validate(value)
    except PydanticValidationError as exc:
        return [
            {"loc": ".".join(str(part) for part in (prefix, *error["loc"]) if part != ""), "msg": error["msg"]}
            for error in exc.errors(include_url=False, include_context=False, include_input=False)
        ]
    return []


def shape_errors(proposed: Any, edited: Any, path: str = "") -> list[dict]:
    """Where `edited` does not keep the shape of `proposed`: a missing or added key, or a value of another type."""
    if isinstance(proposed, dict):
        if not isinstance(edited, dict):
            return [{"loc": path or "payload", "msg": "must be an object"}]
        errors = []
        for key in edited.keys() - proposed.keys():
            errors.append({"loc": f"{path}.{key}" if path else str(key), "msg": "is not part of the proposal"})
        for key, value in proposed.items():
            child = f"{path}.{key}" if path else str(key)
            if key not in edited:
                errors.append({"loc": child, "msg": "is required"})
            else:
                errors += shape_errors(value, edited[key], child)
        return errors
    if proposed is None:
        return []
    expected = type(proposed)
    if expected is float and type(edited) is int:
        return []  # 10 for 10.0 is the same number
    if type(edited) is not expected:
        names = {bool: "true or false", int: "a whole number", float: "a number", str: "text", list: "a list"}
        return [{"loc": path or "payload", "msg": f"must be {names.get(expected, expected.__name__)}"}]
    return []


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a JSON object by dotted path (a non-empty object is not a leaf; lists are)."""
    if not isinstance(value, dict) or (not value and prefix):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(leaves(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def leaf(value: Any, path: str | None, default: Any = None) -> Any:
    if not path:
        return default
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63 else None


class GateBackend(Protocol):
    def open(self, run: models.Model, seq: int, request: ApprovalRequest) -> None:
        """Open a card for `request` (called inside the transaction that parks the run)."""

    def decision(self, run: models.Model, seq: int, request: ApprovalRequest) -> Decision | None:
        """The decision taken on the card for exactly this request, if any."""

    def decided(self, run: models.Model, seq: int) -> Decision | None:
        """The decision taken on the gate at `seq` (its latest decided action card), whatever it asked: a
        decided gate is replayed from it, never asked again."""

    def shadow_of(self, run: models.Model, seq: int, channel: str) -> bool | None:
        """Whether the person who authorized an effect at `seq` on `channel` decided a shadow card (they did it by
        hand): the latest decided action card of the run on that channel at `seq` or before; None when no card
        authorized it. Shadow mode is decided once, when that card opened, and the effect follows it."""

    def close_pending(self, run: models.Model, status: str) -> None:
        """Close the run's pending cards (cancelled, or the run failed)."""


_backend: GateBackend | None = None


def register(backend: GateBackend) -> None:
    global _backend
    _backend = backend


def backend() -> GateBackend:
    if _backend is None:
        raise RuntimeError("No gate backend registered: is the approvals app installed?")
    return _backend


def canonical_hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()
