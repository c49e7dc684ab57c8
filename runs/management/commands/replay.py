"""`manage.py replay`: a recorded run on the code deployed now, fed back from its record (runs.replay, docs/replay.md).
Nothing is called, sent or changed."""

from __future__ import annotations

import json

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from core.periods import period
from runs import replay as replays
from runs import workflow as workflows
from runs.errors import UnknownWorkflow
from runs.models import Run
from runs.workflow import Workflow


class Command(BaseCommand):
    help = (
        "Replay a recorded run (RUN_ID) on the code deployed now, feeding back what it recorded instead of calling "
        "the model, tools or anything else: it says whether the run replays identically or the first step where it "
        "diverges, side by side with the record. With --workflow and --since, replays the runs of a period and "
        "prints a summary. Nothing is sent and nothing changes. See docs/replay.md."
    )

    def add_arguments(self, parser):
        parser.add_argument("run_id", nargs="?", help="the run to replay")
        parser.add_argument("--workflow", help="replay the runs of this workflow created in the period")
        parser.add_argument("--since", help="the period's start: 7d, 12h, 30m back from now, or an ISO date/time")
        parser.add_argument("--until", help="the period's end (default: now)")
        parser.add_argument(
            "--on-version",
            dest="on_version",
            type=int,
            help="replay on this deployed version of the workflow (default: each run's own)",
        )
        parser.add_argument("--json", action="store_true", help="print the report as JSON")

    def handle(self, *args, run_id=None, workflow=None, since=None, until=None, on_version=None, **options):
        version = on_version
        if bool(run_id) == bool(workflow):
            raise CommandError("give either a RUN_ID, or --workflow NAME --since PERIOD")
        try:
            if run_id:
                if since or until:
                    raise CommandError("--since and --until go with --workflow, not a RUN_ID")
                run = _run(run_id)
                report = replays.replay(run, _candidate(run.workflow, version))
                self._print_report(report, options["json"])
                return
            if not since:
                raise CommandError("--workflow needs --since (e.g. --since 7d)")
            start, end = period(since, until)
            batch = replays.replay_many(workflow, start, end, version=version)
        except (ValueError, replays.NotReplayable) as exc:
            raise CommandError(str(exc)) from None
        if batch.runs == 0 and not batch.unreplayable:
            raise CommandError(f"no run of {workflow} was created between {start.isoformat()} and {end.isoformat()}")
        if options["json"]:
            self.stdout.write(json.dumps(batch.as_dict(), indent=2))
        else:
            self.stdout.write("\n".join(batch.lines()))

    def _print_report(self, report: replays.Report, as_json: bool) -> None:
        if as_json:
            self.stdout.write(json.dumps(report.as_dict(), indent=2))
            return
        on = f"{report.workflow} v{report.version}"
        self.stdout.write(f"run {report.run} (recorded on v{report.recorded_version}) on {on}: {report.summary()}")
        for step in report.steps:
            marks = [f"{k} {was or '-'} -> {now or '-'}" for k, (was, now) in step.versions.items()]
            if step.shimmed:
                marks.append("declared compatible")
            self.stdout.write(
                f"  {step.seq:>3} {step.name:<45} identical, {step.fed} answers from the record"
                + (f" ({'; '.join(marks)})" if marks else "")
            )
        if (d := report.divergence) is not None:
            self.stdout.write(f"  {d.seq:>3} {d.step:<45} DIVERGES: {d.reason}")
            for name, (was, now) in d.versions.items():
                self.stdout.write(f"      {name} changed: {was or '-'} -> {now or '-'}")
            self.stdout.write("      recorded: " + _shown(d.recorded))
            self.stdout.write("      replayed: " + _shown(d.replayed))
        self.stdout.write(f"  {report.ms:.0f} ms, {report.calls} calls made outside")


def _run(run_id: str) -> Run:
    try:
        return Run.objects.get(pk=run_id)
    except (Run.DoesNotExist, ValidationError):
        raise CommandError(f"no run {run_id}") from None


def _candidate(workflow: str, version: int | None) -> Workflow | None:
    if version is None:
        return None
    try:
        return workflows.get(workflow, version)
    except UnknownWorkflow as exc:
        raise CommandError(str(exc)) from None


def _shown(value) -> str:
    text = json.dumps(value, indent=2, default=str, sort_keys=True)
    text = text if len(text) <= 4000 else text[:4000] + "\n...(cut)"
    return text.replace("\n", "\n      ")
