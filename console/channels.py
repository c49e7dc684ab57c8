"""Kill switches: the channels page, engage/release, and the API for automation. (Issue #5: to be built.)"""

from __future__ import annotations

from django.http import Http404
from ninja import Router

router = Router(tags=["channels"])


def channel_list(request):
    raise Http404("not built yet")
