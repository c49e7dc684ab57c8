"""Bench-only endpoints: the baselines of `make bench` (bench/enqueue.py), served by the production server itself.

Wired in console/urls.py only when BENCH_ENDPOINTS=1 and CONSOLE_ENV is development; never in production
(tests/integration/console/test_bench_endpoint_off.py).

`POST /bench/insert`: the cheapest durable request this server can answer, the baseline that `POST /api/runs` is
compared with: the same HTTP server, processes, middleware and database connections (the pool), then one INSERT
of the raw body in autocommit and a small JSON answer. No authentication, no validation, no job.
"""

from __future__ import annotations

import threading

from django.db import connection, transaction
from django.http import JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

TABLE = "bench_insert_baseline"
_created = threading.Event()


def _ensure_table() -> None:
    # Once per process; the transaction-level advisory lock keeps two processes' CREATEs from racing.
    if not _created.is_set():
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [TABLE])
            cursor.execute(
                f"CREATE TABLE IF NOT EXISTS {TABLE}"
                " (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now(), body text NOT NULL)"
            )
        _created.set()


@csrf_exempt
@require_POST
def insert(request):
    _ensure_table()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TABLE} (body) VALUES (%s) RETURNING id", [request.body.decode("utf-8", "replace")]
        )
        (row_id,) = cursor.fetchone()
    return JsonResponse({"id": row_id}, status=202)


insert.login_required = False

urlpatterns = [path("bench/insert", insert, name="bench-insert")]
