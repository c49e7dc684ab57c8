"""Small workflows for replay tests (runs.replay), registered when this module is imported."""

from __future__ import annotations

from demo.models import SandboxCall
from runs.workflow import Workflow, register

drawn = register(Workflow("test_replay_drawn"))


@drawn.compute
def stamp(ctx):
    """The time, an id and a value read without a tool client: each drawn once, fed back by a replay."""
    return {
        "at": ctx.now().isoformat(),
        "id": ctx.new_id(),
        "calls": ctx.recorded("calls", lambda: SandboxCall.objects.count()),
    }


@drawn.effect("crm")
def note(ctx):
    return ctx.effect(lambda key: {"id": f"note:{key}"}, preview={"text": f"stamped {ctx.outputs['stamp']['id']}"})


writes = register(Workflow("test_replay_writes"))


@writes.compute
def count_on_the_side(ctx):
    """A step that writes to the database on its own (not through the engine): a replay refuses to."""
    SandboxCall.objects.create(system="crm", operation="side", run_id=ctx.run.id, payload={})
    return {"ok": True}
