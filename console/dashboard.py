"""The monitoring dashboard and /metrics. (Issue #5: to be built.)"""

from __future__ import annotations

from django.contrib.auth.decorators import login_not_required
from django.http import Http404


def dashboard(request):
    raise Http404("not built yet")


@login_not_required
def metrics(request):
    raise Http404("not built yet")
