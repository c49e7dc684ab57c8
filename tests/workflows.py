"""Small workflows for engine tests, registered when this module is imported."""

from __future__ import annotations

from django.db import transaction
from pydantic import BaseModel, ConfigDict, Field

from runs.models import Run
from runs.workflow import Compensation, Fatal, Pii, Retryable, Workflow, register

cancel_midway = register(Workflow("test_cancel_midway"))


@cancel_midway.compute
def first(ctx):
    Run.objects.get(pk=ctx.run.pk).cancel()  # as if someone pressed cancel while this step ran
    return {"first": True}


@cancel_midway.compute
def second(ctx):
    raise AssertionError("a cancelled run must not start another step")


flaky = register(Workflow("test_flaky"))


@flaky.compute
def explode(ctx):
    raise ValueError("an error nobody classified")


reject_fails = register(Workflow("test_reject_fails", on_reject="fail"))


@reject_fails.gate("payments")
def ask(ctx):
    return ctx.gate(proposed={"do": "it"}, summary="please")


# A step that asks a person, while someone cancels the run during the step.
cancel_then_gate = register(Workflow("test_cancel_then_gate"))


@cancel_then_gate.gate("payments")
def ask_while_cancelled(ctx):
    Run.objects.get(pk=ctx.run.pk).cancel()
    return ctx.gate(proposed={"do": "it"}, summary="please")


# An effect whose run is cancelled while its step runs, before the effect starts.
cancel_then_effect = register(Workflow("test_cancel_then_effect"))
cancel_then_effect_calls: list[str] = []


@cancel_then_effect.effect("payments")
def pay_after_a_cancel(ctx):
    Run.objects.get(pk=ctx.run.pk).cancel()
    return ctx.effect(lambda key: cancel_then_effect_calls.append(key) or {"id": "paid"})


# An effect inside the step's own transaction: its receipt would not commit before the call.
effect_in_atomic = register(Workflow("test_effect_in_atomic"))
effect_in_atomic_calls: list[str] = []


@effect_in_atomic.effect("payments")
def pay_inside_atomic(ctx):
    with transaction.atomic():
        return ctx.effect(lambda key: effect_in_atomic_calls.append(key) or {"id": key})


# A gate that declares nothing about its proposal (any values, the same shape), proposing a float.
float_gate = register(Workflow("test_float_gate"))


@float_gate.gate("payments")
def ask_for_a_number(ctx):
    return ctx.gate(proposed={"factor": 1.5}, summary="scale it")


# A compute step whose model answers (its tokens spent), then fails on its first attempt (an answer that does not
# parse); and one whose job loses the run between the model's answer and the checkpoint (another job took it over).
spend_then_fail = register(Workflow("test_spend_then_fail"))


@spend_then_fail.compute
def think_then_fail(ctx):
    answer = ctx.model.complete("classify", reason="late delivery", amount_cents=100)
    if ctx.run.attempt == 0:
        raise Retryable("the model's answer did not parse")
    return answer


spend_then_lose = register(Workflow("test_spend_then_lose"))


@spend_then_lose.compute
def think_then_lose(ctx):
    answer = ctx.model.complete("classify", reason="late delivery", amount_cents=100)
    Run.objects.filter(pk=ctx.run.pk).update(owner="another-job")
    return answer


# A gate that names its approval policy in code (approvals.models.ApprovalPolicy), over its channel's.
named_policy = register(Workflow("test_named_policy"))


@named_policy.gate("payments", policy="declared-in-code")
def ask_under_a_named_policy(ctx):
    return ctx.gate(proposed={"do": "it"}, summary="please")


# --- undo (runs.compensations) ----------------------------------------------------------------------------------
# Two effects that can be undone, then a third that fails for good when the input's faults say so (`{"confirm":
# ["fatal"]}`: the CRM refuses the confirmation): under the policy `always`, the run is undone at once, in reverse
# order. The demo sandbox's systems record every call (demo.sandbox), so a compensation made twice shows.


def _reverse(ctx, key, refund):
    return ctx.tools.payments.reverse(refund["id"], idempotency_key=key)


def _strike(ctx, key, note):
    return ctx.tools.crm.remove_note(note["id"], idempotency_key=key)


undo_chain = register(Workflow("test_undo_chain", undo="always"))


@undo_chain.effect(
    "payments",
    compensate=Compensation(call=_reverse, lookup=lambda ctx, key: ctx.tools.payments.lookup_reversal(key)),
)
def pay(ctx):
    payments = ctx.tools.payments
    return ctx.effect(
        lambda key: payments.refund(
            customer_id=ctx.input["customer_id"],
            amount_cents=ctx.input["amount_cents"],
            currency="EUR",
            idempotency_key=key,
        ),
        lookup=payments.lookup,
    )


@undo_chain.effect("crm", compensate=Compensation(call=_strike, lookup=lambda ctx, key: ctx.tools.crm.lookup_note(key)))
def note(ctx):
    crm = ctx.tools.crm
    return ctx.effect(
        lambda key: crm.add_note(customer_id=ctx.input["customer_id"], text="paid", idempotency_key=key),
        lookup=crm.lookup_note,
    )


@undo_chain.effect("crm")
def confirm(ctx):
    # The CRM can be asked whether a note was written (a kill between its receipt and its call is reconciled by
    # the lookup, not a person), so a chaos run ends undone without anyone: its faults refuse it for good.
    crm = ctx.tools.crm
    return ctx.effect(
        lambda key: crm.add_note(customer_id=ctx.input["customer_id"], text="confirmed", idempotency_key=key),
        lookup=crm.lookup_note,
    )


# The same two effects, and a last step during which someone cancels the run and asks for an undo: the last
# step's checkpoint leaves the run to its owner, which undoes it (a cancel and undo never ends as a plain cancel).
undo_at_the_end = register(Workflow("test_undo_at_the_end", undo="never"))
undo_at_the_end.effect("payments", compensate=undo_chain.steps[0].compensation)(pay)


@undo_at_the_end.compute
def cancel_and_undo_while_running(ctx):
    from runs import compensations  # noqa: PLC0415 - the test's own door, as the API would call it

    compensations.cancel_and_undo(Run.objects.get(pk=ctx.run.pk), None)
    return {"asked": True}


# A payment whose compensation has no lookup: an ambiguous reversal is asked of a person (a reconcile card at the
# payment's step), as any write without one.
undo_without_lookup = register(Workflow("test_undo_without_lookup", undo="always"))
undo_without_lookup.effect("payments", compensate=Compensation(call=_reverse))(pay)
undo_without_lookup.effect("crm", name="confirm")(confirm)


# Personal data (runs.personal, docs/personal-data.md): an input with a marked email, a read that declares the
# customer's name, an effect that sends both in clear (ctx.pii) and gets them quoted back, and may fail quoting them.
personal_sent: list[dict] = []  # what the "external system" received, in clear


class PersonalInput(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"x-pii-subject": "customer_id"})

    customer_id: str
    email: str = Field(json_schema_extra={"x-pii": True})
    fail: bool = False


personal_flow = register(Workflow("test_personal", input_schema=PersonalInput))


def _crm_profile(customer_id: str) -> dict:
    return {"id": customer_id, "name": f"Zelda {customer_id}"}


@personal_flow.read(pii=Pii(fields=("name",), subject="id"))
def profile(ctx):
    # Recorded on the step's tape as the "system" answered it: the tape is scrubbed with what the read sealed.
    return ctx.recorded("profile", _crm_profile, ctx.input["customer_id"])


@personal_flow.effect("email")
def write_to_them(ctx):
    message = {"to": ctx.input["email"], "body": f"Dear {ctx.outputs['profile']['name']}"}
    clear = ctx.pii(message)

    def send(key: str) -> dict:
        personal_sent.append(clear)
        if ctx.input.get("fail"):
            raise Fatal(f"550 mailbox {clear['to']} refused the message for {clear['body']}")
        return {"id": "m1", "accepted": clear["to"], "echo": clear["body"]}

    return ctx.effect(send, preview={"call": "mail.send", **message})
