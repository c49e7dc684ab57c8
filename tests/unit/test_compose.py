"""compose.yaml, .env.example, deploy/rollout.sh and the Dockerfile agree on what a deployment depends on: the
workers' stop grace period covers their own graceful timeout plus a margin, the image runs as no one privileged
and holds no secret, every process runs the image's commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MARGIN = 10  # seconds a worker needs past its graceful timeout to close its connections and exit


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _env_example() -> dict[str, str]:
    lines = (ROOT / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def _default(expression: str) -> str:
    """`${NAME:-default}` -> default."""
    match = re.fullmatch(r"\$\{(\w+):-([^}]*)\}", expression)
    assert match, expression
    return match.group(2)


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)s?", duration)
    assert match, f"a duration in seconds, like 30s: {duration!r}"
    return float(match.group(1))


def _settings_default(name: str) -> float:
    source = (ROOT / "console" / "settings.py").read_text()
    return float(re.search(rf'env_float\("{name}", (\d+(?:\.\d+)?)\)', source).group(1))


def test_the_workers_stop_grace_period_covers_their_graceful_timeout_and_a_margin():
    compose = _compose()
    worker = compose["services"]["worker"]
    timeout = float(_default(compose["x-app"]["environment"]["WORKER_SHUTDOWN_GRACEFUL_TIMEOUT"]))
    assert timeout == _settings_default("WORKER_SHUTDOWN_GRACEFUL_TIMEOUT")
    assert _seconds(_default(worker["stop_grace_period"])) >= timeout + MARGIN
    example = _env_example()
    assert _seconds(example["WORKER_STOP_GRACE_PERIOD"]) >= float(example["WORKER_SHUTDOWN_GRACEFUL_TIMEOUT"]) + MARGIN
    # deploy/rollout.sh stops a worker with compose.yaml's period.
    rollout = (ROOT / "deploy" / "rollout.sh").read_text()
    assert f"WORKER_GRACE=${{WORKER_STOP_GRACE_PERIOD:-{_default(worker['stop_grace_period'])}}}" in rollout


def test_a_web_replica_outlives_the_longest_long_poll():
    compose = _compose()
    source = (ROOT / "external" / "api.py").read_text()
    max_wait = int(re.search(r"^MAX_WAIT = (\d+)", source, re.M).group(1))
    grace = _seconds(compose["services"]["web"]["stop_grace_period"])
    assert grace >= max_wait + MARGIN
    assert f"WEB_GRACE={grace:g}" in (ROOT / "deploy" / "rollout.sh").read_text()


def test_every_process_runs_the_image_with_its_command():
    services = _compose()["services"]
    image = "${APP_IMAGE:-hitl-console:latest}"
    assert {name for name, service in services.items() if service.get("image") == image} == {
        "migrate",
        "web",
        "worker",
    }
    commands = {name: " ".join(services[name]["command"]) for name in ("migrate", "web", "worker")}
    assert "manage.py migrate --noinput" in commands["migrate"]
    assert "exec python -m console.webserver --host 0.0.0.0 --port 8000" in commands["web"]
    assert "exec python manage.py worker" in commands["worker"]
    # The new release's code waits for its own migrations.
    assert all("wait_for_database --migrated" in commands[name] for name in ("web", "worker"))
    assert services["worker"]["healthcheck"]["test"] == ["CMD", "python", "-m", "jobs.healthcheck"]
    assert services["web"]["healthcheck"]["test"] == ["CMD", "python", "-m", "console.healthcheck"]
    assert services["web"]["deploy"] == {"mode": "replicated", "replicas": 2}
    assert services["worker"]["deploy"] == {"mode": "replicated", "replicas": 2}


def test_the_web_tier_uses_the_transaction_pool_and_workers_the_session_pool():
    environment = _compose()["x-app"]["environment"]
    assert environment["DATABASE_URL"].endswith("@pgbouncer:6432/${POSTGRES_DB:-console}_tx")
    assert environment["DATABASE_TRANSACTION_POOL"] == "1"
    assert environment["WORKER_DATABASE_URL"].endswith("@pgbouncer:6432/${POSTGRES_DB:-console}")
    entrypoint = (ROOT / "deploy" / "pgbouncer" / "entrypoint.sh").read_text()
    assert re.search(r"^\$\{DB_NAME\}_tx = .* pool_mode=transaction", entrypoint, re.M)
    assert re.search(r"^\$\{DB_NAME\} = .* pool_mode=session", entrypoint, re.M)


def test_the_image_runs_unprivileged_and_holds_no_secret():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=docker\.io/library/python:3\.12-slim$", dockerfile, re.M)
    users = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r'^HEALTHCHECK .*\n\s+CMD \["python", "-m", "console.healthcheck"\]$', dockerfile, re.M)
    # ENV and ARG name no secret; the one secret-like value (collectstatic's) lives in one RUN's environment only.
    declared = " ".join(re.findall(r"^(?:ENV|ARG) .*(?:\n\s+.*)*", dockerfile, re.M))
    assert not re.search(r"SECRET|PASSWORD|TOKEN|_KEY\b", declared), declared
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert ".env" in ignored and ".git" in ignored


@pytest.mark.parametrize("name", ["POSTGRES_PASSWORD", "SECRET_KEY"])
def test_the_stack_refuses_to_start_without_its_secrets(name):
    """compose.yaml names no default for them: `${NAME:?...}` stops `compose up` with the message."""
    text = (ROOT / "compose.yaml").read_text()
    assert re.search(rf"\$\{{{name}:\?set {name} in \.env", text)
    assert not re.search(rf"\$\{{{name}:-", text)
