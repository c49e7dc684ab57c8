"""What an evaluation may refuse (a leaf module: the command, the pages and the API answer each its own way)."""

from __future__ import annotations


class EvaluationRefused(ValueError):
    """An evaluation that cannot be made: nothing is saved."""


class CandidateInvalid(EvaluationRefused):
    """A candidate that does not read: `errors`, one line each, naming the path of the value ("$.rules[0].then")."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("the candidate is invalid: " + "; ".join(self.errors))


class PeriodInvalid(EvaluationRefused):
    """A period that does not read, or ends before it starts."""


class EmptyPeriod(EvaluationRefused):
    """No card was decided by a person in the period: there is nothing to compare a candidate with."""
