"""Small workflows for engine tests, registered when this module is imported."""

from __future__ import annotations

from runs.models import Run
from runs.workflow import Workflow, register

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
