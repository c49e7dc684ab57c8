"""Where the engine hands a request for a person. The engine knows nothing of cards: the approvals app
registers a backend at start-up (`approvals.apps`), and the engine only calls this interface."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from django.db import models

if TYPE_CHECKING:
    from runs.models import Run


class Kind(models.TextChoices):
    """What a card asks."""

    ACTION = "action"  # approve what the agent wants to do
    RECONCILE = "reconcile"  # did an ambiguous write happen?
    BUDGET = "budget"  # the run crossed its cost limit: extend or stop


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
    decision: str  # approved | edited | rejected
    payload: dict | None
    comment: str = ""
    reason: str = ""
    by: str = ""
    # What the card proposed: the engine checks an edit against it again before the step acts on it
    # (runs.workflow.check_decided_edit). Not part of the step's output.
    proposed: dict | None = None

    @property
    def rejected(self) -> bool:
        return self.decision == "rejected"

    def as_output(self) -> dict[str, Any]:
        output = asdict(self)
        del output["proposed"]
        return output


class GateBackend(Protocol):
    def open(self, run: Run, seq: int, request: ApprovalRequest) -> None:
        """Open a card for `request` (called inside the transaction that parks the run)."""

    def decision(self, run: Run, seq: int, request: ApprovalRequest) -> Decision | None:
        """The decision taken on the card for exactly this request, if any."""

    def decided(self, run: Run, seq: int) -> Decision | None:
        """The decision taken on the gate at `seq` (its latest decided action card), whatever it asked: a
        decided gate is replayed from it, never asked again."""

    def shadow_of(self, run: Run, seq: int, channel: str) -> bool | None:
        """Whether the person who authorized an effect at `seq` on `channel` decided a shadow card (they did it by
        hand): the latest decided action card of the run on that channel at `seq` or before; None when no card
        authorized it. Shadow mode is decided once, when that card opened, and the effect follows it."""

    def close_pending(self, run: Run, status: str) -> None:
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
