from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone


def _heartbeat(age: timedelta) -> None:
    # procrastinate's Django models are read-only; the worker writes this table with SQL, and so do we.
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO procrastinate_workers (last_heartbeat) VALUES (%s)", [timezone.now() - age])


def test_healthz_answers_without_login(client, db):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_is_unavailable_without_a_worker(client, db):
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["problems"] == ["no worker heartbeat in the last 60 s"]


def test_readyz_is_unavailable_with_a_stale_heartbeat(client, db):
    _heartbeat(timedelta(minutes=5))
    assert client.get("/readyz").status_code == 503


def test_readyz_is_ready_with_a_fresh_heartbeat(client, db):
    _heartbeat(timedelta(seconds=2))
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


READYZ_WITHOUT_DATABASE = """
import django, json
django.setup()
from django.test.utils import setup_test_environment
setup_test_environment()
from django.test import Client
response = Client().get("/readyz")
print(json.dumps({"status": response.status_code, "body": response.json()}))
"""


def test_readyz_reports_an_unreachable_database():
    env = {
        **os.environ,
        "DATABASE_URL": "postgres://postgres@127.0.0.1:1/nowhere?connect_timeout=2",
        "DJANGO_SETTINGS_MODULE": "console.settings",
    }
    proc = subprocess.run(
        [sys.executable, "-c", READYZ_WITHOUT_DATABASE],
        cwd=settings.BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == 503
    assert result["body"]["problems"] == ["database unreachable: OperationalError"]


@pytest.mark.parametrize("url", ["/healthz", "/readyz"])
def test_health_endpoints_refuse_post(client, db, url):
    assert client.post(url).status_code == 405


@pytest.mark.parametrize("url", ["/healthz", "/readyz"])
def test_probes_answer_whatever_host_they_name(client, db, settings, url):
    """A container's health check and a load balancer's probe name the replica's own address, which ALLOWED_HOSTS
    does not list (compose.yaml's HAProxy, Kubernetes): they are answered; any other page is refused as before."""
    settings.ALLOWED_HOSTS = ["console.example.com"]
    assert client.get(url, HTTP_HOST="10.89.0.15:8000").status_code != 400
    assert client.get("/login/", HTTP_HOST="10.89.0.15:8000").status_code == 400
    assert client.get(url + "/", HTTP_HOST="10.89.0.15:8000").status_code == 400
