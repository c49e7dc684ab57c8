"""`manage.py evaluate`: run a candidate over the cards of a period, offline, and save it (docs/evaluate.md).

    manage.py evaluate --rule candidate.json --since 30d
    manage.py evaluate --rule '{"rules": [...]}' --since 2026-11-01 --until 2026-12-01 --json --no-save
    manage.py evaluate --auto-approve-under 5000 --channel payments --currency EUR --since 30d
    manage.py evaluate --workflow support_agent --candidate-version 2 [--model replayed|live] --since 7d

Which candidate was given picks its kind (`CANDIDATE_KINDS`): each kind adds its own options and builds its own
evaluation, so that another kind (a workflow version: --workflow/--candidate-version/--model) is one more entry, not a
rewrite. Bad input is a CommandError with the reason, and nothing is saved.
"""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.core.serializers.json import DjangoJSONEncoder

from evals.errors import EvaluationRefused, PeriodInvalid
from evals.models import Evaluation
from evals.rules import ACTIONS, period
from evals.templatetags.evals_format import duration


def _rule_given(options) -> bool:
    return options["rule"] is not None or options["auto_approve_under"] is not None


def _rule_candidate(options) -> dict | str:
    """The rule candidate of --rule (a file, or inline JSON) or of the --auto-approve-under shorthand."""
    if options["rule"] is not None and options["auto_approve_under"] is not None:
        raise CommandError("give --rule or --auto-approve-under, not both")
    if options["auto_approve_under"] is not None:
        under = options["auto_approve_under"]
        condition = {"amount_below": under}
        for name in ("channel", "currency"):
            if options[name]:
                condition[name] = options[name]
        where = f" on {options['channel']}" if options["channel"] else ""
        unit = f" {options['currency']}" if options["currency"] else " minor units"
        return {
            "name": f"auto-approve under {under}{unit}{where}",
            "rules": [{"if": condition, "then": "auto_approve"}],
            "otherwise": "ask",
        }
    if options["channel"] or options["currency"]:
        raise CommandError("--channel and --currency go with --auto-approve-under; write them in the rule instead")
    text = options["rule"]
    if not text.lstrip().startswith("{"):
        try:
            text = Path(text).read_text()
        except OSError as exc:
            raise CommandError(f"--rule: cannot read {text!r} ({exc.strerror or exc})") from None
    return text


def _evaluate_rule(options, since, until) -> Evaluation:
    return Evaluation.of_rule(_rule_candidate(options), since, until, name=options["name"], save=False)


def _version_given(options) -> bool:
    return options["workflow"] is not None


def _evaluate_version(options, since, until) -> Evaluation:
    if options["candidate_version"] is None:
        raise CommandError("--workflow needs --candidate-version: the deployed version to evaluate")
    candidate = {"workflow": options["workflow"], "version": options["candidate_version"], "model": options["model"]}
    return Evaluation.of_version(candidate, since, until, name=options["name"])


# Which candidate a run of the command was given: (is it given?, how to evaluate it). One entry per kind.
CANDIDATE_KINDS = {
    Evaluation.Kind.RULE: (_rule_given, _evaluate_rule),
    Evaluation.Kind.VERSION: (_version_given, _evaluate_version),
}


class Command(BaseCommand):
    help = "Evaluate a candidate approval rule over the cards of a period, offline; save it as an evaluation."

    def add_arguments(self, parser):
        rule = parser.add_argument_group("an approval rule (docs/evaluate.md)")
        rule.add_argument("--rule", help="The candidate: a JSON file, or the JSON itself.")
        rule.add_argument(
            "--auto-approve-under",
            type=int,
            metavar="MINOR_UNITS",
            help="Shorthand: auto-approve the cards under this amount (cents), ask for the others.",
        )
        rule.add_argument("--channel", default="", help="With --auto-approve-under: only this channel's cards.")
        rule.add_argument("--currency", default="", help="With --auto-approve-under: only cards in this currency.")
        version = parser.add_argument_group("a workflow or prompt version (docs/replay.md)")
        version.add_argument("--workflow", help="Replay this workflow's runs of the period on a candidate version.")
        version.add_argument(
            "--candidate-version", type=int, metavar="N", help="The candidate: a deployed version of --workflow."
        )
        version.add_argument(
            "--model",
            choices=("replayed", "live"),
            default="replayed",
            help="replayed (default): the recorded model answers are fed back; live: the configured model is asked "
            "again (its tokens and cost counted).",
        )
        parser.add_argument("--since", required=True, help="Start of the period: an age (30d, 12h, 2w) or ISO date.")
        parser.add_argument("--until", help="End of the period (ISO date or datetime, or an age); default now.")
        parser.add_argument("--name", default="", help="The evaluation's name (default: the candidate's).")
        parser.add_argument("--json", action="store_true", help="Print the evaluation as JSON.")
        parser.add_argument("--no-save", action="store_true", help="Print it only; save nothing.")

    def handle(self, *args, **options):
        given = [kind for kind, (is_given, _) in CANDIDATE_KINDS.items() if is_given(options)]
        if len(given) != 1:
            raise CommandError(
                "give one candidate: --rule FILE_OR_JSON, --auto-approve-under MINOR_UNITS, or --workflow NAME "
                "--candidate-version N"
            )
        _, evaluate = CANDIDATE_KINDS[given[0]]
        try:
            since, until = period(options["since"], options["until"])
            evaluation = evaluate(options, since, until)
        except (EvaluationRefused, PeriodInvalid) as exc:
            raise CommandError(str(exc)) from None
        if not options["no_save"]:
            evaluation.save_audited()
        if options["json"]:
            self.stdout.write(json.dumps(evaluation.as_dict(), cls=DjangoJSONEncoder, indent=2))
        else:
            self.stdout.write(summary(evaluation))


def summary(evaluation: Evaluation) -> str:
    """The evaluation as a person reads it in a terminal."""
    f = evaluation.figures
    if evaluation.kind == Evaluation.Kind.VERSION:
        return _version_summary(evaluation, f)
    lines = [
        f"Evaluation {evaluation.pk or '(not saved)'}: {evaluation.name}",
        f"Period: {evaluation.period_start:%Y-%m-%d %H:%M} to {evaluation.period_end:%Y-%m-%d %H:%M} UTC",
        f"Cards closed: {f['total']}; decided by a person: {f['decided_by_person']}; left out: "
        + ", ".join(f"{n} {why}" for why, n in f["not_decided_by_person"].items()),
        "",
        f"{'candidate / people':20s} {'approved':>9s} {'edited':>9s} {'rejected':>9s}",
    ]
    for action in ACTIONS:
        row = f["matrix"][action]
        lines.append(f"{action:20s} {row['approved']:9d} {row['edited']:9d} {row['rejected']:9d}")
    agreement = f["agreement"]
    lines += [
        "",
        f"Agreement: {'n/a' if agreement is None else f'{agreement:.1%}'} "
        f"({f['agreed']} of the {f['candidate_decided']} cards it would have decided itself)",
        f"Time saved: {duration(f['time_saved']['total_seconds'])} over {f['time_saved']['cards']} cards "
        f"(median {duration(f['time_saved']['median_seconds'])} each)",
        f"Dangerous (auto-approved, but a person rejected or edited): {f['dangerous']['count']}",
    ]
    lines += [_card_line(card) for card in f["dangerous"]["cards"]]
    lines.append(f"Refused, but a person approved: {f['refused_approved']['count']}")
    if "quorum_short" in f:
        lines.append(f"Approved by fewer people than the quorum asks: {f['quorum_short']['count']}")
    return "\n".join(lines)


def _card_line(card: dict) -> str:
    amount = "" if card["amount_minor"] is None else f" {card['amount_minor']} {card['currency']}"
    why = f": {card['comment']}" if card["comment"] else ""
    return (
        f"  card {card['card']} ({card['workflow']} on {card['channel']}{amount}) {card['outcome']} by "
        f"{', '.join(card['decided_by'])}{why}"
    )


def _version_summary(evaluation: Evaluation, f: dict) -> str:
    lines = [
        f"Evaluation {evaluation.pk or '(not saved)'}: {evaluation.name}",
        f"Period: {evaluation.period_start:%Y-%m-%d %H:%M} to {evaluation.period_end:%Y-%m-%d %H:%M} UTC",
        f"Runs replayed: {f['runs']}; identical: {f['identical']}; diverged: {f['diverged']}; not replayable: "
        f"{f['unreplayable_runs']}",
    ]
    lines += [f"  diverged at {step}: {n}" for step, n in sorted(f["diverged_at"].items(), key=lambda x: -x[1])]
    lines += [f"  because it {reason}: {n}" for reason, n in sorted(f["reasons"].items(), key=lambda x: -x[1])]
    lines.append(f"Changed gate proposals: {f['changed_proposals']}")
    if "delta" in f:
        was, now = f["recorded_usage"], f["live_usage"]
        lines.append(
            f"Model ({f['calls']} calls): tokens {was['tokens_in']}+{was['tokens_out']} recorded, "
            f"{now['tokens_in']}+{now['tokens_out']} now; cost {was['cost']} recorded, {now['cost']} now "
            f"(delta {f['delta']['cost']})"
        )
    lines += [f"  run {e['run']} diverges at {e['seq']} ({e['step']}): {e['reason']}" for e in f["examples"]]
    return "\n".join(lines)
