"""The console's own pages: `/` (the reviewer's inbox, or the empty states of the user's roles), and the liveness
and readiness probes (/healthz, /readyz)."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.db import DatabaseError, connection
from django.http import JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from django.views.decorators.vary import vary_on_headers
from procrastinate.contrib.django.models import ProcrastinateWorker

from approvals import inbox
from core.access import roles_of
from core.models import Role
from core.views import HtmxHttpRequest


@require_GET
@vary_on_headers("HX-Request", "HX-Target")
def home(request: HtmxHttpRequest):
    """`/`: the reviewer's inbox (approvals.inbox) for whoever may approve a channel; for everyone else the empty
    states of their roles."""
    if channels := inbox.approvable_channels(request.user):
        return inbox.render_inbox(request, channels)
    held = roles_of(request.user)
    return render(request, "console/home.html", {"roles": [role for role in Role if role in held]})


@login_not_required
@never_cache
@require_GET
def healthz(request):
    """Liveness: the process answers. Touches nothing else, so a database outage does not restart it."""
    return JsonResponse({"status": "ok"})


@login_not_required
@never_cache
@require_GET
def readyz(request):
    """Readiness: the database answers and a worker has sent a heartbeat recently."""
    problems = []
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        problems.append(f"database unreachable: {exc.__class__.__name__}")
    else:
        max_age = settings.READY_HEARTBEAT_MAX_AGE
        since = timezone.now() - timedelta(seconds=max_age)
        if not ProcrastinateWorker.objects.filter(last_heartbeat__gte=since).exists():
            problems.append(f"no worker heartbeat in the last {max_age} s")
    if problems:
        return JsonResponse({"status": "unavailable", "problems": problems}, status=503)
    return JsonResponse({"status": "ok"})
