"""The monitoring dashboard (ops and admins) and /metrics (Prometheus text). Both show the figures of
console.monitoring, read from the database on each request."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.http import Http404, HttpResponse
from django.shortcuts import render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from console import monitoring
from console.context_processors import roles
from core.models import Role

LOOPBACK = {"127.0.0.1", "::1"}


def _check_dashboard_access(request) -> None:
    """Ops and admins, as the nav shows it; 404 for everybody else (login is required by the middleware)."""
    if not roles(request)["user_roles"] & {Role.OPS, Role.ADMIN}:
        raise Http404("no such page")


@require_GET
@never_cache
def dashboard(request):
    return render_dashboard(request)


def render_dashboard(request, status: int = 200, **extra):
    """The page (or its figures, for htmx), with `extra` in its context (the breaker form's errors)."""
    from console import breakers

    _check_dashboard_access(request)
    snap = monitoring.snapshot()
    context = {
        "snap": snap,
        "signals": monitoring.signals(snap),
        "charts": monitoring.charts(snap.at),
        "queue_sla": settings.QUEUE_SLA_SECONDS,
        "token_rate_limit": settings.TOKEN_RATE_LIMIT_PER_MINUTE,
        "can_force_breakers": breakers.may_force(request.user),
        **extra,
    }
    template = "console/dashboard.html"
    if request.htmx:
        template += "#figures"
    return render(request, template, context, status=status)


def _refuse_scraper(request) -> HttpResponse | None:
    """With METRICS_TOKEN set, a scraper sends it as a bearer token (401 without one, 403 for a wrong one);
    without it, only loopback clients may scrape (uvicorn puts the real client of a trusted local proxy here)."""
    if expected := settings.METRICS_TOKEN:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            response = HttpResponse("a bearer token is required\n", status=401, content_type="text/plain")
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
            return response
        if not hmac.compare_digest(given.strip().encode(), expected.encode()):
            return HttpResponse("wrong token\n", status=403, content_type="text/plain")
        return None
    if request.META.get("REMOTE_ADDR") in LOOPBACK:
        return None
    return HttpResponse(
        "metrics are served to loopback clients only; set METRICS_TOKEN to scrape from elsewhere\n",
        status=403,
        content_type="text/plain",
    )


@login_not_required
@never_cache
@require_GET
def metrics(request):
    if (refusal := _refuse_scraper(request)) is not None:
        return refusal
    return HttpResponse(generate_latest(monitoring.registry), content_type=CONTENT_TYPE_LATEST)
