"""A candidate workflow or prompt version, evaluated over the recorded runs of a period (docs/replay.md): each run
replayed on the candidate (runs.replay), fed back from its record, or with the configured model asked again
(`model: live`). The candidate is `{"workflow": name, "version": a deployed version, "model": "replayed" | "live"}`.

Figures: the runs replayed, those that replay identically, where the others diverge (counts per step and per
reason, the first ones listed), the gate proposals that change, the runs not replayable (still running), and with
the live model the tokens and cost of the candidate against the record's (`delta`)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from evals.errors import CandidateInvalid, EmptyPeriod
from runs import replay as replays
from runs import workflow as workflows

MODELS = ("replayed", "live")
KEYS = ("name", "workflow", "version", "model")


def read(raw) -> dict:
    """The candidate, checked: CandidateInvalid names each error's path."""
    errors = []
    if not isinstance(raw, dict):
        raise CandidateInvalid([f"$: a version candidate is an object {{workflow, version, model}}, not {raw!r}"])
    errors += [f"$.{key}: unknown key (known: {', '.join(KEYS)})" for key in raw if key not in KEYS]
    workflow, version, model = raw.get("workflow"), raw.get("version"), raw.get("model", "replayed")
    if not isinstance(workflow, str) or not workflow:
        errors.append("$.workflow: the name of a deployed workflow")
    elif workflow not in workflows.names():
        errors.append(f"$.workflow: unknown workflow {workflow!r} (known: {', '.join(workflows.names())})")
    if not isinstance(version, int) or isinstance(version, bool):
        errors.append("$.version: a version number of the workflow, deployed here")
    elif not errors:
        try:
            workflows.get(workflow, version)
        except workflows.UnknownWorkflow as exc:
            errors.append(f"$.version: {exc}")
    if model not in MODELS:
        errors.append(f"$.model: {model!r} is not one of {', '.join(MODELS)}")
    if errors:
        raise CandidateInvalid(errors)
    return {"workflow": workflow, "version": version, "model": model, "name": str(raw.get("name") or "")}


def evaluate(candidate: dict, since: datetime, until: datetime) -> dict:
    """Replay the runs of the candidate's workflow created in [since, until) on it. EmptyPeriod when none can be."""
    batch = replays.replay_many(
        candidate["workflow"], since, until, version=candidate["version"], live=candidate["model"] == "live"
    )
    if batch.runs == 0:
        why = "; ".join(f"{n} {reason}" for reason, n in batch.unreplayable.items()) or "none was created"
        raise EmptyPeriod(
            f"no run of {candidate['workflow']} created between {since.isoformat()} and {until.isoformat()} can be "
            f"replayed ({why})"
        )
    figures = batch.as_dict()
    if batch.live:
        figures["delta"] = {
            "tokens_in": batch.live_usage["tokens_in"] - batch.recorded_usage["tokens_in"],
            "tokens_out": batch.live_usage["tokens_out"] - batch.recorded_usage["tokens_out"],
            "cost": str(Decimal(batch.live_usage["cost"]) - Decimal(batch.recorded_usage["cost"])),
        }
    return figures
