"""Small workflows with compensations (undo, runs.compensations), for the tests of its doors: the runs API and
page, reject and undo on cards, the dashboard and /metrics. Registered when this module is imported.

Each records the calls its fake payments system received in `CALLS` (`charge` and `refund`, by idempotency key), so
a test sees what was done and undone, and that nothing was done twice."""

from __future__ import annotations

from datetime import timedelta

from runs.workflow import Compensation, Fatal, Workflow, register

CALLS: dict[str, list[str]] = {"charge": [], "refund": []}


def charge(ctx):
    def call(key: str) -> dict:
        CALLS["charge"].append(key)
        return {"id": f"ch_{ctx.run.pk.hex[:8]}", "amount_cents": 500}

    return ctx.effect(call)


def refund(ctx, key: str, answer: dict) -> dict:
    CALLS["refund"].append(key)
    return {"id": f"re_{answer['id']}", "refunded": answer["id"]}


def ask(ctx):
    return ctx.gate(proposed={"ship": "the order"}, summary="Ship the order?")


# An effect that can be undone, then a gate: the run parks with something to undo.
charge_then_ask = register(Workflow("test_undo_charge_then_ask"))
charge_then_ask.effect("payments", name="charge", compensate=refund)(charge)
charge_then_ask.gate("payments", name="ship")(ask)

# The same, whose compensation is past its deadline as soon as the charge is done.
late_undo = register(Workflow("test_undo_too_late"))
late_undo.effect("payments", name="charge", compensate=Compensation(call=refund, within=timedelta(0)))(charge)
late_undo.gate("payments", name="ship")(ask)

# The same, whose compensation asks a person first (an `undo` card).
gated_undo = register(Workflow("test_undo_gated"))
gated_undo.effect("payments", name="charge", compensate=Compensation(call=refund, approval=True))(charge)
gated_undo.gate("payments", name="ship")(ask)

# A gate before any effect: nothing to undo when it parks.
nothing_to_undo = register(Workflow("test_undo_nothing_yet"))
nothing_to_undo.gate("payments", name="ship")(ask)
nothing_to_undo.effect("payments", name="charge", compensate=refund)(charge)

# The same, whose compensation fails for good: the run parks `compensation_failed` with an `undo_failed` card.
failing_undo = register(Workflow("test_undo_fails"))


def refuse_refund(ctx, key: str, answer: dict) -> dict:
    CALLS["refund"].append(key)
    raise Fatal("the payment system refuses refunds of this charge")


failing_undo.effect("payments", name="charge", compensate=refuse_refund)(charge)
failing_undo.gate("payments", name="ship")(ask)
