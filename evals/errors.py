"""What an evaluation may refuse (a leaf module: the command, the pages and the API answer each its own way)."""

from __future__ import annotations

from core.periods import PeriodInvalid  # noqa: F401 - a period that does not read (the commands' and API's too)


class EvaluationRefused(ValueError):
    """An evaluation that cannot be made: nothing is saved."""


class CandidateInvalid(EvaluationRefused):
    """A candidate that does not read: `errors`, one line each, naming the path of the value ("$.rules[0].then")."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("the candidate is invalid: " + "; ".join(self.errors))


class EmptyPeriod(EvaluationRefused):
    """No card was decided by a person in the period: there is nothing to compare a candidate with."""
