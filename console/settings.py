"""Settings, all read from the environment (each variable: docs/configuration.md)."""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured
from django.utils.csp import CSP

from console import db_pool, logs, mail_config, schedules
from console.env import (
    database_from_url,
    env_bool,
    env_decimal,
    env_float,
    env_int,
    env_list,
    env_secret,
    env_str,
    webhook_secrets,
)
from jobs.sessions import ROLES as CONNECTION_ROLES
from jobs.sessions import application_name

BASE_DIR = Path(__file__).resolve().parent.parent

CONSOLE_ENV = env_str("CONSOLE_ENV", "development")
DEVELOPMENT = CONSOLE_ENV == "development"
DEBUG = env_bool("DEBUG", False)
SECRET_KEY = env_secret("SECRET_KEY", development_default="development-only-not-a-secret", development=DEVELOPMENT)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "127.0.0.1,localhost")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")

# The database: DATABASE_URL when set, otherwise the checkout's own embedded PostgreSQL.
DATABASE_URL = env_str("DATABASE_URL")
EMBEDDED_PGDATA = Path(env_str("EMBEDDED_PGDATA", str(BASE_DIR / ".pgdata")))
if not DATABASE_URL:
    from console import embedded_db

    DATABASE_URL = embedded_db.start(EMBEDDED_PGDATA)
    DATABASE_IS_EMBEDDED = True
else:
    DATABASE_IS_EMBEDDED = False
# A worker process (`manage.py worker`) may reach PostgreSQL by another way than the rest: WORKER_DATABASE_URL, when
# set, is its URL. The web tier may go through a transaction-mode pool (PgBouncer); a worker only directly or
# through a session-mode pool, and refuses to start otherwise (jobs.sessions; docs/deploy.md, "Connections and
# PgBouncer").
_WORKER_COMMAND = sys.argv[1:2] == ["worker"] or sys.argv[1:3] == ["procrastinate", "worker"]
WORKER_DATABASE_URL = env_str("WORKER_DATABASE_URL")
if _WORKER_COMMAND and WORKER_DATABASE_URL:
    DATABASES = {"default": database_from_url(WORKER_DATABASE_URL, name="WORKER_DATABASE_URL")}
else:
    DATABASES = {"default": database_from_url(DATABASE_URL)}
# DATABASE_TRANSACTION_POOL=1: DATABASE_URL goes through a transaction-mode pool, where a cursor held open across
# transactions (Django's server-side cursors, `.iterator()`) cannot live: Django reads such querysets in chunks
# of ordinary queries instead. (Workers never run on one.)
DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = env_bool("DATABASE_TRANSACTION_POOL", False)
# A worker holds its runs' advisory locks for as long as its database session lives (runs.ownership). Over TCP,
# have the server probe an idle client, so that a machine that vanished without closing its connections loses its
# sessions, and their locks, within about 25 s instead of the operating system's two hours. (Unix sockets need no
# probes: the kernel closes them with the process.) A URL that sets `options` itself keeps its own.
if not DATABASES["default"]["HOST"].startswith("/"):
    DATABASES["default"]["OPTIONS"].setdefault(
        "options", "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3"
    )
# Seconds a connection is kept between jobs or requests (0: one per unit of work). Workers gain from keeping them
# (procrastinate closes them around each job as Django does around a request, health-checked before reuse): a
# decided card's run resumes without a new PostgreSQL backend first (bench/resume_latency.py: p99 ~25 instead of
# ~85 ms), so a worker keeps them 300 s unless DATABASE_CONN_MAX_AGE says otherwise. Under ASGI Django advises
# against it for the web server, which has its pool instead (below).
DATABASES["default"]["CONN_MAX_AGE"] = env_int("DATABASE_CONN_MAX_AGE", 300 if _WORKER_COMMAND else 0)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# --- Database connection pool (the web server's) --------------------------------------------------------------
# DATABASE_POOL=1: Django's psycopg pool, per process, instead of a new PostgreSQL connection per request (which
# costs a backend fork per request: `make bench`'s enqueue figures in docs/BENCHMARKS.md). `python -m
# console.webserver` turns it on by default; workers stay off it (a job's thread keeps its own connection and
# holds a session-level advisory lock on it, runs/ownership.py). Connections are health-checked when taken.
# A worker never takes it, whatever the environment says: putconn() would keep a session advisory lock that a
# failed unlock left behind (ownership closes the connection to end the session) alive in the pool.
if env_bool("DATABASE_POOL", False) and not _WORKER_COMMAND:
    if DATABASES["default"]["CONN_MAX_AGE"]:
        raise ImproperlyConfigured("DATABASE_POOL=1 needs DATABASE_CONN_MAX_AGE=0 (a pool keeps the connections)")
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": env_int("DATABASE_POOL_MIN_SIZE", 2),
        # One per thread of the server's WSGI side (WEB_THREADS, default 8, console/asgi.py): a request never waits
        # for a connection; a waiting long-poll returns its connection between two looks (external.api).
        "max_size": env_int("DATABASE_POOL_MAX_SIZE", 8),
        # Seconds a request waits for a connection (then 503, Retry-After): also how long a request waits while the
        # database is down, since the pool keeps trying to reconnect meanwhile.
        "timeout": env_float("DATABASE_POOL_TIMEOUT", 2),
        # A dead connection is still never handed out, without a round trip before every request (console.db_pool).
        "check": db_pool.check_connection,
    }
# --- end of database connection pool ----------------------------------------------------------------------------
# Two test sessions on one server (two checkouts, or CI jobs side by side) need two test database names.
if test_database_name := env_str("TEST_DATABASE_NAME"):
    DATABASES["default"]["TEST"] = {"NAME": test_database_name}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.postgres",  # ArrayField (approvals: who a card asks)
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django_htmx",
    "guardian",
    # Serves /api/docs (Swagger UI) from ninja's bundled static files instead of a CDN.
    "ninja",
    "axes",  # login throttling (see the security block below)
    "procrastinate.contrib.django",
    # The ground floor first (channels, kill switches, audit log, API tokens), then the apps that build on it,
    # then the project itself: pages that cross apps, and its management commands (`serve`).
    "core",
    "jobs",
    "runs",
    "approvals",
    "external",
    "slackapp",
    "evals",  # offline evaluations of candidate approval rules (docs/evaluate.md)
    "console",
]
# The demo (the `refund` workflow, its fake external systems and scripted model): development and tests only.
DEMO_ENABLED = env_bool("DEMO_ENABLED", DEVELOPMENT)
if DEMO_ENABLED:
    INSTALLED_APPS.append("demo")

# "BrowserOnly...": Django's middleware of that name, skipped for an API call with a bearer token, which needs
# none of it (console.middleware.is_token_request; docs/PROFILE-api.md).
MIDDLEWARE = [
    "console.middleware.RequestIdMiddleware",
    # Outside the session and auth middlewares, whose own queries fail first during an outage.
    "console.middleware.DatabaseUnavailableMiddleware",
    # Inside the outage's answer (it reads the database), outside everything that renders a page or an answer.
    "console.middleware.PersonalDataMiddleware",
    "console.middleware.ApiBodyLimitMiddleware",
    # Before the session middleware: a NUL in a cookie or query string must not reach a query.
    "console.middleware.SafeInputMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "console.middleware.BrowserOnlyCspMiddleware",
    "console.middleware.BrowserOnlyWhiteNoiseMiddleware",
    "console.middleware.BrowserOnlySessionMiddleware",
    # Django's CommonMiddleware, with the probes answered whatever Host they name.
    "console.middleware.CommonMiddleware",
    "console.middleware.BrowserOnlyCsrfViewMiddleware",
    "console.middleware.BrowserOnlyAuthenticationMiddleware",
    "console.middleware.BrowserOnlyLoginRequiredMiddleware",
    "console.middleware.BrowserOnlyMessageMiddleware",
    "console.middleware.BrowserOnlyXFrameOptionsMiddleware",
    "console.middleware.BrowserOnlyHtmxMiddleware",
    "console.middleware.AccessDeniedMiddleware",
    # Last, as django-axes asks: answers a locked-out login attempt with 429.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "console.urls"
WSGI_APPLICATION = "console.wsgi.application"  # the production server's (console/webserver.py)
ASGI_APPLICATION = "console.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.context_processors.access",
            ],
        },
    },
]

AUTHENTICATION_BACKENDS = [
    # First: refuses a locked-out login before any other backend checks the password.
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEVELOPMENT)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [
    BASE_DIR / "static",
    ("vendor/htmx", BASE_DIR / "node_modules" / "htmx.org" / "dist"),
]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}

# Procrastinate: tasks live in each app's tasks.py.
PROCRASTINATE_WORKER_DEFAULTS = {
    # Worker identity in logs and job contexts: host + pid + start time.
    "name": f"{socket.gethostname()}:{os.getpid()}:{int(time.time())}",
    "concurrency": env_int("WORKER_CONCURRENCY", 4),
    "shutdown_graceful_timeout": env_float("WORKER_SHUTDOWN_GRACEFUL_TIMEOUT", 20),
    "update_heartbeat_interval": env_float("WORKER_HEARTBEAT_INTERVAL", 10),
    "stalled_worker_timeout": env_float("STALLED_AFTER_SECONDS", 30),
    "fetch_job_polling_interval": env_float("WORKER_POLL_INTERVAL", 1),
}
# The worker's psycopg pool (the fetch loop, heartbeats, job statuses, the abort poll, periodic defers), all opened at
# start; with its LISTEN connection and one per job thread, a worker holds WORKER_POOL_SIZE + 1 + WORKER_CONCURRENCY
# connections (jobs.sessions.connections_per_worker; docs/deploy.md, "Connections and PgBouncer"). Two at least: the
# start-up check of its sessions takes two.
WORKER_POOL_SIZE = env_int("WORKER_POOL_SIZE", 4)
if WORKER_POOL_SIZE < 2:
    raise ImproperlyConfigured(f"WORKER_POOL_SIZE must be 2 or more, got {WORKER_POOL_SIZE}")
# A worker's connections name themselves in pg_stat_activity `<name>:<pid>:<role>` (role: pool, listen, job), the
# name being the URL's application_name or `worker`: the connection count per worker and role is one query away.
WORKER_APPLICATION_NAMES = {}
if _WORKER_COMMAND:
    _base_name = DATABASES["default"]["OPTIONS"].get("application_name") or "worker"
    WORKER_APPLICATION_NAMES = {role: application_name(_base_name, os.getpid(), role) for role in CONNECTION_ROLES}
    DATABASES["default"]["OPTIONS"]["application_name"] = WORKER_APPLICATION_NAMES["job"]
# Keep LISTEN/NOTIFY wake-ups that procrastinate 3.10 can drop (jobs/worker.py); 0 only to compare, in bench/.
PROCRASTINATE_ON_APP_READY = "jobs.worker.on_app_ready" if env_bool("WORKER_KEEP_NOTIFICATIONS", True) else None
# A job whose worker has sent no heartbeat for this long is requeued by the sweep (runs.tasks).
STALLED_AFTER_SECONDS = env_float("STALLED_AFTER_SECONDS", 30)
# How often the sweep runs: a period in seconds, from which the cron expression of its periodic task is built.
STALLED_SWEEP_SECONDS, STALLED_SWEEP_CRON = schedules.periodic_from_env("STALLED_SWEEP", default_seconds=10)

# Runs submitted together by one web process's requests are written in one statement and one commit, up to this
# many (runs.group_commit); GROUP_COMMIT=0 writes each by itself (to compare, in bench/).
GROUP_COMMIT = env_bool("GROUP_COMMIT", True)
GROUP_COMMIT_MAX_RUNS = env_int("GROUP_COMMIT_MAX_RUNS", 64)

# The engine.
RUN_MAX_ATTEMPTS = env_int("RUN_MAX_ATTEMPTS", 3)
RETRY_BASE_SECONDS = env_float("RETRY_BASE_SECONDS", 1.0)
RETRY_CAP_SECONDS = env_float("RETRY_CAP_SECONDS", 60.0)
TENANT_MAX_RUNNING = env_int("TENANT_MAX_RUNNING", 8)
# A job that finds its run driven by another live job (runs.ownership) tries again after this long.
OWNER_WAIT_SECONDS = env_float("OWNER_WAIT_SECONDS", 2.0)
AGENT_MODEL = env_str("AGENT_MODEL", "runs.llm.model_for_run")
# Without MODEL_BASE_URL, runs.llm.model_for_run answers with this (the demo's scripted fake; none in production).
SCRIPTED_MODEL = env_str("SCRIPTED_MODEL", "demo.model.ScriptedModel" if DEMO_ENABLED else "")
# The tools a step sees as ctx.tools (a factory of (run, step)); unset, ctx.tools is None.
AGENT_TOOLS = env_str("AGENT_TOOLS", "demo.sandbox.Tools" if DEMO_ENABLED else "")
# The modules of those factories, imported by a worker when it starts (procrastinate's import paths, which only a
# worker imports), not by its first step: runs.llm brings the OpenAI client, ~1 s of a core (a first resume's wait).
PROCRASTINATE_IMPORT_PATHS = sorted(
    {path.rpartition(".")[0] for path in (AGENT_MODEL, SCRIPTED_MODEL, AGENT_TOOLS) if path}
)
# Modules that register workflows, imported at start-up (the demo's when it is enabled).
WORKFLOW_MODULES = [*(["demo.workflows"] if DEMO_ENABLED else []), *env_list("WORKFLOW_MODULES")]
# An OpenAI-compatible endpoint for the model; unset, the demo's scripted fake model answers.
MODEL_BASE_URL = env_str("MODEL_BASE_URL")
MODEL_API_KEY = env_str("MODEL_API_KEY")
MODEL_NAME = env_str("MODEL_NAME", "gpt-4o-mini")
# Seconds a model call may take (connect and each read) before it fails as a timeout, which the engine retries.
MODEL_TIMEOUT_SECONDS = env_float("MODEL_TIMEOUT_SECONDS", 60)
# What a model's tokens cost (runs.llm): USD per million (input, output) tokens, by model name as in MODEL_NAME,
# recorded on each step. A model not in the table costs MODEL_DEFAULT_PRICE, which is what every model cost
# before the table existed ($0.0006 per 1K tokens, in and out alike).
MODEL_PRICES = {
    "gpt-4o-mini": ("0.15", "0.60"),
    "gpt-4o": ("2.50", "10.00"),
    "gpt-4.1-mini": ("0.40", "1.60"),
    "gpt-4.1": ("2.00", "8.00"),
    "scripted": ("0.60", "0.60"),  # the demo's scripted fake (demo.model): the figures the demo always showed
}
MODEL_DEFAULT_PRICE = ("0.60", "0.60")
# A budget card may raise a run's cost limit to at most this (approvals.edits).
BUDGET_CEILING = env_decimal("BUDGET_CEILING", "100")
# A budget card may raise an agent's turn limit (runs.agent) to at most this.
AGENT_MAX_TURNS = env_int("AGENT_MAX_TURNS", 100)
# The demo's refund gate approves by itself below this amount.
AUTO_APPROVE_CENTS = env_int("AUTO_APPROVE_CENTS", 2000)
# Shadow mode (runs.workflow, approvals.gates): workflows whose gates make shadow cards and whose effects are
# recorded, never sent, on every channel. A channel can be put in shadow for every workflow in Django admin.
SHADOW_WORKFLOWS = frozenset(env_list("SHADOW_WORKFLOWS"))

# The JSON API refuses bodies larger than this with 413.
API_MAX_BODY_BYTES = env_int("API_MAX_BODY_BYTES", 64 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = max(API_MAX_BODY_BYTES, 2_621_440)  # Django's default for forms

# Signed webhooks (runs.webhooks, Standard Webhooks): each source's active secrets, comma-separated in
# WEBHOOK_SECRET_<SOURCE> (WEBHOOK_SECRET_DEMO for the source `demo`), each `whsec_<base64>` or a plain string
# whose UTF-8 bytes are the key; during a rotation list the new and the old one, and a signature by either is
# accepted. The demo source falls back to `demo-secret` in development only: elsewhere a source without a secret
# is not served (404), never served with a known one.
WEBHOOK_SECRETS = {
    name.removeprefix("WEBHOOK_SECRET_").lower(): webhook_secrets(name, os.environ[name])
    for name in os.environ
    if name.startswith("WEBHOOK_SECRET_") and env_list(name)
}
if DEVELOPMENT:
    WEBHOOK_SECRETS.setdefault("demo", ["demo-secret"])
# A delivery whose webhook-timestamp is further than this from the server's clock, either way, is refused (401).
WEBHOOK_TOLERANCE_SECONDS = env_int("WEBHOOK_TOLERANCE_SECONDS", 300)

# --- Circuit breakers and the token rate limit (runs.breakers, runs.ratelimit) --------------------------------
# A system's breaker (model, payments, email, crm) opens when its last BREAKER_WINDOW_SECONDS hold at least
# BREAKER_MIN_CALLS calls, of which at least BREAKER_FAILURES and a share of BREAKER_FAILURE_RATE failed
# (Retryable: 429, 5xx; timeouts, connection errors). Open, it holds calls back for BREAKER_COOLDOWN_SECONDS
# (steps that need the system wait, re-queued, no attempt counted), then lets one probe through: a success
# closes it, a failure opens it again. A probe not back after BREAKER_PROBE_TIMEOUT_SECONDS is presumed lost.
BREAKERS_ENABLED = env_bool("BREAKERS_ENABLED", True)
BREAKER_WINDOW_SECONDS = env_float("BREAKER_WINDOW_SECONDS", 60)
BREAKER_MIN_CALLS = env_int("BREAKER_MIN_CALLS", 10)
BREAKER_FAILURES = env_int("BREAKER_FAILURES", 5)
BREAKER_FAILURE_RATE = env_float("BREAKER_FAILURE_RATE", 0.5)
BREAKER_COOLDOWN_SECONDS = env_float("BREAKER_COOLDOWN_SECONDS", 30)
BREAKER_PROBE_TIMEOUT_SECONDS = env_float("BREAKER_PROBE_TIMEOUT_SECONDS", 90)
# Model tokens (in + out) a tenant's steps may use in any 60 s; 0: unlimited. A compute step of a tenant over
# it waits (re-queued until the window has room, never dropped, no attempt counted).
TOKEN_RATE_LIMIT_PER_MINUTE = env_int("TOKEN_RATE_LIMIT_PER_MINUTE", 0)
# --- end of circuit breakers and the token rate limit ---------------------------------------------------------

# /readyz reports not ready when no worker heartbeat is newer than this many seconds.
READY_HEARTBEAT_MAX_AGE = env_int("READY_HEARTBEAT_MAX_AGE", 60)
# A worker also writes its heartbeat to this file, database or not, for a container's health command
# (`python -m jobs.healthcheck`, which reads the same variable); empty: no file.
WORKER_HEARTBEAT_FILE = env_str("WORKER_HEARTBEAT_FILE")

# /metrics: a scraper sends "Authorization: Bearer $METRICS_TOKEN"; unset, only loopback clients may scrape.
METRICS_TOKEN = env_str("METRICS_TOKEN")
# A link from a run's trace id to the trace in a tracing UI (docs/observability.md), `{trace_id}` replaced: Jaeger's
# `http://localhost:16686/trace/{trace_id}`, Grafana Tempo's explore URL. Empty: the trace id is shown, not linked.
TRACE_URL_TEMPLATE = env_str("TRACE_URL_TEMPLATE")
# The audit log: with a key, each entry's hash is an HMAC, which someone who can write to the database but does
# not have this key cannot recompute (core.models.AuditEntry). Keep it out of the database and its backups.
AUDIT_HMAC_KEY = env_str("AUDIT_HMAC_KEY")
if 0 < len(AUDIT_HMAC_KEY) < 32:
    raise ImproperlyConfigured("AUDIT_HMAC_KEY must be at least 32 characters (e.g. `openssl rand -hex 32`)")
# Personal data (core/pii.py): AES-256-GCM keys, base64 of 32 bytes each, comma-separated; the first seals new
# subjects' keys, every one opens (rotation: put the new key first, keep the old ones). Outside development a
# workflow or request that marks personal data is refused without one; development has a fixed key of its own.
PII_KEYS = env_str("PII_KEYS")
# How long a job may wait in the queue: the dashboard warns past it and alerts past twice it.
QUEUE_SLA_SECONDS = env_float("QUEUE_SLA_SECONDS", 60)
# The dashboard's reviewer signals (approvals.reviewers): a plain approval of a high-risk card faster than this is
# counted as a rubber stamp, a fatigue signal shown to ops, never enforced.
RUBBER_STAMP_SECONDS = env_int("RUBBER_STAMP_SECONDS", 10)

# Approval SLAs (approvals.sla): the sweep that catches any open card past its deadline (the safety net
# behind each card's own timer job), and the notifier that tells an escalation group about a card.
SLA_SWEEP_SECONDS, SLA_SWEEP_CRON = schedules.periodic_from_env("SLA_SWEEP", default_seconds=30)
# The inbox's counts (approvals.models.InboxCount): how often their rows are folded into one per key.
INBOX_COMPACT_SECONDS, INBOX_COMPACT_CRON = schedules.periodic_from_env("INBOX_COMPACT", default_seconds=30)
NOTIFY_BACKENDS = env_list("NOTIFY_BACKENDS", "email,webhook")  # the webhook only when its URL is set
NOTIFY_WEBHOOK_URL = env_str("NOTIFY_WEBHOOK_URL")
# Signs the notification webhook (Standard Webhooks, like the deliveries we receive): `whsec_<base64>` or a plain
# string; during a rotation "new,old", and each message carries a signature by each.
NOTIFY_WEBHOOK_SECRET = env_secret(
    "NOTIFY_WEBHOOK_SECRET", development_default="notify-secret", development=DEVELOPMENT or not NOTIFY_WEBHOOK_URL
)
webhook_secrets("NOTIFY_WEBHOOK_SECRET", NOTIFY_WEBHOOK_SECRET)
NOTIFY_WEBHOOK_TIMEOUT = env_float("NOTIFY_WEBHOOK_TIMEOUT", 10)
# An approval that nobody consumed within this many seconds of its decision goes stale (external.executions.consume:
# 409 `stale`): the world it was given in may have changed. Never later than the request's own expiry plus this.
APPROVAL_CONSUME_WITHIN = env_int("APPROVAL_CONSUME_WITHIN", 24 * 3600)
# An external agent's `callback_url` (core.outbound_url) may not reach loopback, link-local, multicast or the
# console itself; private addresses only with CALLBACK_ALLOW_PRIVATE, or for the hosts (names or IP literals, as
# the URL writes them) of CALLBACK_ALLOWED_HOSTS, which may also be loopback (a receiver beside the console).
# Each callback is signed with the secret of the asking agent's API token (core.models.ApiToken.callback_secret).
CALLBACK_ALLOW_PRIVATE = env_bool("CALLBACK_ALLOW_PRIVATE", False)
CALLBACK_ALLOWED_HOSTS = env_list("CALLBACK_ALLOWED_HOSTS")
NOTIFY_MAX_ATTEMPTS = env_int("NOTIFY_MAX_ATTEMPTS", 6)
_MAIL_BACKEND = env_str(
    "EMAIL_BACKEND",
    "django.core.mail.backends.console.EmailBackend" if DEVELOPMENT else "django.core.mail.backends.smtp.EmailBackend",
)
# The file backend (EMAIL_BACKEND=django.core.mail.backends.filebased.EmailBackend) writes each email into the
# directory EMAIL_FILE_PATH: without one it could write to, every send would fail long after the start, so the
# start is refused here (and `manage.py check` says the same: console.checks).
# (Not a setting of that name: Django refuses its old email settings beside MAILERS.)
_EMAIL_FILE_PATH = env_str("EMAIL_FILE_PATH")
if _MAIL_BACKEND == mail_config.FILE_BACKEND and (_problem := mail_config.file_path_problem(_EMAIL_FILE_PATH)):
    raise ImproperlyConfigured(
        f"EMAIL_BACKEND is the file backend, which writes each email into EMAIL_FILE_PATH, but {_problem}: set "
        "EMAIL_FILE_PATH to a directory this process may write to, or choose another EMAIL_BACKEND."
    )
if _MAIL_BACKEND.endswith("smtp.EmailBackend"):
    _MAIL_OPTIONS = {"host": env_str("EMAIL_HOST", "localhost"), "port": env_int("EMAIL_PORT", 25)}
elif _MAIL_BACKEND == mail_config.FILE_BACKEND:
    _MAIL_OPTIONS = {"file_path": _EMAIL_FILE_PATH}
else:
    _MAIL_OPTIONS = {}
MAILERS = {"default": {"BACKEND": _MAIL_BACKEND, "OPTIONS": _MAIL_OPTIONS}}
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "hitl-console@localhost")
# Where people reach the console, for the links in messages sent elsewhere: the emails (the card, and its Approve
# and Reject links: approvals.links) and Slack's "Edit in console". Unset outside development: the emails then
# give paths, without a host (Slack needs it: see below).
CONSOLE_URL = env_str("CONSOLE_URL", "http://127.0.0.1:8000" if DEVELOPMENT else "").rstrip("/")

# Decisions from Slack (slackapp; docs/RUNBOOK.md "Slack"): cards are posted with the bot token (scope chat:write)
# to their channel's SlackRoute or SLACK_DEFAULT_CHANNEL, and clicks on POST /api/slack/interactions are verified
# with the signing secret. Without a token nothing is posted; without a secret the endpoint answers 404.
SLACK_BOT_TOKEN = env_str("SLACK_BOT_TOKEN")
SLACK_SIGNING_SECRET = env_str("SLACK_SIGNING_SECRET")
if SLACK_BOT_TOKEN and not SLACK_SIGNING_SECRET:
    raise ImproperlyConfigured(
        "SLACK_BOT_TOKEN is set without SLACK_SIGNING_SECRET: the buttons it posts would not work"
    )
if SLACK_BOT_TOKEN and not CONSOLE_URL:
    raise ImproperlyConfigured("SLACK_BOT_TOKEN is set without CONSOLE_URL: the cards' links to the console need it")
SLACK_DEFAULT_CHANNEL = env_str("SLACK_DEFAULT_CHANNEL")
SLACK_API_URL = env_str("SLACK_API_URL", "https://slack.com/api/")  # tests point it at a fake of the Web API
# A click's ephemeral answer is posted to its response_url only on Slack's own host.
SLACK_RESPONSE_URL_PREFIX = env_str("SLACK_RESPONSE_URL_PREFIX", "https://hooks.slack.com/")

# --- Security headers, HTTPS and login throttling ----------------------------------------------------------
# (Kept together; docs/deploy.md "Running in production".) Outside development the console is served over HTTPS only.
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEVELOPMENT)
# Probes and scrapers speak plain HTTP to the process itself, from inside the network.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEVELOPMENT else 365 * 24 * 3600)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
# Behind a proxy that terminates TLS: the header it sets and the value meaning HTTPS, as "X-Forwarded-Proto=https".
# Only set it when the proxy always sets (or strips) that header: a client could send it otherwise.
if _proxy_ssl_header := env_str("SECURE_PROXY_SSL_HEADER"):
    _name, _, _value = (part.strip() for part in _proxy_ssl_header.partition("="))
    if not (_name and _value):
        raise ImproperlyConfigured(
            f"SECURE_PROXY_SSL_HEADER must look like X-Forwarded-Proto=https, got {_proxy_ssl_header!r}"
        )
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + _name.upper().replace("-", "_"), _value)
# Every page's scripts and styles come from our own static files (htmx, console.js, ninja's Swagger UI): no
# inline script or handler, no eval (so no hx-on attributes), no CDN. Enforced outside development; reported
# only (browser console) in development, so a new inline handler shows up before it breaks a deployment.
_CSP_POLICY = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF],
    "style-src": [CSP.SELF],
    "img-src": [CSP.SELF, "data:"],  # Swagger UI's icons are data: URLs in its stylesheet
    "font-src": [CSP.SELF],
    "connect-src": [CSP.SELF],
    "object-src": [CSP.NONE],
    "base-uri": [CSP.NONE],
    "form-action": [CSP.SELF],
    "frame-ancestors": [CSP.NONE],
}
SECURE_CSP = {} if DEVELOPMENT else _CSP_POLICY
SECURE_CSP_REPORT_ONLY = _CSP_POLICY if DEVELOPMENT else {}
# Login throttling (django-axes, database handler: counts are shared by every web process). After
# LOGIN_FAILURE_LIMIT failed logins from one IP address, or for one username, within LOGIN_LOCKOUT_SECONDS,
# further attempts get 429 without their password being checked, until that long after the last failure.
# A successful login resets its counts. Behind a proxy, uvicorn takes the client's address from
# X-Forwarded-For only when the proxy is in FORWARDED_ALLOW_IPS (uvicorn's default: 127.0.0.1).
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(seconds=env_int("LOGIN_LOCKOUT_SECONDS", 15 * 60))
AXES_LOCKOUT_PARAMETERS = ["ip_address", "username"]  # each on its own, not the pair
AXES_RESET_ON_SUCCESS = True
AXES_HTTP_RESPONSE_CODE = 429
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
AXES_DISABLE_ACCESS_LOG = True  # successful logins are not axes' business; its table would grow for ever
AXES_VERBOSE = False
# The demo's fault injection (`faults` in a refund's input: 429s, timeouts, slow steps, a worker made to hang for
# days) is honoured in development only (demo.sandbox), or where DEMO_FAULTS_ENABLED=1 says so: a test stack of
# the production shape (tests/deploy), never a deployment that serves anyone.
DEMO_FAULTS_ENABLED = env_bool("DEMO_FAULTS_ENABLED", DEVELOPMENT)
# --- end of security headers, HTTPS and login throttling ----------------------------------------------------

# Demo logins: demo_setup gives the demo users this password; outside development it refuses the default.
DEMO_PASSWORD = env_str("DEMO_PASSWORD", "demo")

LOG_LEVEL = env_str("LOG_LEVEL", "INFO")
LOGGING = logs.django_logging(LOG_LEVEL)
logs.configure_structlog()

# Every periodic schedule (X_CRON) must run at its period (X_SECONDS), checked with croniter before start-up.
schedules.check_settings(globals())
