"""A workflow's steps: how one is declared (StepDef) and what it sees when it runs (Context: the run's input and
earlier outputs, the model and tools, effects at most once, gates, the usage it counts). Authors reach these
through runs.workflow; the engine (runs.engine) and the agent loop (runs.agent) build and run them."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from core import pii, tracing
from runs import effects, gates, personal
from runs.effects import shadow_response
from runs.errors import Ambiguous, Fatal, Park, Retryable, Stop, Wait
from runs.gates import ApprovalRequest, Decision, GateSpec, Outcome, canonical_hash
from runs.models import ModelUsage, Receipt, Run
from runs.personal import Known, Pii
from runs.tape import Recorder, Tape, asked
from runs.tools import AgentSpec

StepFn = Callable[["Context"], Any]


@dataclass(frozen=True)
class Compensation:
    """What undoes an effect (runs.compensations), declared next to it.

    `call(ctx, key, answer)` undoes it and returns the external system's answer: `answer` is what the effect's call
    answered (its receipt's response), `key` the compensation's own idempotency key (pass it on). `lookup(ctx, key)`
    says whether a compensation with that key was applied (an ambiguous one is reconciled by it; without it a person
    is asked, as for any write). `within`: how long after the effect it can still be undone (None: always).
    `approval`: a person says yes on a card before it runs. `describe(answer)`: what it undoes, for cards."""

    call: Callable[[Context, str, Any], dict]
    lookup: Callable[[Context, str], dict | None] | None = None
    within: timedelta | None = None
    approval: bool = False
    describe: Callable[[Any], str] | None = None

    @classmethod
    def of(cls, value: Compensation | Callable | None, where: str) -> Compensation | None:
        """A declaration's `compensate=`: a Compensation, or its call alone."""
        if value is None or isinstance(value, Compensation):
            return value
        if callable(value):
            return cls(call=value)
        raise ValueError(f"{where}: compensate= takes a Compensation or a function (ctx, key, answer)")


def no_compensation(kind: str, where: str, compensate) -> None:
    """A compensation is declared on an effect: a read, a computation or a gate changes nothing to undo."""
    if compensate is not None:
        raise ValueError(f"{where}: a {kind} step has no side effect to undo; declare compensate= on an effect")


@dataclass(frozen=True)
class StepDef:
    name: str
    kind: str  # compute | read | effect | gate | agent (a stage of steps: runs.agent)
    fn: StepFn
    channel: str | None = None
    gate: GateSpec | None = None
    agent: AgentSpec | None = None
    versions: dict | None = None  # recorded on the step (prompt_version, tools_version) and part of its input
    compensation: Compensation | None = None  # what undoes its effects (an effect step's, an agent tool call's)
    pii: Pii | None = None  # a read's personal fields, sealed before its checkpoint (runs.personal)


def check_decided_edit(step: StepDef, proposed: Any, decision: Decision) -> None:
    """Defence in depth, before a step acts on a decision: an edit must still fit the step's gate (its
    GateSpec, else the proposal's shape). Approval.decide checked it already; this catches a card decided by
    other means (written into the database, or by a console that checked it against another deployment).
    Raises Fatal, so the run goes to the dead-letter queue with the reason and nothing is executed."""
    if decision.decision != Outcome.EDITED:
        return
    if proposed is None:
        raise Fatal(f"the edit decided on {step.name} cannot be checked (the proposal is unknown): not executed")
    # Checked on the values the references stand for (core.pii): the card keeps an edit's personal data sealed,
    # the gate's declaration (an address's pattern) is about the values.
    proposed, edited = pii.present(proposed, clear=True), pii.present(decision.payload, clear=True)
    if errors := (step.gate or GateSpec()).edit_errors(proposed, edited):
        text = "; ".join(f"{e['loc']} {e['msg']}" for e in errors)
        raise Fatal(f"the edit decided on {step.name} does not fit its gate ({text}): not executed")


@dataclass
class Usage:
    """The tokens and cost a step's attempt used. Bound to its run and step by the step's Context, each `add`
    (one model call) is also counted at once against the run's cost limit and the tenant's token rate
    (runs.models.ModelUsage), so an attempt that fails or is lost before its checkpoint still counts."""

    tokens_in: int = 0
    tokens_out: int = 0
    cost: Decimal = Decimal(0)
    counted_for: tuple | None = None  # (run, step name)

    def add(self, tokens_in: int, tokens_out: int, cost: Decimal) -> None:
        self.tokens_in += tokens_in
        self.tokens_out += tokens_out
        self.cost += cost
        if self.counted_for is not None and (tokens_in or tokens_out or cost):
            ModelUsage.record(*self.counted_for, tokens_in, tokens_out, cost)


class Context:
    """What a step sees: the run input, earlier steps' outputs, the model and tools, effects and gates.

    What the step draws from outside the run (model answers, tool reads, effects, gates, the time, ids) is recorded
    on its tape (runs.tape), written with its checkpoint, for a replay to feed back (runs.replay)."""

    def __init__(self, run: Run, step: StepDef, seq: int, outputs: dict[str, Any], model, tools):
        self.run = run
        self.step = step
        self.seq = seq
        self.input: dict = run.input
        self.outputs = outputs
        self.tape = Tape()
        self.model = None if model is None else Recorder(model, self.tape, "model")
        self.tools = None if tools is None else Recorder(tools, self.tape, "tools", systems=True)
        self.usage: Usage = getattr(model, "usage", None) or Usage()
        self.usage.counted_for = (run, step.name)
        self.last_effect_key: str | None = None
        self._effects = 0
        # The key of the effect this context undoes (runs.compensations): its effects are the compensation's, which
        # a cancel does not stop (the run is being undone).
        self.undoing: str | None = None
        # The clear values this attempt handled (sealed from a read, revealed by `pii`), scrubbed back to their
        # references from whatever of the step is written (runs.personal).
        self.known = Known()

    def pii(self, obj: Any) -> Any:
        """`obj` (any JSON structure or text) with its personal-data references replaced by their clear values:
        for the code that hands them to an external system (an effect's call), never for what the step returns or
        the model sees. What comes back from the effect, and the step's error, are scrubbed back to references
        before they are written. Never a placeholder: an erased value ends the run cancelled, a reference the vault
        does not hold fails it (Fatal), a missing or wrong key fails the step with the key's error."""
        return personal.reveal(obj, self.known)

    def effect(
        self,
        call: Callable[[str], dict],
        *,
        key: str | None = None,
        lookup: Callable[[str], dict | None] | None = None,
        action: str | None = None,
        preview: dict | None = None,
    ) -> dict:
        """Do a side effect on this step's channel at most once.

        `call(idempotency_key)` performs it and returns the external system's answer (a dict, with `id` when
        it has one). The receipt is written first; a done receipt makes this a no-op that returns the stored
        answer. A pending receipt means an earlier attempt may have written: `lookup(key)` is asked when the
        tool has one, otherwise the run parks for a person to reconcile.

        In shadow mode `call` is never made: the effect is recorded as a ShadowEffect with `preview` (what the
        call would send, for the person who does it by hand) and answers `{"shadow": True, "id":
        "shadow:<key>"}`, so the run goes on. The mode is decided once per effect: the card that authorized it
        (the run's latest decided action card on this channel, at this step or before) says it; without one,
        the channel and workflow do (core.models.Channel.in_shadow) when the effect's receipt is first
        written. Kill switches apply as to any effect.
        """
        channel = self.step.channel
        key = self._next_key(key, action)
        self.tape.record("effect", canonical_hash(preview), keep=False, key=key)
        self.tape.paused += 1  # the effect's tool calls are the effect's: its answer is its receipt's
        try:
            with _effect_span(channel, key) if tracing.ENABLED else tracing.NULL:
                return self._effect(channel, key, call, lookup, preview)
        finally:
            self.tape.paused -= 1

    def _next_key(self, key: str | None, action: str | None) -> str:
        """The receipt key of the step's next effect: the n-th effect of a step gets its own default key, so two
        effects of one step are two writes."""
        self._effects += 1
        key = key or self._default_key(
            f"{self.seq}:{action or self.step.name}" + (f"#{self._effects}" if self._effects > 1 else "")
        )
        self.last_effect_key = key
        return key

    def _effect(self, channel, key, call, lookup, preview) -> dict:
        receipt = _open_receipt(
            self.run, self.seq, channel, key, step=self.step.name, preview=preview, undo=self.undoing is not None
        )
        if receipt.status == Receipt.Status.DONE:
            tracing.note(OUTCOME, "replayed")
            return receipt.response
        if receipt.shadow:
            # Recorded with the receipt, never sent: nothing can be ambiguous, so a pending shadow receipt (its
            # first attempt stopped here) is completed without asking anyone.
            tracing.note(OUTCOME, "shadow")
            return receipt.complete(shadow_response(key))
        if not receipt.fresh:
            found = lookup(key) if lookup else self._reconciled_by_a_person(receipt)
            if found is not None:
                tracing.note(OUTCOME, "reconciled")
                return receipt.complete(self.known.scrub(found), reconciled=True)
            # The lookup is authoritative: the write did not happen, so it is safe to do it now.
        try:
            try:
                response = self.known.scrub(call(key))
            except Exception as exc:
                self.known.scrub_error(exc)  # what it quotes of the values it was sent: back to references
                raise
        except Fatal:
            receipt.discard()  # the tool says the call was refused, so not applied
            raise
        except Wait:
            # The tool's breaker refused the call before making it (runs.breakers.guard): nothing was sent. A
            # receipt written for this attempt goes; an earlier attempt's pending one stays to be reconciled.
            if receipt.fresh:
                receipt.discard()
            raise
        except Retryable:
            # A 5xx or a timeout the tool calls retryable may still have been applied. With a lookup, the
            # receipt stays pending and the next attempt asks before calling again; without one, the tool's
            # word that it was not applied is all there is.
            if lookup is None:
                receipt.discard()
            raise
        except Exception as exc:  # noqa: BLE001 - whatever else happened, the write may have been applied
            raise Ambiguous(f"{channel} call {key} ended with {exc.__class__.__name__}: {exc}") from exc
        tracing.note(OUTCOME, "new")
        return receipt.complete(response)

    def _default_key(self, suffix: str) -> str:
        """An effect's default receipt key: its run's effects root (Run.effects_root), its step's seq and action. A
        fork shares the original's root, so an effect the original made at the same step is found done and not made
        again; one the original's undo compensated since is no longer there to share, and the fork makes it anew
        under its own id."""
        root = self.run.effects_root
        if root != self.run.id and self.undoing is None:
            undone = Receipt.objects.filter(key=f"{Receipt.UNDO_PREFIX}{root}:{suffix}", status=Receipt.Status.DONE)
            if undone.exists():
                root = self.run.id
        return f"{root}:{suffix}"

    def _reconciled_by_a_person(self, receipt) -> dict | None:
        request = ApprovalRequest(
            channel=receipt.channel,
            kind=gates.Kind.RECONCILE,
            proposed={"receipt": receipt.key, "receipt_created_at": receipt.created_at.isoformat()},
            summary=(
                f"An earlier attempt of '{self.step.name}' may have reached {receipt.channel} (the worker "
                f"stopped between the call and its receipt). Approve if it happened; reject if it did not, "
                f"and it will be done now."
            ),
            rule_id="ambiguous-write",
            risk="high",
        )
        decision = gates.backend().decision(self.run, self.seq, request)
        if decision is None:
            # At this step's card (an undo's compensation runs at its effect's step, not at the run's cursor).
            raise Park(f"did this {receipt.channel} write happen? ({receipt.key})", request, seq=self.seq)
        if decision.rejected:
            # It did not happen: write it now, as a new attempt of the same receipt, so that if this attempt
            # is interrupted too, the question is asked again (the card binds to the attempt's start).
            receipt.rearm()
            return None
        return {"reconciled_by": decision.by, "comment": decision.comment}

    def gate(self, request: ApprovalRequest | None = None, **fields) -> dict:
        """Ask a person. Returns the decision (`decision`, `payload` to act on, `comment`, `reason`, `by`)
        once it is taken; until then the run parks in `waiting_human`."""
        if request is None:
            request = ApprovalRequest(channel=self.step.channel, **fields)
        self.tape.record("gate", request.args_hash(), keep=False)
        decision: Decision | None = gates.backend().decision(self.run, self.seq, request)
        if decision is None:
            raise Park(f"waiting for a decision on {request.channel}", request)
        check_decided_edit(self.step, request.proposed, decision)
        return decision.as_output()

    def now(self) -> datetime:
        """The time, as a step should read it: recorded, so that a replay sees the time the run saw."""
        now = timezone.now()
        self.tape.record("now", None, now.isoformat())
        return now

    def new_id(self) -> str:
        """A new random id (hex), recorded, so that a replay draws the same one."""
        value = uuid.uuid4().hex
        self.tape.record("new_id", None, value)
        return value

    def recorded(self, name: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)`, recorded: for anything else a step reads that is not the same twice (a read
        without a tool client, a clock of its own). Its answer must be JSON; a replay feeds it back."""
        answer = fn(*args, **kwargs)
        self.tape.record(f"recorded.{name}", asked(args, kwargs), answer)
        return answer


OUTCOME = "hitl.effect.outcome"  # on an effect's span: new, replayed (its receipt was done), reconciled, shadow


def _effect_span(channel: str | None, key: str):
    """An effect as an `effect.call` span (core.tracing): its channel, its receipt key, and (OUTCOME) what its
    receipt made of it. A park (a kill switch, a reconcile card) is not a failure."""
    return tracing.span(
        "effect.call", {"hitl.channel": channel or "", "hitl.receipt.key": key}, kind=tracing.CLIENT, ok=(Park, Wait)
    )


def as_datetime(value: str) -> datetime:
    """A recorded `ctx.now()`, read back."""
    parsed = parse_datetime(value)
    if parsed is None:
        raise ValueError(f"not a recorded time: {value!r}")
    return parsed


def _open_receipt(
    run: Run, seq: int, channel: str, key: str, *, step: str = "", preview: dict | None = None, undo: bool = False
):
    """The effect's receipt through the one door of effects (runs.effects), from outside any transaction of the
    step's own: a cancel stops the run (not its undo: `undo`), a kill switch parks it."""
    if _inside_a_transaction():
        raise Fatal(
            f"ctx.effect() on {channel} was called inside transaction.atomic(): its receipt must commit before "
            "the call, so call it outside any transaction"
        )
    try:
        return effects.open_receipt(run, seq, channel, key, step=step, preview=preview, undo=undo)
    except effects.RunEnded:
        raise Stop({"outcome": "cancelled"}) from None
    except effects.ChannelStopped as exc:
        raise Park(str(exc), paused=True, kill_switch_channel=channel) from None


def _inside_a_transaction() -> bool:
    # The test suite wraps each test in transactions of its own (marked by Django's TestCase): those aside.
    connection = transaction.get_connection()
    return any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)
