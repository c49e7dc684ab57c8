"""The one validator of an edit decision, called inside Approval.decide() (so the card form, the API and bulk
decisions all pass through it): what executes is a payload the card's declaration allows.

- action cards: the gate's declaration in its workflow (runs.gates.GateSpec: proposal schema, editable leaves,
  bounds); a gate that declares nothing may change values but not the proposal's shape (keys and types). When
  this process cannot find the gate (the run's workflow version is not deployed here, or has no such step), the
  edit is refused (GateUnresolved), never checked less. The engine checks a decided edit again before the step
  acts on it (runs.steps.check_decided_edit).
- budget cards: only `cost_limit`, a decimal above the run's spent cost and at most BUDGET_CEILING; or, for an
  agent's turn limit (runs.agent), only `max_turns`, a whole number above the turns taken, at most AGENT_MAX_TURNS.
  Approving one as proposed raises the limit too, so it is held to the same ceiling (`approval_refusal`).
- reconcile cards: not edited (approve: it happened; reject: it did not).

Errors are [{loc, msg}], loc a dotted path into the payload.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from django.conf import settings

from core import pii
from runs import workflow as workflows
from runs.errors import UnknownWorkflow
from runs.gates import ANY_LEAF, GateSpec, Kind

if TYPE_CHECKING:
    from approvals.models import Approval


class GateUnresolved(LookupError):
    """This process cannot find the step of an action card's gate (the run's workflow version is not deployed
    here, or that version has no such step: web and worker disagree on WORKFLOW_MODULES, a deploy is under way),
    so it cannot check an edit of it. Approval.decide refuses the edit (409) rather than check it less."""


# Cards whose gate is not a workflow's step (an external agent's approval requests: external.models) are
# resolved by the app that opens them, registered here by the run's workflow name at start-up.
_resolvers: dict[str, Callable[[Approval], GateSpec | None]] = {}


def register_resolver(workflow: str, resolve: Callable[[Approval], GateSpec | None]) -> None:
    _resolvers[workflow] = resolve


def gate_spec(card: Approval) -> GateSpec | None:
    """The declaration of the gate this action card belongs to (the run's pinned workflow version): None for
    other cards, or when the card's step declares no gate (it asks with ctx.gate). Raises GateUnresolved."""
    if card.kind != Kind.ACTION:
        return None
    run = card.run
    if (resolve := _resolvers.get(run.workflow)) is not None:
        return resolve(card)
    workflow, retry = f"workflow {run.workflow} v{run.workflow_version}", "try again once the deploy is complete"
    try:
        step = workflows.get(run.workflow, run.workflow_version).step_of(run, card.step_seq)
    except UnknownWorkflow as exc:
        raise GateUnresolved(f"this console cannot load {workflow}, so it cannot check the edit: {retry}") from exc
    if step is None:
        raise GateUnresolved(
            f"this console cannot find the step at seq {card.step_seq} of {workflow}, so it cannot check the edit: "
            + retry
        )
    return step.gate


# Cards that are answered yes or no, never edited: did an ambiguous write happen; undo what a run did; a
# compensation that failed for good (try again, or done by hand).
NOT_EDITED = {
    Kind.RECONCILE: "a reconcile card is approved (it happened) or rejected, not edited",
    Kind.UNDO: "an undo card is approved (undo it) or rejected (leave it done), not edited",
    Kind.UNDO_FAILED: "a failed undo's card is approved (try again) or rejected (done by hand), not edited",
}


def accepts_edits(card: Approval) -> bool:
    """Whether the card offers an edit: not a reconcile or undo card, nor a gate that takes none (an external
    request without a schema). A gate this process cannot resolve offers it: the edit is then refused, saying why."""
    if card.kind in NOT_EDITED:
        return False
    try:
        spec = gate_spec(card)
    except GateUnresolved:
        return True
    return spec is None or spec.accepts_edits()


def editable_paths(card: Approval) -> tuple[str, ...] | None:
    """The leaves a person may change, or None when the gate declares none (every leaf, same shape); None too
    when the gate cannot be found here (the form offers every leaf; the edit is then refused, saying why)."""
    if card.kind == Kind.BUDGET:
        return ("max_turns",) if "max_turns" in card.proposed else ("cost_limit",)
    try:
        spec = gate_spec(card)
    except GateUnresolved:
        return None
    return spec.editable if spec is not None and spec.editable and spec.editable != ANY_LEAF else None


def edit_errors(card: Approval, payload: Any) -> list[dict]:
    """Raises GateUnresolved for an action card whose gate this process cannot find."""
    if card.kind in NOT_EDITED:
        return [{"loc": "decision", "msg": NOT_EDITED[card.kind]}]
    if card.kind == Kind.BUDGET:
        return _budget_errors(card, payload)
    # A gate that declares nothing (or a step that asks without declaring a gate): same shape, any values.
    # Personal data is kept as references (approvals.personal) but declared as the values they stand for (an
    # email's pattern): the edit is checked on those, opened here and nowhere shown. A missing key raises.
    spec = gate_spec(card) or GateSpec()
    return spec.edit_errors(pii.present(card.proposed, clear=True), pii.present(payload, clear=True))


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
    if limit <= card.run.cost:  # a limit the run has reached already would stop it again at once
        return [{"loc": "cost_limit", "msg": f"must be more than what the run has spent ({card.run.cost})"}]
    if limit > settings.BUDGET_CEILING:
        return [{"loc": "cost_limit", "msg": f"must be at most {settings.BUDGET_CEILING} (BUDGET_CEILING)"}]
    if limit.as_tuple().exponent < -6:
        return [{"loc": "cost_limit", "msg": "has at most 6 decimal places"}]
    return []


def approval_refusal(card: Approval) -> str:
    """Why `card` cannot be approved as it stands, or "". A budget card's approval raises a limit: not past its
    ceiling (a card opened before BUDGET_CEILING or AGENT_MAX_TURNS was lowered), and not when the run has
    reached the ceiling already (its card proposes the ceiling, which leaves no room: it can only stop the run)."""
    if card.kind != Kind.BUDGET:
        return ""
    limit = card.to_execute or card.proposed  # under the two-person rule, a pending edit is what the approval runs
    if "max_turns" in card.proposed:
        what, name, ceiling = "turn limit", "AGENT_MAX_TURNS", settings.AGENT_MAX_TURNS
        proposed, used = limit["max_turns"], (card.current or {}).get("turns", 0)
        used_text = f"the agent has taken {used} turns"
    else:
        what, name, ceiling = "cost limit", "BUDGET_CEILING", Decimal(str(settings.BUDGET_CEILING))
        proposed, used = Decimal(str(limit["cost_limit"])), card.run.cost
        used_text = f"the run has spent {used}"
    if used >= ceiling:
        return f"the ceiling is reached ({used_text}; {name} is {ceiling}): raise {name} or stop the run"
    if proposed > ceiling:
        return (
            f"this card proposes a {what} of {proposed}, above {name} ({ceiling}), lowered since it opened: "
            f"edit it to at most {ceiling}, or stop the run"
        )
    if proposed <= used:
        return f"this card's {what} of {proposed} leaves no room ({used_text}): edit it to more, or stop the run"
    return ""


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


def as_text(errors: list[dict]) -> str:
    return "; ".join(f"{e['loc']} {e['msg']}" for e in errors)
