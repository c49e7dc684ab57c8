"""The console's URLs: every app's pages, Slack's interactions, the JSON API under /api/ (bearer tokens: no login
redirect) and the admin."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from approvals import inbox
from approvals import views as approval_views
from console import audit, channels, dashboard, passwords, views
from console.api import api
from console.env import env_bool
from evals import views as eval_views
from external import views as external_views
from runs import views as run_views
from slackapp import views as slack_views


def _login_not_required(patterns):
    """The API authenticates with its own bearer tokens and answers 401 in JSON, never a login redirect."""
    for pattern in patterns:
        if hasattr(pattern, "url_patterns"):
            _login_not_required(pattern.url_patterns)
        else:
            pattern.callback.login_required = False
    return patterns


api_patterns, api_app_name, api_namespace = api.urls

urlpatterns = [
    path("", views.home, name="home"),
    path("approvals/<int:pk>/", approval_views.card, name="card"),
    path("approvals/<int:pk>/decide", approval_views.decide, name="decide"),
    path("approvals/<int:pk>/reveal", approval_views.reveal, name="reveal"),  # audited: pii.view
    path("approvals/bulk", inbox.bulk, name="approvals-bulk"),
    # An email's Approve or Reject link (approvals.links): opens the card with the choice pre-selected, after login.
    path("approvals/email/<str:token>/", approval_views.decision_link, name="decision-link"),
    path("approvals/away/", approval_views.away, name="away"),  # audited
    path("runs/", run_views.run_list, name="runs"),
    path("runs/<uuid:pk>/", run_views.run_detail, name="run"),
    path("runs/<uuid:pk>/cancel", run_views.run_cancel, name="run-cancel"),
    path("runs/<uuid:pk>/replay", run_views.run_replay, name="run-replay"),
    path("runs/<uuid:pk>/fork", run_views.run_fork, name="run-fork"),
    # The outcome of an external agent's execution, recorded by a person (external.views): audited.
    path("runs/<uuid:pk>/steps/<int:seq>/outcome", external_views.record_outcome, name="run-record-outcome"),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("metrics", dashboard.metrics, name="metrics"),
    path("dashboard/", dashboard.dashboard, name="dashboard"),
    path("dashboard/breakers/", dashboard.force_breaker, name="breaker-force"),
    path("evaluations/", eval_views.evaluation_list, name="evaluations"),
    path("evaluations/<int:pk>/", eval_views.evaluation_detail, name="evaluation"),
    path("channels/", channels.channel_list, name="channels"),
    path("channels/kill-switch/", channels.global_kill_switch, name="global-kill-switch"),
    path("channels/<slug:name>/kill-switch/", channels.channel_kill_switch, name="channel-kill-switch"),
    path("audit/", audit.audit_log, name="audit"),
    path("audit/export.csv", audit.audit_export, name="audit_export"),
    path("audit/evidence.zip", audit.audit_evidence, name="audit_evidence"),  # audited
    path("accounts/password_change/", passwords.password_change, name="password_change"),  # audited
    path("accounts/", include("django.contrib.auth.urls")),
    # Channels, API tokens, the audit log and the global switch were the console app's models until issue 18 moved
    # them to core: their old admin addresses (bookmarks, runbooks) lead to the new ones.
    re_path(
        r"^admin/console/(?P<rest>(?:apitoken|auditentry|channel|globalkillswitch)/.*)$",
        RedirectView.as_view(url="/admin/core/%(rest)s", query_string=True),
    ),
    path("admin/", admin.site.urls),
    # Slack's interactivity request URL: signed by Slack, outside the bearer-token API (slackapp.views).
    path("api/slack/interactions", slack_views.slack_interactions, name="slack-interactions"),
    path("api/", include((_login_not_required(api_patterns), api_app_name), namespace=api_namespace)),
]

# `make bench`'s baseline endpoints (console/bench_views.py): only with BENCH_ENDPOINTS=1, in development.
if env_bool("BENCH_ENDPOINTS", False) and settings.DEVELOPMENT:
    from console import bench_views

    urlpatterns += bench_views.urlpatterns
