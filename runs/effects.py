"""The one door for side effects: every effect's receipt, a workflow step's (runs.steps.Context.effect) or an external
agent's one execution of an approved action (external.executions.consume), is opened here, so what holds for one
holds for the other:

- the run must be live: a workflow's run still owned by this job (runs.models.Run.owned) with no cancel requested;
  an external agent's run still `external` (cancelled or finished: RunEnded);
- no kill switch stops the channel (the global one, then the channel's: ChannelStopped), read in the receipt's
  transaction, so an engaged switch that has committed stops every effect not already past here;
- an open circuit breaker holds the effect back before anything is written (runs.breakers: BreakerOpen);
- shadow mode is decided once per effect: as the card that authorized it (the run's latest decided action card
  on this channel, at this step or before), else as the channel and workflow are now; a shadow effect is recorded
  as a ShadowEffect with the receipt and never sent.

The callers map the refusals to their own world: the engine stops or parks the run, the API answers 409 or 423."""

from __future__ import annotations

from django.db import transaction

from core.models import Channel, Killed
from runs import breakers, gates
from runs.models import EXTERNAL_WORKFLOW, Receipt, Run, ShadowEffect


class EffectRefused(Exception):
    """The effect may not start; nothing was written."""


class RunEnded(EffectRefused):
    """The run is cancelled or finished (or a cancel was requested): its effects do not start."""

    def __init__(self, status: str):
        super().__init__(f"the run is {status}: nothing of it is executed any more")
        self.status = status


class ChannelStopped(EffectRefused):
    """A kill switch stops the channel."""

    def __init__(self, channel: str, killed: Killed):
        super().__init__(killed.describe(channel))
        self.channel, self.killed = channel, killed


def open_receipt(
    run: Run, seq: int, channel: str, key: str, *, step: str = "", preview: dict | None = None, undo: bool = False
):
    """Insert the effect's receipt (or find the one an earlier attempt wrote) under the rules above. Returns the
    receipt with `fresh` (written now) and `shadow` (recorded, not sent; a ShadowEffect is written with a new
    shadow receipt; an earlier attempt's pending receipt keeps its mode). An external agent's caller holds its run's
    row (external.executions._locked) in the transaction this joins. `undo`: a compensation (runs.compensations),
    which a cancel does not stop: the run is being undone (by its owner, or by an external run's agent)."""
    breakers.check(channel)  # an open breaker: held back before any receipt is written (BreakerOpen)
    with transaction.atomic():
        _check_live(run, undo)
        if (killed := Channel.killed_for_effects(channel)) is not None:
            raise ChannelStopped(channel, killed)
        receipt, created = Receipt.objects.get_or_create(
            key=key, defaults={"run": run, "step_seq": seq, "channel": channel}
        )
        if created:
            # Decided once per effect: as the card that authorized it was (a person who did it by hand must not
            # see it done again, nor an approved live effect be dropped, because the mode changed since), else
            # as the channel and workflow are now, recorded with the receipt for its later attempts.
            authorized = gates.backend().shadow_of(run, seq, channel)
            receipt.shadow = Channel.in_shadow(channel, run.workflow) if authorized is None else authorized
            if receipt.shadow:
                ShadowEffect.objects.create(run=run, step_seq=seq, step=step, channel=channel, key=key, preview=preview)
        else:
            receipt.shadow = receipt.status == Receipt.Status.PENDING and ShadowEffect.objects.filter(key=key).exists()
    receipt.run = run  # the owner's copy: its writes name this owner
    receipt.fresh = created
    return receipt


def _check_live(run: Run, undo: bool = False) -> None:
    if run.workflow == EXTERNAL_WORKFLOW:
        # No job owns an external run: the agent's caller locked its row, so a cancel is before or after this.
        if undo:
            if run.status != Run.Status.COMPENSATING:
                raise RunEnded(run.status)
        elif run.status != Run.Status.EXTERNAL or run.cancel_requested:
            raise RunEnded(Run.Status.CANCELLED if run.cancel_requested else run.status)
    elif run.owned() and not undo:
        # A cancel committed while the step ran (the row lock orders it before this receipt, or after it).
        raise RunEnded(Run.Status.CANCELLED)


def shadow_response(key: str) -> dict:
    """What a shadow effect answers in place of its external system (the receipt keeps it as its response)."""
    external_id = f"shadow:{key}"
    if len(external_id) > 200:  # Receipt.external_id; a natural key may be longer
        external_id = f"shadow:{gates.canonical_hash(key)[:40]}"
    return {"shadow": True, "id": external_id}
