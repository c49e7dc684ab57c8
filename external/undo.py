"""Undo of an external agent's run (runs.compensations' `external` backend, registered by external.apps).

The engine never runs an external agent's actions, so it never runs what undoes them either: an agent declares, in
the successful result of an execution (`POST /api/approval-requests/{id}/result`, `compensation: {action,
arguments}`), the action that undoes it, and an undo of its run asks the agent to run those, each as an approval
request like any other (external.asks: the channel, its policy and two-person rule, the SLA, a card in the inbox).
A person approves each; the agent's client picks them up (`GET /api/approval-requests?compensations=pending`),
consumes each once with its digest and reports its outcome: an agent's undo is once, approved and audited, as
its actions were.

An undo begins when ops cancel and undo the run (runs.compensations.cancel_and_undo calls `begin`) or a person
rejects one of its requests with "reject and undo" (`card_closed`, in the decision's transaction). The run is
`compensating` while the agent has compensations to run (its own requests are refused, as on a cancelled run);
`compensated` once each was executed, or declined (its card rejected, or expired); `compensation_failed` when the
agent reported one failed (parked for a person, never silently). Every change happens with the run's row locked
(the lock order of Approval.decide and external.executions: the run, then its cards and requests)."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import transaction

from approvals.models import Approval, Decision
from core.models import AuditEntry
from external.asks import Ask, open_compensation
from external.errors import RequestError
from external.models import ActionRequest
from external.results import stored_result
from runs import compensations
from runs.compensations import Compensation, Entry
from runs.errors import UndoRefused
from runs.gates import backend as gates_backend
from runs.models import EXTERNAL_WORKFLOW, Receipt, Run

ACTOR = "external.undo"  # who writes its audit entries

# A compensation request's card, once closed without an execution: declined by a person (or by its deadline).
_DECLINED = (Approval.Status.REJECTED, Approval.Status.EXPIRED)


def undo_key(request_id) -> str:
    """The receipt key of the compensation of request `request_id`'s execution: the effect's own key under the undo
    prefix (runs.compensations.Entry.undo_key), so a second compensation of one execution cannot be written."""
    return f"{compensations.UNDO_PREFIX}external:{request_id}"


def _run_by_agent(ctx, key: str, answer: Any) -> dict:
    raise RuntimeError("an external agent's compensation is run by its agent (external.undo), never by the engine")


# --- the registry ------------------------------------------------------------------------------------------------


def registry(run: Run) -> list[Entry]:
    """The run's executed requests (receipt done, result ok) in the order they completed, each with the
    compensation its result declared and, once one was asked, what became of it."""
    executed = (
        ActionRequest.objects.filter(run=run, compensates__isnull=True, receipt__status=Receipt.Status.DONE)
        .select_related("receipt", "channel")
        .order_by("receipt__completed_at", "pk")
    )
    undone_by = {
        request.compensates_id: request
        for request in ActionRequest.objects.filter(run=run, compensates__isnull=False).select_related(
            "receipt", "card"
        )
    }
    shadow_keys = set(run.shadow_effects.values_list("key", flat=True))
    entries = []
    for request in executed:
        receipt = request.receipt
        if not (receipt.response or {}).get("ok"):
            continue
        declared = request.compensation
        entry = Entry(
            key=receipt.key,
            step=request.action,
            seq=request.step_seq,
            channel=request.channel.name,
            completed_at=receipt.completed_at,
            answer=stored_result(receipt.response),
            shadow=receipt.key in shadow_keys,
            compensation=Compensation(call=_run_by_agent, approval=True) if declared else None,
        )
        if declared:
            compensation_request = undone_by.get(request.pk)
            entry.extra = {
                "action": declared["action"],
                "arguments": declared["arguments"],
                "request_id": str(compensation_request.pk) if compensation_request else None,
            }
            if compensation_request is not None:
                _outcome_of(entry, compensation_request)
        entries.append(entry)
    return entries


def _outcome_of(entry: Entry, request: ActionRequest) -> None:
    """What became of a compensation request: done (executed, ok), failed (the agent reported a failure),
    declined (its card rejected or expired), or "" while it waits for a person or the agent."""
    receipt, card = request.receipt, request.card
    if receipt is not None and receipt.status == Receipt.Status.DONE:
        response = receipt.response or {}
        entry.undone_at, entry.undone_by = receipt.completed_at, _deciders(card)
        if response.get("ok"):
            entry.outcome, entry.undo_answer = "done", stored_result(response)
        else:
            entry.outcome, entry.error = "failed", response.get("error", "")
    elif receipt is None and card is not None and card.status in _DECLINED:
        entry.outcome, entry.undone_at = "declined", card.decided_at
        entry.undone_by = _deciders(card) if card.status == Approval.Status.REJECTED else "expired"


def _deciders(card: Approval | None) -> str:
    if card is None:
        return "policy"
    rejected = card.status == Approval.Status.REJECTED
    kinds = ("reject",) if rejected else ("approve", "edit")
    names = [
        d.actor.get_username() if d.actor else "system"
        for d in card.decisions.select_related("actor").order_by("created_at", "pk")
        if d.decision in kinds
    ]
    return ", ".join(dict.fromkeys(names)) or "system"


def pending_compensations(user, run_id=None) -> list[ActionRequest]:
    """The compensations `user`'s agent is to run now (GET /api/approval-requests?compensations=pending): approved,
    not yet consumed, on runs being undone; by run, then in undo order."""
    found = ActionRequest.objects.filter(
        created_by=user,
        compensates__isnull=False,
        receipt__isnull=True,
        card__status__in=(Approval.Status.APPROVED, Approval.Status.EDITED),
        run__status=Run.Status.COMPENSATING,
    )
    if run_id is not None:
        found = found.filter(run_id=run_id)
    return list(
        found.select_related("channel", "card", "receipt", "run").order_by("run__created_at", "run_id", "undo_order")
    )


# --- the undo begins ---------------------------------------------------------------------------------------------


def begin(run: Run, by, reason: str = "cancelled") -> Run:
    """Undo an external run, in the caller's transaction with the run's row locked: `run.cancel` audited (with
    `undo`), the run `compensating` (its pending cards close: nothing of its way forward runs any more), and one
    approval request per execution whose result declared a compensation, opened in the reverse order of the
    executions (`undo_order` 0 first). Refused (UndoRefused) with nothing done when the run is not a live external
    run, when nothing it executed declared a compensation, or while an execution's outcome is unknown (it may need
    undoing too: it is reported, or recorded by a person, first)."""
    if run.workflow != EXTERNAL_WORKFLOW:
        raise UndoRefused("not an external agent's run")
    if run.status != Run.Status.EXTERNAL or run.cancel_requested:
        raise UndoRefused(f"the run is {run.status}: only a live external run can be cancelled and undone")
    unknown = ActionRequest.objects.filter(run=run, receipt__status=Receipt.Status.PENDING).first()
    if unknown is not None:
        raise UndoRefused(
            f"the outcome of {unknown.action} (request {unknown.id}) is unknown: its agent reports it, or a person "
            "records it on the run page, before the run can be undone"
        )
    entries = registry(run)
    pending = compensations.to_undo(entries)
    if not pending:
        if not entries:
            raise UndoRefused("nothing to undo: the run has not executed any action")
        raise UndoRefused(
            "nothing to undo: no executed action of the run declared a compensation (its result's `compensation`): "
            + "; ".join(f"{e.step} ({e.key}): {e.why_not() or 'already undone'}" for e in entries)
        )
    undo = {"undo": True, **({"reason": reason} if reason != "cancelled" else {})}
    run.audit("run.cancel", {"status": run.status, **undo}, actor=by)
    run.begin_external_undo(
        {"outcome": "undoing", "reason": reason, "undo": [e.key for e in pending], "by": _name(by)}, reason=reason
    )
    originals = ActionRequest.objects.select_related("channel", "created_by", "api_token").in_bulk(
        [_request_id(e) for e in pending]
    )
    for order, entry in enumerate(pending):
        original = originals[_request_id(entry)]
        declared = original.compensation
        ask = Ask(
            channel=original.channel.name,
            action=declared["action"],
            arguments=declared["arguments"],
            idempotency_key=f"undo:{original.id}",
            rationale={
                "summary": f"Undo {original.action} ({original.id}), executed {entry.completed_at.isoformat()}: "
                f"the run is being undone ({reason} by {_name(by)}).",
                "rule_id": "compensation",
            },
            risk="high",
        )
        try:
            open_compensation(original, run, ask, order)
        except RequestError as exc:
            raise UndoRefused(f"the compensation of {original.action} cannot be asked: {exc.detail}") from None
    return run


def _request_id(entry: Entry) -> uuid.UUID:
    return uuid.UUID(entry.key.removeprefix("external:"))


def _name(by) -> str:
    if by is None:
        return "system"
    return by if isinstance(by, str) else by.get_username()


def card_closed(sender, card: Approval, **_) -> None:
    """approvals.models.card_closed, in the closing transaction (the run's row locked): a request of an external
    run rejected with "reject and undo" begins its run's undo (refused with the decision, UndoRefused, when it
    cannot); a compensation request rejected or expired is declined, which may end the undo."""
    request = ActionRequest.objects.filter(card=card).only("pk", "run_id", "compensates_id").first()
    if request is None:
        return
    if request.compensates_id is not None:
        if card.status in _DECLINED:
            settle(request.run_id)
        return
    if card.status != Approval.Status.REJECTED:
        return
    asked = Decision.objects.filter(approval=card, decision="reject", undo=True).select_related("actor").last()
    if asked is None:
        return
    run = Run.objects.select_for_update().get(pk=request.run_id)
    begin(run, asked.actor, reason="rejected")


# --- the undo ends -----------------------------------------------------------------------------------------------


def settle(run_id) -> None:
    """A compensation request was resolved (executed, reported failed, declined): its `run.compensation` audit
    entry; then, a failure parks the run (`compensation_failed`, its other compensations' cards closed: nothing
    more is undone until a person looks), and the last resolution ends it (`compensated`, its result listing each
    effect's outcome, audited `run.compensated`). In the caller's transaction; locks the run's row (its callers
    hold it already: the same lock order)."""
    assert transaction.get_connection().in_atomic_block
    run = Run.objects.select_for_update().get(pk=run_id)
    if run.status != Run.Status.COMPENSATING:
        return
    everything = registry(run)
    entries = [e for e in everything if e.undoable]
    recorded = _recorded(run)
    for entry in entries:
        if entry.outcome and recorded.get(entry.key) != entry.outcome:
            compensations.audit_outcome(
                run,
                entry,
                entry.outcome,
                by=entry.undone_by,
                actor=ACTOR,
                request_id=entry.extra.get("request_id"),
                error=entry.error,
            )
    failed = [e for e in entries if e.outcome == "failed"]
    if failed:
        error = "; ".join(f"undoing {e.step} ({e.key}) failed: {e.error}" for e in failed)[:5000]
        run.external_undo_failed(error)
        gates_backend().close_pending(run, "cancelled")
        run.audit("run.compensation_failed", {"error": error, "effects": [e.key for e in failed]}, actor=ACTOR)
        return
    if any(not e.outcome for e in entries if e.extra.get("request_id")):
        return  # a compensation still waits for a person, or for its agent
    result = compensations.result_of(run, everything)
    result["reason"] = (run.result or {}).get("reason") or run.undo_reason
    run.end_external_undo(result)
    run.audit("run.compensated", {"effects": result["effects"]}, actor=ACTOR)


def _recorded(run: Run) -> dict[str, str]:
    """Each effect's last recorded compensation outcome (its `run.compensation` audit entries): written once."""
    found: dict[str, str] = {}
    for data in (
        AuditEntry.objects.filter(run_id=run.id, action="run.compensation")
        .order_by("pk")
        .values_list("data", flat=True)
    ):
        found[data.get("effect", "")] = data.get("outcome", "")
    return found


class ExternalUndo:
    """runs.compensations' backend for external runs (registered by external.apps)."""

    def registry(self, run: Run) -> list[Entry]:
        return registry(run)

    def begin(self, run: Run, by) -> Run:
        return begin(run, by)
