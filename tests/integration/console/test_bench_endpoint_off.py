"""`make bench`'s baseline endpoint (console/bench_views.py) exists only with BENCH_ENDPOINTS=1, in development:
never by default, never in production."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.conf import settings

RESOLVES = (
    "import django; django.setup(); from django.urls import resolve, Resolver404\n"
    "try:\n    resolve('/bench/insert'); print('served')\nexcept Resolver404:\n    print('absent')\n"
)


def _bench_endpoint(env: dict) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("BENCH_ENDPOINTS", "CONSOLE_ENV")}
    done = subprocess.run(
        [sys.executable, "-c", RESOLVES],
        cwd=settings.BASE_DIR,
        env={**clean, "DJANGO_SETTINGS_MODULE": "console.settings", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_off_by_default(client, db):
    assert client.post("/bench/insert", data=b"{}", content_type="application/json").status_code == 404


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "absent"),
        ({"BENCH_ENDPOINTS": "0"}, "absent"),
        ({"BENCH_ENDPOINTS": "1"}, "served"),
        ({"BENCH_ENDPOINTS": "1", "CONSOLE_ENV": "production", "SECRET_KEY": "x" * 50}, "absent"),
    ],
)
def test_only_when_asked_and_never_in_production(env, expected):
    assert _bench_endpoint(env) == expected
