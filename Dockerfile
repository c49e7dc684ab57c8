# One image for every process of a deployment: the web server, the workers and the migrations (docs/deploy.md).
# The command differs: `python -m console.webserver ...` (the default), `python manage.py worker`,
# `python manage.py migrate`. Nothing secret is in it: every setting comes from the environment at run time.
#
#   docker build -t hitl-console .          (or podman build --format docker, which keeps the HEALTHCHECK)
#
# BASE_IMAGE is any image with Python >= 3.12 and its venv module as `python3`: the official python:3.12-slim by
# default; tests/deploy builds one from Debian's packages where no registry is reachable.
ARG BASE_IMAGE=docker.io/library/python:3.12-slim

# --- build: the virtualenv, the front-end files, collectstatic ---------------------------------------------------
FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv
# The dependencies first (pyproject.toml alone), so that a change of code does not reinstall them. Not the
# `embedded` extra: a container always has DATABASE_URL.
COPY pyproject.toml README.md /src/
# Then what the runtime needs nothing of: pip itself, and translations (USE_I18N is off; the locale folders'
# formats stay).
RUN /opt/venv/bin/pip install --quiet /src && rm -rf /src \
 && /opt/venv/bin/pip uninstall --quiet --yes pip \
 && find /opt/venv -type d -name LC_MESSAGES -prune -exec rm -rf {} +
WORKDIR /app
COPY . .
# htmx from the npm registry, checked against package-lock.json (no Node.js needed; node_modules/ stays, as
# STATICFILES_DIRS names it), then the static files, collected with throwaway settings that reach no database.
RUN /opt/venv/bin/python deploy/assets.py \
 && CONSOLE_ENV=production SECRET_KEY=collectstatic-only DATABASE_URL=postgres://build@127.0.0.1:1/none \
    /opt/venv/bin/python manage.py collectstatic --noinput --verbosity 0 \
 && rm deploy/assets.py \
 && /opt/venv/bin/python -m compileall -q /app >/dev/null

# --- runtime ------------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
ARG VCS_REF=unknown
LABEL org.opencontainers.image.title="hitl-console" \
      org.opencontainers.image.description="A human-in-the-loop approval console for AI agents" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}"
RUN (getent group console || groupadd --system --gid 10001 console) \
 && (id console || useradd --system --uid 10001 --gid console --home-dir /app --no-create-home console)
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=root:root /app /app
WORKDIR /app
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CONSOLE_ENV=production \
    WORKER_HEARTBEAT_FILE=/tmp/worker-heartbeat
# The code is root's and read-only to the process; it writes nowhere but /tmp.
USER console:console
EXPOSE 8000
# Liveness of the web server. A worker's container uses `python -m jobs.healthcheck` instead (compose.yaml).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-m", "console.healthcheck"]
# SIGTERM: the web server stops accepting and finishes its requests; a worker finishes its steps within
# WORKER_SHUTDOWN_GRACEFUL_TIMEOUT (the container's stop grace period must be longer: docs/deploy.md).
STOPSIGNAL SIGTERM
CMD ["python", "-m", "console.webserver", "--host", "0.0.0.0", "--port", "8000", "--workers", "2"]
