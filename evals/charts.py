"""The evaluation's chart: for each candidate action, a bar of the cards it would have taken so, split by what the
people did (approved unchanged, edited, rejected), drawn as inline SVG by the template from these rectangles."""

from __future__ import annotations

from dataclasses import dataclass

from evals.records import OUTCOMES
from evals.rules import ACTIONS

WIDTH, BAR_HEIGHT, GAP, LABEL = 480, 26, 12, 110
LABELS = {"auto_approve": "auto-approve", "refuse": "refuse", "ask": "ask a person"}


@dataclass(frozen=True)
class Segment:
    outcome: str
    count: int
    x: float
    width: float


@dataclass(frozen=True)
class Bar:
    action: str
    label: str
    total: int
    y: int
    segments: list[Segment]


def matrix_bars(matrix: dict) -> tuple[list[Bar], int]:
    """The bars of `matrix` (figures["matrix"]), scaled to the largest, and the chart's height."""
    peak = max((sum(row.values()) for row in matrix.values()), default=0) or 1
    scale = (WIDTH - LABEL - 50) / peak
    bars = []
    # In the candidate's order of actions: a jsonb object comes back with its keys in its own order.
    rows = [(action, matrix[action]) for action in ACTIONS if action in matrix]
    for i, (action, row) in enumerate(rows):
        x, segments = float(LABEL), []
        for outcome in OUTCOMES:
            width = row.get(outcome, 0) * scale
            segments.append(Segment(outcome, row.get(outcome, 0), round(x, 1), round(width, 1)))
            x += width
        y = i * (BAR_HEIGHT + GAP)
        bars.append(Bar(action, LABELS.get(action, action), sum(row.values()), y, segments))
    return bars, len(bars) * (BAR_HEIGHT + GAP)
