"""The dashboard's charts of the last hour, one point a minute, drawn as inline SVG; each series is counted by the
app that owns its rows."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils import timezone

from approvals.monitoring import open_cards_per_minute
from jobs.monitoring import dead_letters_per_minute
from runs.monitoring import runs_finished_per_minute


@dataclass
class Sparkline:
    title: str
    values: list[int]
    width: int = 240
    height: int = 40

    @property
    def peak(self) -> int:
        return max(self.values, default=0)

    @property
    def last(self) -> int:
        return self.values[-1] if self.values else 0

    @property
    def points(self) -> str:
        step = self.width / max(1, len(self.values) - 1)
        scale = (self.height - 4) / (self.peak or 1)
        return " ".join(f"{i * step:.1f},{self.height - 2 - v * scale:.1f}" for i, v in enumerate(self.values))


def charts(now: datetime | None = None, minutes: int = 60) -> list[Sparkline]:
    now = (now or timezone.now()).replace(second=0, microsecond=0)
    start = now - timedelta(minutes=minutes - 1)
    return [
        Sparkline("Runs finished per minute", runs_finished_per_minute(start, minutes)),
        Sparkline("Dead letters per minute", dead_letters_per_minute(start, minutes)),
        Sparkline("Open approval cards", open_cards_per_minute(start, now)),
    ]
