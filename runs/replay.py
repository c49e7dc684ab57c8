"""Replay: run a recorded run's workflow on the code deployed now, feeding back what the run drew from outside
(its steps' tapes, runs.tape: the model's answers, reads, the time and ids; its effects' receipts; its cards'
decisions) instead of calling anything, and report the first step where the code now does something else. See
docs/replay.md.

What replay promises: no call (the model, tools and effects answer from the record; a step that would ask for
something the record does not hold has diverged), no effect, no card, and no change to anything: it runs in a
read-only transaction that is rolled back (a write the step's code attempts fails the step, and says so).
`live=True` (evaluating a candidate: evals) asks the configured model again instead of feeding its recorded answers
back, and then runs in a transaction that is rolled back (a model client may write its own records).

A step diverges when, on the current code:
- it is another step (another name or kind at its place), or the workflow ends before it or goes on after the run
  ended;
- its input differs (the run's input, earlier outputs and its versions as recorded);
- it calls something other than what it recorded, in another order, or asks it differently (another prompt,
  other tools offered, other arguments), unless a version shim declares its change compatible
  (`Workflow.compatible`);
- it makes an effect with another key or another preview (what it would send), or one the record has no done
  receipt for;
- it proposes something else to a person than the card they decided (or asks where the run did not);
- it raises, or returns another output than it recorded.

A step whose prompt or tools version differs from the recorded one is marked (`versions`)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, connection, transaction
from django.utils.module_loading import import_string

from runs import gates
from runs import workflow as workflows
from runs.errors import UnknownWorkflow
from runs.gates import ApprovalRequest, canonical_hash
from runs.models import EXTERNAL_WORKFLOW, Receipt, Run, Step
from runs.steps import Context, StepDef, Usage, as_datetime, check_decided_edit
from runs.tape import asked, parts_of
from runs.workflow import Workflow

_VERSIONS = ("prompt_version", "tools_version")
# PostgreSQL's errors for a write in a read-only transaction, and for any statement after it (a step that caught the
# first went on): the replay's refusal of a write.
REFUSED_WRITE = ("25006", "25P02")


class NotReplayable(Exception):
    """The run cannot be replayed (it is running, it is an external agent's, its workflow is not deployed)."""


class Diverged(BaseException):  # noqa: N818 - not an error of the step's: a step's `except Exception` must not swallow it
    """Raised inside a replayed step where it leaves the record."""

    def __init__(self, reason: str, recorded: Any = None, replayed: Any = None):
        super().__init__(reason)
        self.reason, self.recorded, self.replayed = reason, recorded, replayed
        self.versions: dict = {}  # the step's versions that changed (set by the step's replay)


@dataclass
class Divergence:
    seq: int
    step: str
    reason: str
    recorded: Any = None
    replayed: Any = None
    versions: dict = field(default_factory=dict)  # {name: [recorded, current]} where they differ


@dataclass
class StepReplay:
    seq: int
    name: str
    kind: str
    identical: bool
    fed: int = 0  # recorded answers fed back
    versions: dict = field(default_factory=dict)  # {name: [recorded, current]} where they differ
    shimmed: bool = False
    asked_differently: bool = False  # (live, or shimmed) what it asked differs; the answer held


@dataclass
class Report:
    run: str
    workflow: str
    version: int  # the code it replayed on
    recorded_version: int
    steps: list[StepReplay] = field(default_factory=list)
    divergence: Divergence | None = None
    calls: int = 0  # calls made outside (live model calls only: a replay makes none)
    versions_changed: bool = False  # a step replayed (identical or not) has another prompt or tools version
    live: bool = False
    recorded_usage: dict = field(default_factory=lambda: {"tokens_in": 0, "tokens_out": 0, "cost": "0"})
    live_usage: dict = field(default_factory=lambda: {"tokens_in": 0, "tokens_out": 0, "cost": "0"})
    ms: float = 0.0

    @property
    def identical(self) -> bool:
        return self.divergence is None

    @property
    def changed_proposal(self) -> bool:
        return self.divergence is not None and self.divergence.reason.startswith("proposes")

    def summary(self) -> str:
        if self.divergence is None:
            marked = [s.name for s in self.steps if s.versions]
            return f"replays identically ({len(self.steps)} steps" + (
                f"; versions changed at {', '.join(marked)})" if marked else ")"
            )
        d = self.divergence
        return f"diverges at step {d.seq} ({d.step}): {d.reason}"

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(identical=self.identical, summary=self.summary())
        return json.loads(json.dumps(out, cls=DjangoJSONEncoder))


def check_replayable(run: Run) -> None:
    if run.workflow == EXTERNAL_WORKFLOW:
        raise NotReplayable("an external agent's run has no workflow code here to replay: its agent holds it")
    if run.status in Run.MOVING:
        raise NotReplayable(f"the run is {run.status}: replay it once it waits for a person or has ended")


def replay(run: Run, workflow: Workflow | None = None, *, live: bool = False) -> Report:
    """Replay `run` on `workflow` (the deployed code of the run's workflow and version when None). Raises
    NotReplayable for a run that cannot be replayed; otherwise the report says how far it replayed."""
    check_replayable(run)
    if workflow is None:
        try:
            workflow = workflows.get(run.workflow, run.workflow_version)
        except UnknownWorkflow as exc:
            raise NotReplayable(str(exc)) from None
    started = time.perf_counter()
    report = Report(str(run.id), run.workflow, workflow.version, run.workflow_version, live=live)
    recorded = list(
        Step.objects.filter(run=run, status=Step.Status.DONE)
        .order_by("seq")
        .values("seq", "name", "kind", "input_hash", "output", "tape", *_VERSIONS, "tokens_in", "tokens_out", "cost")
    )
    with transaction.atomic():
        if not live:
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION READ ONLY")
        _replay(run, workflow, recorded, report)
        transaction.set_rollback(True)  # whatever was written (live: a model client's own records) is undone
    report.ms = round((time.perf_counter() - started) * 1000, 2)
    return report


def _replay(run: Run, workflow: Workflow, recorded: list[dict], report: Report) -> None:
    outputs: dict[str, Any] = {}
    for expected, row in enumerate(recorded):
        seq = row["seq"]
        if seq != expected:  # a hole: the record is not a run's sequence of steps
            report.divergence = Divergence(expected, "", f"the record has no done step {expected}")
            return
        _count_usage(report.recorded_usage, row["tokens_in"], row["tokens_out"], row["cost"])
        step_def = workflow.step_at(seq, outputs)
        try:
            result = _replay_step(run, workflow, step_def, row, outputs, report)
        except Diverged as d:
            report.divergence = Divergence(seq, row["name"], d.reason, d.recorded, d.replayed, d.versions)
            return
        except DatabaseError as exc:
            if getattr(exc.__cause__, "sqlstate", None) not in REFUSED_WRITE:
                raise  # not the replay's refusal: the database failed (an outage is an outage, not a divergence)
            # A write the step's code attempted, refused by the read-only transaction, which is rolled back.
            report.divergence = Divergence(seq, row["name"], f"writes to the database: {exc}")
            return
        report.steps.append(result)
        outputs[row["name"]] = row["output"]
    _check_the_end(run, workflow, outputs, len(recorded), report)


def _replay_step(
    run: Run, workflow: Workflow, step_def: StepDef | None, row: dict, outputs: dict, report: Report
) -> StepReplay:
    name = row["name"]
    if step_def is None:
        raise Diverged("the workflow ends before this step", recorded={"step": name}, replayed=None)
    if (step_def.name, step_def.kind) != (name, row["kind"]):
        raise Diverged(
            f"the code has another step here: {step_def.name} ({step_def.kind})",
            recorded={"step": name, "kind": row["kind"]},
            replayed={"step": step_def.name, "kind": step_def.kind},
        )
    was = {k: row[k] for k in _VERSIONS if row[k]}
    now = {k: v for k, v in (step_def.versions or {}).items() if k in _VERSIONS}
    changed = {k: [was.get(k, ""), now.get(k, "")] for k in _VERSIONS if was.get(k, "") != now.get(k, "")}
    shimmed = workflow.shimmed(name, was)
    report.versions_changed = report.versions_changed or bool(changed)
    try:
        return _run_step(run, step_def, row, outputs, report, changed, shimmed, was)
    except Diverged as d:
        d.versions = changed
        raise


def _run_step(
    run: Run, step_def: StepDef, row: dict, outputs: dict, report: Report, changed: dict, shimmed: bool, was: dict
) -> StepReplay:
    seq, name = row["seq"], row["name"]
    # The input as recorded (its versions the recorded ones): what differs before the step runs.
    step_input = {"input": run.input, "outputs": outputs, **({"versions": was} if was else {})}
    if canonical_hash(step_input) != row["input_hash"]:
        raise Diverged("its input differs from the recorded one", recorded={"input_hash": row["input_hash"]})
    feed = Feed(row["tape"], lenient=shimmed, live=report.live)
    ctx = ReplayContext(run, step_def, seq, outputs, feed, report)
    try:
        output = step_def.fn(ctx)
    except Diverged:
        raise
    except DatabaseError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the code raises now, the recorded step did not
        raise Diverged(
            f"raises {exc.__class__.__name__}: {exc}", recorded={"output": row["output"]}, replayed=None
        ) from None
    if feed.diverged is not None:  # raised inside the step, and caught by its own code
        raise feed.diverged
    feed.finish()
    stored = as_stored(output)
    if canonical_hash(stored) != canonical_hash(row["output"]):
        raise Diverged("returns another output", recorded={"output": row["output"]}, replayed={"output": stored})
    return StepReplay(
        seq,
        name,
        row["kind"],
        identical=True,
        fed=feed.fed,
        versions=changed,
        shimmed=shimmed,
        asked_differently=feed.asked_differently,
    )


def _check_the_end(run: Run, workflow: Workflow, outputs: dict, count: int, report: Report) -> None:
    """A run that succeeded ended where the code ends: on the current code it would not go on."""
    result = run.result if isinstance(run.result, dict) else {}
    if run.status != Run.Status.SUCCEEDED or result.get("outcome") == "rejected":
        return
    following = workflow.step_at(count, outputs)
    if following is not None:
        report.divergence = Divergence(
            count,
            following.name,
            f"the run ended here; the code now goes on to {following.name}",
            recorded={"result": run.result},
        )


def as_stored(value: Any) -> Any:
    """`value` as the database stores it (jsonb rewrites numbers, dates become strings), to compare with the record."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::jsonb", [json.dumps(value, cls=DjangoJSONEncoder)])
        stored = cursor.fetchone()[0]
    return json.loads(stored) if isinstance(stored, str | bytes) else stored


def _count_usage(into: dict, tokens_in: int, tokens_out: int, cost) -> None:
    into["tokens_in"] += tokens_in
    into["tokens_out"] += tokens_out
    into["cost"] = str(Decimal(into["cost"]) + Decimal(cost))


class Feed:
    """A recorded step's tape, answered from in order. Gates are checked against their cards, not the tape."""

    def __init__(self, tape: list | None, *, lenient: bool, live: bool):
        self.entries = [e for e in tape or [] if e.get("call") != "gate"]
        self.untaped = tape is None  # recorded before tapes, or it drew nothing
        self.lenient, self.live = lenient, live
        self.at = self.fed = 0
        self.asked_differently = False
        self.diverged: Diverged | None = None

    def take(self, call: str, asked_hash: str | None, replayed: Any = None, **match) -> dict:
        try:
            return self._take(call, asked_hash, replayed, **match)
        except Diverged as d:
            self.diverged = self.diverged or d
            raise

    def _take(self, call: str, asked_hash: str | None, replayed: Any, **match) -> dict:
        if self.at >= len(self.entries):
            why = " (its record holds nothing it drew: recorded before replay, or it called nothing)"
            raise Diverged(f"calls {call}, which the recorded step did not{why * self.untaped}", None, replayed)
        entry = self.entries[self.at]
        self.at += 1
        if entry["call"] != call:
            raise Diverged(f"calls {call} where the recorded step called {entry['call']}", entry, replayed)
        if "unrecordable" in entry:
            raise Diverged(f"cannot be replayed: its {call} answered a {entry['unrecordable']}, which was not recorded")
        for name, value in match.items():
            if entry.get(name) != value:
                raise Diverged(f"{call} with another {name}: {value}", {name: entry.get(name)}, {name: value})
        if entry.get("asked") != asked_hash:
            if not (self.lenient or self.live):
                raise Diverged(f"asks {call} differently", _asked(entry), _what_changed(entry, replayed))
            self.asked_differently = True
        self.fed += 1
        return entry

    def finish(self) -> None:
        if self.at < len(self.entries):
            entry = self.entries[self.at]
            raise Diverged(f"does not call {entry['call']}, which the recorded step called next", _asked(entry))


def _what_changed(entry: dict, replayed: Any) -> Any:
    """A chat asked differently: which of its messages changed (their text now; the record keeps their hashes)."""
    if not isinstance(replayed, dict) or "parts" not in replayed or "parts" not in entry:
        return replayed
    was, now, messages = entry["parts"], replayed["parts"], replayed.get("messages") or []
    changed = [i for i in range(max(len(was), len(now))) if i >= len(was) or i >= len(now) or was[i] != now[i]]
    return {
        "call": replayed["call"],
        "messages": f"{len(now)} (recorded: {len(was)})",
        "changed": [{"index": i, **messages[i]} for i in changed if i < len(messages)],
        **({"tools": "the tools offered differ"} if not changed else {}),
    }


def _asked(entry: dict) -> dict:
    return {k: entry[k] for k in ("call", "asked", "parts", "key") if k in entry}


class Player:
    """`ctx.model` or `ctx.tools` in a replay: the deployment's object for its attributes (a model's name), its
    public methods answered from the tape. `live`: a model's methods are called, and must answer as recorded."""

    def __init__(self, target: Any, feed: Feed, path: str, report: Report, *, systems: bool = False, live=False):
        self._target, self._feed, self._path, self._report = target, feed, path, report
        self._systems, self._live = systems, live

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name, None) if self._target is not None else None
        if name.startswith("_"):
            if value is None:
                raise AttributeError(name)
            return value
        if self._systems and (value is None or not callable(value)):
            return Player(value, self._feed, f"{self._path}.{name}", self._report, live=self._live)
        if value is not None and not callable(value):
            return value
        return lambda *args, **kwargs: self._answer(f"{self._path}.{name}", value, args, kwargs)

    def _answer(self, path: str, fn: Callable | None, args: tuple, kwargs: dict) -> Any:
        parts = parts_of(args)
        replayed = {"call": path, **({"parts": parts} if parts else {})}
        if parts and args:
            replayed["messages"] = args[0]
        entry = self._feed.take(path, asked(args, kwargs), replayed)
        if not self._live:
            return entry.get("answer")
        answer = fn(*args, **kwargs)  # a live model call: what a candidate would be answered
        self._report.calls += 1
        usage = getattr(self._target, "usage", None)
        if isinstance(usage, Usage):
            # Rounded as a step's cost is stored, so that the same calls cost the same as the record.
            cost = usage.cost.quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP)
            _count_usage(self._report.live_usage, usage.tokens_in, usage.tokens_out, cost)
            usage.tokens_in = usage.tokens_out = 0
            usage.cost = Decimal(0)
        if canonical_hash(as_stored(answer)) != canonical_hash(entry.get("answer")):
            raise self._feed.diverged or Diverged(
                "the model answers differently", {"answer": entry.get("answer")}, {"answer": as_stored(answer)}
            )
        return answer


class ReplayContext(Context):
    """A step's Context whose outside world is the record: the model and tools answer from the tape, effects from
    their receipts, gates from their cards, the time and ids as the run drew them."""

    def __init__(self, run: Run, step: StepDef, seq: int, outputs: dict, feed: Feed, report: Report):
        super().__init__(run, step, seq, outputs, model=None, tools=None)
        self.feed = feed
        model = _configured("AGENT_MODEL", run, step)
        self.model = Player(model, feed, "model", report, live=report.live and model is not None)
        self.tools = Player(_configured("AGENT_TOOLS", run, step), feed, "tools", report, systems=True)
        self.usage = Usage()

    def effect(self, call, *, key=None, lookup=None, action=None, preview=None) -> dict:
        key = self._next_key(key, action)
        self.feed.take("effect", canonical_hash(preview), {"key": key, "preview": preview}, key=key)
        receipt = Receipt.objects.filter(key=key, status=Receipt.Status.DONE).values_list("response", flat=True)
        for response in receipt:
            return response
        raise self._diverged(f"makes the effect {key}, which has no done receipt in the record")

    def gate(self, request: ApprovalRequest | None = None, **fields) -> dict:
        if request is None:
            request = ApprovalRequest(channel=self.step.channel, **fields)
        owner = _card_owner(self.run, self.seq)
        decision = gates.backend().decision(owner, self.seq, request)
        if decision is None:
            card = gates.backend().decided(owner, self.seq)
            if card is None:
                raise self._diverged("asks a person, where the recorded run did not", None, request.proposed)
            raise self._diverged(
                "proposes something else than the card a person decided", card.proposed, request.proposed
            )
        check_decided_edit(self.step, request.proposed, decision)
        return decision.as_output()

    def now(self) -> datetime:
        return as_datetime(self.feed.take("now", None)["answer"])

    def new_id(self) -> str:
        return self.feed.take("new_id", None)["answer"]

    def recorded(self, name: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
        return self.feed.take(f"recorded.{name}", asked(args, kwargs))["answer"]

    def _diverged(self, reason: str, recorded: Any = None, replayed: Any = None) -> Diverged:
        self.feed.diverged = self.feed.diverged or Diverged(reason, recorded, replayed)
        return self.feed.diverged


def _card_owner(run: Run, seq: int) -> Run:
    """The run whose card decided step `seq`: a fork's steps before the one it was forked from are its original's
    (runs.forks copied them), and so were their cards."""
    while run.fork_of_id is not None and run.fork_from_step is not None and seq < run.fork_from_step:
        run = run.fork_of
    return run


def _configured(setting: str, run: Run, step: StepDef):
    """The model or tools the deployment configures, made as the engine makes them (nothing is called)."""
    path = getattr(settings, setting)
    return import_string(path)(run, step.name) if path else None


# --- many runs --------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """A replay of many runs: how many replay identically, where the others diverge."""

    workflow: str
    version: int | None
    since: datetime
    until: datetime
    live: bool = False
    runs: int = 0
    identical: int = 0
    diverged_at: Counter = field(default_factory=Counter)  # step name -> runs
    reasons: Counter = field(default_factory=Counter)
    unreplayable: Counter = field(default_factory=Counter)  # why -> runs
    changed_proposals: int = 0
    versions_changed: int = 0
    recorded_usage: dict = field(default_factory=lambda: {"tokens_in": 0, "tokens_out": 0, "cost": "0"})
    live_usage: dict = field(default_factory=lambda: {"tokens_in": 0, "tokens_out": 0, "cost": "0"})
    calls: int = 0
    examples: list = field(default_factory=list)  # the first divergences, for a person to open

    def add(self, report: Report) -> None:
        self.runs += 1
        self.calls += report.calls
        self.versions_changed += report.versions_changed
        for mine, theirs in ((self.recorded_usage, report.recorded_usage), (self.live_usage, report.live_usage)):
            _count_usage(mine, theirs["tokens_in"], theirs["tokens_out"], theirs["cost"])
        if report.identical:
            self.identical += 1
            return
        d = report.divergence
        self.diverged_at[d.step or f"#{d.seq}"] += 1
        self.reasons[d.reason.split(":")[0][:80]] += 1
        self.changed_proposals += report.changed_proposal
        if len(self.examples) < 20:
            self.examples.append({"run": report.run, "seq": d.seq, "step": d.step, "reason": d.reason})

    def as_dict(self) -> dict:
        # Not dataclasses.asdict: it rebuilds a Counter from its (key, count) pairs, counting the pairs.
        out = {f.name: dict(v) if isinstance(v := getattr(self, f.name), Counter) else v for f in fields(self)}
        out["diverged"] = sum(self.diverged_at.values())
        out["unreplayable_runs"] = sum(self.unreplayable.values())
        return json.loads(json.dumps(out, cls=DjangoJSONEncoder))

    def lines(self) -> list[str]:
        out = [
            f"{self.workflow}"
            + (f" on v{self.version}" if self.version else "")
            + f": {self.runs} runs replayed from {self.since:%Y-%m-%d %H:%M} to {self.until:%Y-%m-%d %H:%M}",
            f"  identical: {self.identical}",
        ]
        out += [f"  diverged at {step}: {n}" for step, n in self.diverged_at.most_common()]
        out += [f"  not replayable ({why}): {n}" for why, n in self.unreplayable.most_common()]
        if self.changed_proposals:
            out.append(f"  changed gate proposals: {self.changed_proposals}")
        if self.versions_changed:
            out.append(f"  runs with a step whose prompt or tools version changed: {self.versions_changed}")
        if self.live:
            out.append(
                f"  model calls: {self.calls}; tokens recorded {self.recorded_usage['tokens_in']}+"
                f"{self.recorded_usage['tokens_out']}, cost {self.recorded_usage['cost']}; candidate "
                f"{self.live_usage['tokens_in']}+{self.live_usage['tokens_out']}, cost {self.live_usage['cost']}"
            )
        return out


def replay_many(
    workflow: str, since: datetime, until: datetime, *, version: int | None = None, live: bool = False
) -> Batch:
    """Replay the runs of `workflow` created in [since, until) on the deployed code (`version`: a candidate
    version of it, else each run's own version). Runs still moving are counted as not replayable."""
    try:
        candidate = workflows.get(workflow, version) if version is not None else None
    except UnknownWorkflow as exc:
        raise NotReplayable(str(exc)) from None
    if workflow not in workflows.names():
        raise NotReplayable(f"unknown workflow {workflow!r}; known: {', '.join(workflows.names())}")
    batch = Batch(workflow, version, since, until, live=live)
    runs = Run.objects.filter(workflow=workflow, created_at__gte=since, created_at__lt=until).order_by("created_at")
    for run in runs.iterator(chunk_size=200):
        try:
            batch.add(replay(run, candidate, live=live))
        except NotReplayable as exc:
            batch.unreplayable[str(exc).split(":")[0][:80]] += 1
    return batch
