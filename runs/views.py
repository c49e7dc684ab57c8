"""Runs pages: the list with status filters, and a run's page with its timeline. (Issue #4: to be built.)"""

from __future__ import annotations

from django.http import Http404


def run_list(request):
    raise Http404("not built yet")


def run_detail(request, pk):
    raise Http404("not built yet")
