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


def version_bars(figures: dict) -> tuple[list[Bar], int]:
    """A version's chart: a bar of the runs that replay identically, then one per step where runs diverge."""
    rows = [("identical", "identical", figures.get("identical", 0))]
    rows += sorted(
        (("diverged", f"diverged at {step}", n) for step, n in (figures.get("diverged_at") or {}).items()),
        key=lambda row: -row[2],
    )
    peak = max((n for *_, n in rows), default=0) or 1
    scale = (WIDTH - LABEL - 50) / peak
    bars = [
        Bar(kind, label[:40], n, i * (BAR_HEIGHT + GAP), [Segment(kind, n, float(LABEL), round(n * scale, 1))])
        for i, (kind, label, n) in enumerate(rows)
    ]
    return bars, len(bars) * (BAR_HEIGHT + GAP)


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
