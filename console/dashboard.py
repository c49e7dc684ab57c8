"""The monitoring dashboard (ops and admins), its form that forces a circuit breaker (ops), and /metrics
(Prometheus text, console.prometheus). Both show the figures of console.monitoring, read from the database on
each request. The page also shows the reviewer signals of the last 30 days (approvals.reviewers), read when the
page loads, never by its 5-second poll."""

from __future__ import annotations

import hmac

from django import forms
from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from approvals import reviewers
from console import alerts, charts, monitoring, prometheus
from core.access import oversees
from core.models import KILL_SWITCH_REASON_MAX, ReasonRequired
from core.views import HtmxHttpRequest
from runs import breakers
from runs.access import check_may_force_breaker, may_force_breakers

LOOPBACK = {"127.0.0.1", "::1"}


def _check_dashboard_access(request) -> None:
    """Ops and admins (core.access.oversees), as the nav shows it; 404 for everybody else (login is required by
    the middleware)."""
    if not oversees(request.user):
        raise Http404("no such page")


@require_GET
@never_cache
def dashboard(request: HtmxHttpRequest):
    return render_dashboard(request)


def render_dashboard(request: HtmxHttpRequest, status: int = 200, **extra):
    """The page (or its figures, for htmx), with `extra` in its context (the breaker form's errors)."""
    _check_dashboard_access(request)
    snap = monitoring.snapshot()
    context = {
        "snap": snap,
        "signals": alerts.signals(snap),
        "charts": charts.charts(snap.at),
        "queue_sla": settings.QUEUE_SLA_SECONDS,
        "token_rate_limit": settings.TOKEN_RATE_LIMIT_PER_MINUTE,
        "can_force_breakers": may_force_breakers(request.user),
        **extra,
    }
    template = "console/dashboard.html"
    if request.htmx:
        template += "#figures"
    else:
        # Thirty days of decisions: read once per page load, not by the figures' poll.
        context["reviewer_signals"] = reviewers.signals()
    return render(request, template, context, status=status)


class ForceBreakerForm(forms.Form):
    system = forms.SlugField(max_length=64)
    action = forms.ChoiceField(choices=[("open", "Hold open"), ("close", "Close")])
    reason = forms.CharField(
        max_length=KILL_SWITCH_REASON_MAX,
        error_messages={"required": "Give a reason: it is what the next person on call will read."},
    )


@require_POST
def force_breaker(request):
    """The dashboard's form: hold a circuit breaker open, or close it (runs.breakers.force, audited); who may is
    runs.access.check_may_force_breaker, as for the API."""
    form = ForceBreakerForm(request.POST)
    if form.is_valid():
        check_may_force_breaker(request.user, form.cleaned_data["system"])
        try:
            breakers.force(
                form.cleaned_data["system"],
                open=form.cleaned_data["action"] == "open",
                by=request.user,
                reason=form.cleaned_data["reason"],
            )
        except ReasonRequired as exc:
            form.add_error("reason", str(exc))
        else:
            return redirect("dashboard")
    else:
        check_may_force_breaker(request.user, request.POST.get("system", ""))
    return render_dashboard(request, status=422, breaker_form=form)


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
    return HttpResponse(generate_latest(prometheus.registry), content_type=CONTENT_TYPE_LATEST)
