"""An external agent's one execution of an approved action (external.models.ActionRequest): the consume that hands
it out (its receipt, through runs.effects), the outcome the agent reports, or the one a person records when it never
did.

Every change is one transaction that locks the request's run first (the lock order of Approval.decide and
Run.cancel: the run, then what hangs from it), so a consume, a decision, a cancel and an expiry of one request
are serialised, and each reads what the others committed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core import pii, safe_input
from core.access import may_operate_channel
from core.models import ActorType, AuditEntry
from external import undo
from external.errors import (
    AlreadyConsumed,
    Conflict,
    DigestMismatch,
    Forbidden,
    Invalid,
    Locked,
    NotApproved,
    NotConsumed,
    NotFound,
    RunEnded,
    Stale,
    Unavailable,
)
from external.models import ActionRequest
from external.results import same_outcome, storable
from external.status import canonical, execution, for_user, state, stored_arguments
from runs import effects
from runs.breakers import BreakerOpen
from runs.effects import shadow_response
from runs.models import Receipt, Run, Step

# --- its one execution -------------------------------------------------------------------------------------------


def consume(user, request_id, arguments_digest: str, nonce: str = "") -> dict:
    """Go, once: for an approved request whose arguments are the ones named by `arguments_digest`, while no kill
    switch stops its channel. Writes its receipt (pending until the agent reports the outcome). A shadow card's
    action is not to run: the receipt is completed as shadow, and the answer says so (`go: false`).

    `nonce`: the caller's name for this consume. The same nonce asking again while the execution is pending is
    answered with the same go (the first answer was lost on its way: that caller has not run anything yet); any
    other second consume is AlreadyConsumed."""
    with transaction.atomic():
        request = _locked(user, request_id)
        answer = state(request)
        if request.receipt_id is not None:
            if nonce and nonce == request.consume_nonce and answer["execution"]["status"] == "pending":
                return _go(request, answer, shadow=False)
            raise AlreadyConsumed(
                "This approval was consumed already: its execution is what is recorded.", execution=answer["execution"]
            )
        if answer["status"] != "approved":
            raise NotApproved(f"The request is {answer['status']}: there is nothing to execute.")
        if arguments_digest != answer["arguments_digest"]:
            raise DigestMismatch(
                "These are not the approved arguments: GET the request and execute its `arguments` "
                "(a reviewer may have edited them)."
            )
        stored = stored_arguments(request)
        try:
            pii.reveal(stored)  # a value erased since the decision: there is nothing the agent may execute
        except (pii.Erased, pii.NotFound) as exc:
            raise NotApproved(f"The approved arguments cannot be executed: {exc}. Ask again.") from None
        if (stale_at := consume_by(request)) <= timezone.now():
            raise Stale(
                f"This approval was not used in time (by {stale_at.isoformat()}, APPROVAL_CONSUME_WITHIN): the world "
                "it was given in may have changed. Ask again."
            )
        # A compensation (external.undo) has its own receipt under the undo key of what it undoes, and runs while
        # the run is being undone (`compensating`), which refuses every other request of the run.
        undoing = request.compensates_id is not None
        key = undo.undo_key(request.compensates_id) if undoing else f"external:{request.id}"
        try:
            receipt = effects.open_receipt(
                request.run,
                request.step_seq,
                request.channel.name,
                key,
                step=request.action,
                preview={"call": request.action, **stored},
                undo=undoing,
            )
        except effects.RunEnded as exc:
            raise RunEnded(f"{exc}: this approval is not to be used.") from None
        except effects.ChannelStopped as exc:
            raise Locked(str(exc)) from None
        except BreakerOpen as exc:
            raise Unavailable(str(exc), retry_after=round(exc.delay)) from None
        request.receipt, request.consume_nonce = receipt, nonce
        request.save(update_fields=["receipt", "consume_nonce"])
        if receipt.shadow:
            receipt.complete_outcome({"ok": True, "result": shadow_response(key)})
        Step.objects.filter(run=request.run, seq=request.step_seq).update(
            status=Step.Status.DONE if receipt.shadow else Step.Status.UNKNOWN,
            output={"shadow": shadow_response(key)} if receipt.shadow else None,
            ended_at=timezone.now() if receipt.shadow else None,
        )
        _audit(request, "external.consume", user, {"arguments": stored, "shadow": receipt.shadow})
        if receipt.shadow and undoing:
            undo.settle(request.run_id)  # a shadow compensation is done as it is recorded
        return _go(request, answer, shadow=receipt.shadow)


def consume_by(request: ActionRequest):
    """When an approval goes stale if nobody consumed it: APPROVAL_CONSUME_WITHIN after the decision (after the ask,
    for `approval: never`), and never later than the request's own expiry plus that window."""
    within = timedelta(seconds=settings.APPROVAL_CONSUME_WITHIN)
    decided_at = request.card.decided_at if request.card is not None else request.created_at
    return min(decided_at + within, request.expires_at + within)


def _go(request: ActionRequest, answer: dict, *, shadow: bool) -> dict:
    return {
        "go": not shadow,
        "shadow": shadow,
        "arguments": answer["arguments"],
        "arguments_digest": answer["arguments_digest"],
        "execution": execution(request),
    }


def report(
    user, request_id, *, ok: bool, result: Any = None, error: str = "", compensation: dict | None = None
) -> dict:
    """The outcome of the execution the agent consumed: completes its receipt (once; the same outcome sent
    again is answered as recorded; another one, or any after a person recorded it, is a Conflict). A success may
    declare what undoes it (`compensation`: {action, arguments}, external.undo), kept on the request; the outcome of
    a compensation (external.undo) may end, or stop, its run's undo."""
    # Any valid JSON (external.api.ResultIn): as jsonb holds it, or as its JSON text where jsonb cannot (storable).
    outcome = {"ok": True, **storable(result)} if ok else {"ok": False, "error": error}
    if compensation is not None and not ok:
        raise Invalid([{"loc": "compensation", "msg": "only a success declares what undoes it"}])
    with transaction.atomic():
        request = _locked(user, request_id)
        receipt = request.receipt
        if receipt is None:
            raise NotConsumed("The approval was not consumed: there is no execution to report on.")
        if compensation is not None and request.compensates_id is not None:  # the request's state, not the body's
            raise Conflict("This request is a compensation: a compensation is not undone in its turn.")
        if receipt.status == Receipt.Status.DONE:
            if not same_outcome(receipt.response, outcome) or canonical(request.compensation) != canonical(
                compensation
            ):
                raise Conflict("Another outcome was recorded for this execution.", execution=execution(request))
            return execution(request)
        receipt.complete_outcome(outcome)
        if compensation is not None:
            request.compensation = compensation
            request.save(update_fields=["compensation"])
        Step.objects.filter(run=request.run, seq=request.step_seq).update(
            status=Step.Status.DONE if ok else Step.Status.FAILED,
            output=storable(result) if ok else None,
            error="" if ok else error[:5000],
            ended_at=timezone.now(),
        )
        _audit(
            request, "external.result", user, {**outcome, **({"compensation": compensation} if compensation else {})}
        )
        if request.compensates_id is not None:
            undo.settle(request.run_id)
        return execution(request)


def _locked(user, request_id) -> ActionRequest:
    """The request, its run locked first (the order of Approval.decide and Run.cancel), then its own row."""
    found = for_user(user, request_id)
    Run.objects.select_for_update().filter(pk=found.run_id).exists()
    return (
        ActionRequest.objects.select_for_update(of=("self",))
        .select_related("channel", "card", "receipt", "run")
        .get(pk=found.pk)
    )


def _audit(request: ActionRequest, action: str, user, data: dict, actor_type: str = ActorType.AGENT) -> None:
    AuditEntry.record(
        action,
        actor=user,
        actor_type=actor_type,
        target=f"action_request:{request.id}",
        run_id=request.run_id,
        approval_id=request.card_id,
        channel=request.channel.name,
        trace_id=request.run.trace_id,
        data={"action": request.action, **data},
    )


# --- an outcome recorded by a person ----------------------------------------------------------------------------

OUTCOME_TEXT_MAX = 5000


def record_outcome(user, run_id, step_seq: int, *, outcome: str, text: str) -> dict:
    """A person records the outcome of an execution that is "outcome unknown" (the agent consumed its approval
    and never reported what happened: it crashed, or its result was lost), from the run page: `outcome`
    succeeded (`text` says how they know) or failed (`text` is the error). Only someone with `operate_channel`
    on the request's channel may (Forbidden otherwise). Once, like the agent's result: the pending receipt is
    completed by compare-and-swap, marked reconciled (completed by a person, not the call); a second record is a
    Conflict, and so is the agent's later result (report). Audited `external.result` with the person as actor
    (`by_hand`). Returns the execution as the agent now reads it."""
    text = (text or "").strip()
    if outcome not in ("succeeded", "failed"):
        raise Invalid("The outcome is succeeded or failed.")
    if not text:
        raise Invalid(
            "Say how you know it succeeded (a note)." if outcome == "succeeded" else "Say how you know: the error."
        )
    if len(text) > OUTCOME_TEXT_MAX:
        raise Invalid(f"The note is at most {OUTCOME_TEXT_MAX} characters.")
    if why := safe_input.unsafe_char(text):
        raise Invalid(f"The note contains {why}.")
    ok = outcome == "succeeded"
    with transaction.atomic():
        # The lock order of report and Approval.decide: the run first, then the request.
        Run.objects.select_for_update().filter(pk=run_id).exists()
        request = (
            ActionRequest.objects.select_for_update(of=("self",))
            .select_related("channel", "card", "receipt", "run")
            .filter(run_id=run_id, step_seq=step_seq)
            .first()
        )
        if request is None:
            raise NotFound("No approval request at this step of the run.")
        if not may_operate_channel(user, request.channel):
            raise Forbidden(
                f"Only someone with operate_channel on {request.channel.name} may record the outcome of its actions."
            )
        receipt = request.receipt
        if receipt is None:
            raise NotConsumed("The approval was not consumed: nothing was executed, there is no outcome to record.")
        if receipt.status == Receipt.Status.DONE:
            raise Conflict("The outcome was recorded already: it stays as it is.", execution=execution(request))
        by = user.get_username()
        said = {"result": None, "note": text} if ok else {"error": text}
        receipt.complete_outcome({"ok": ok, **said, "recorded_by": by})
        Receipt.objects.filter(pk=receipt.pk).update(reconciled=True)
        Step.objects.filter(run=request.run, seq=request.step_seq).update(
            status=Step.Status.DONE if ok else Step.Status.FAILED,
            output={"recorded_by": by, "note": text} if ok else None,
            error="" if ok else text,
            ended_at=timezone.now(),
        )
        said_by_hand = {"ok": ok, "by_hand": True, **({"note": text} if ok else {"error": text})}
        _audit(request, "external.result", user, said_by_hand, actor_type=ActorType.HUMAN)
        if request.compensates_id is not None:
            undo.settle(request.run_id)
        return execution(request)
