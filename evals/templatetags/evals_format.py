"""How the evaluations' pages and the command write a duration: 282h11m26s, not 1015886 seconds."""

from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s"
