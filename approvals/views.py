"""The card page: the diff, the rationale, the SLA timer, and the decisions. (Issue #4: to be built.)"""

from __future__ import annotations

from django.http import Http404


def card(request, pk: int):
    raise Http404("not built yet")


def decide(request, pk: int):
    raise Http404("not built yet")
