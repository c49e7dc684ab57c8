"""The audit log console page and its CSV export, for admins. (Issue #5: to be built.)"""

from __future__ import annotations

from django.http import Http404


def audit_log(request):
    raise Http404("not built yet")
