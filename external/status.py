"""What an external agent is told of its request (external.models.ActionRequest): its state, as
GET /api/approval-requests/{id} shows it (the decision, the arguments to execute and their digest, the execution),
read as of now (for_user applies an expiry that no timer job applied yet); and, when its card closes, the end of a
rejected or expired request's step and the decision sent to its callback.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django.utils import timezone

from approvals import sla
from approvals.models import Approval
from core import pii
from external import callbacks
from external.errors import NotFound
from external.models import ActionRequest
from external.results import stored_result
from runs.models import Receipt, Step

# What the agent is told of a card's status.
_STATUS = {
    Approval.Status.PENDING: "pending",
    Approval.Status.ESCALATED: "pending",
    Approval.Status.APPROVED: "approved",
    Approval.Status.EDITED: "approved",
    Approval.Status.REJECTED: "rejected",
    Approval.Status.EXPIRED: "expired",
    Approval.Status.CANCELLED: "cancelled",
}


def canonical(arguments: Any) -> bytes:
    """The arguments' canonical JSON: sorted keys, no whitespace, UTF-8 (what the digest is of)."""
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def digest(arguments: Any) -> str:
    """SHA-256 hex of the canonical JSON: what an agent names when it consumes an approval."""
    return hashlib.sha256(canonical(arguments)).hexdigest()


# --- what the agent is told --------------------------------------------------------------------------------------


def for_agent(arguments: Any) -> Any:
    """The arguments as the agent that asked executes them: its personal values in clear (it sent them; the console
    keeps references, approvals.personal), "[erased]" for an erased subject's. A missing or wrong key raises."""
    return pii.present(arguments, clear=True) if arguments is not None else None


def stored_arguments(request: ActionRequest) -> Any:
    """What runs as the console keeps it (references): for its receipt and audit entries, never sent as such."""
    card = request.card
    if card is None:
        return request.arguments
    return card.to_execute if card.status in (Approval.Status.APPROVED, Approval.Status.EDITED) else None


def state(request: ActionRequest) -> dict:
    """The request as GET /api/approval-requests/{id} shows it: the decision, what to execute (in clear: for_agent;
    its digest is of that), the execution."""
    card = request.card
    if card is None:  # approval: never
        status, decided_by, decided_at, comment, reason = "approved", "policy", request.created_at, "", ""
        to_execute, edited = request.arguments, False
    else:
        status = _STATUS[card.status]
        last = card.decisions.select_related("actor").order_by("-created_at").first()
        comment, reason = (last.comment, last.reason) if last else ("", "")
        decided_at = card.decided_at
        decided_by = _deciders(card) if status in ("approved", "rejected") else None
        to_execute = card.to_execute if status == "approved" else None
        edited = card.status == Approval.Status.EDITED
    to_execute = for_agent(to_execute)
    return {
        "id": str(request.id),
        "run_id": str(request.run_id),
        "card_id": request.card_id,
        "channel": request.channel.name,
        "action": request.action,
        "status": status,
        "arguments": to_execute,
        "arguments_digest": digest(to_execute) if to_execute is not None else None,
        "edited": edited,
        "decided_by": decided_by,
        "decided_at": decided_at,
        "comment": comment,
        "reason": reason,
        "expires_at": request.expires_at,
        "shadow": bool(card and card.shadow),
        "execution": execution(request),
        "compensates": str(request.compensates_id) if request.compensates_id else None,
        "undo_order": request.undo_order,
    }


def _deciders(card: Approval) -> str:
    decisions = list(card.decisions.select_related("actor").order_by("created_at"))
    if card.status == Approval.Status.REJECTED:
        counted = [d for d in decisions if d.decision == "reject"]
    else:
        last_edit = max((i for i, d in enumerate(decisions) if d.decision == "edit"), default=0)
        counted = [d for d in decisions[last_edit:] if d.decision in ("approve", "edit")]
    return ", ".join(dict.fromkeys(d.actor.get_username() if d.actor else "system" for d in counted)) or "system"


def execution(request: ActionRequest) -> dict:
    """The one execution: not started, pending (consumed, no outcome reported: unknown), succeeded or failed."""
    receipt = request.receipt
    if receipt is None:
        return {"status": "not_started", "consumed_at": None, "completed_at": None, "result": None, "error": ""}
    response = receipt.response or {}
    outcome = "succeeded" if response.get("ok") else "failed"
    status = "pending" if receipt.status == Receipt.Status.PENDING else outcome
    return {
        "status": status,
        "consumed_at": receipt.created_at,
        "completed_at": receipt.completed_at,
        "result": stored_result(response),
        "error": response.get("error", ""),
        "recorded_by": response.get("recorded_by"),
        "note": response.get("note", ""),
    }


def for_user(user, request_id) -> ActionRequest:
    """The request, if it is this user's (NotFound otherwise: another token's requests do not exist for it). A card
    past its deadline has its expiry applied first (approvals.sla.apply_sla), so the agent is never told
    `pending` by a request that expired while no timer job ran."""
    found = ActionRequest.objects.select_related("channel", "card", "receipt", "run").filter(created_by=user)
    request = found.filter(pk=request_id).first()
    if request is None:
        raise NotFound("Not found.")
    card = request.card
    if card is not None and card.status in Approval.OPEN and card.due_at <= timezone.now():
        sla.apply_sla(card.pk)
        request = found.get(pk=request_id)
    return request


# --- when its card closes ----------------------------------------------------------------------------------------


def card_closed(sender, card: Approval, **_) -> None:
    """approvals.models.card_closed: a rejected or expired request's step ends; its callback (if any) is written
    with its job, in the decision's transaction (sent, signed and retried, by the `outbound` queue)."""
    request = ActionRequest.objects.select_related("channel", "run").filter(card=card).first()
    if request is None:
        return
    request.card = card
    answer = state(request)
    if answer["status"] in ("rejected", "expired"):
        Step.objects.filter(run=request.run, seq=request.step_seq).update(
            status=Step.Status.DONE,
            output={"decision": answer["status"], "comment": answer["comment"], "by": answer["decided_by"]},
            ended_at=timezone.now(),
        )
    if request.callback_url:
        callbacks.queue(request, answer, stored_arguments(request))
