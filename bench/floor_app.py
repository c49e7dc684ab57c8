"""The HTTP floor of `make bench`'s enqueue figures: a bare ASGI app (no framework) that answers `POST /insert` with
one INSERT through a psycopg pool, served by uvicorn with TCP_NODELAY. Nothing a web framework could do on this
machine for one durable INSERT is cheaper; `POST /api/runs` is reported as a share of it (bench/enqueue.py).

    .venv/bin/python bench/floor_app.py --dsn postgres://postgres@127.0.0.1:5432/DB --port 8001 [--workers 2]

`GET /healthz` answers 200 (the harness waits for it). Every process has its own pool (FLOOR_POOL_SIZE, default
8, as the production server's DATABASE_POOL_MAX_SIZE); the table `bench_floor_insert` is created if missing.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import psycopg
import uvicorn
from psycopg_pool import AsyncConnectionPool
from uvicorn.supervisors import Multiprocess

TABLE = "bench_floor_insert"
CREATE = (
    f"CREATE TABLE IF NOT EXISTS {TABLE}"
    " (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now(), body text NOT NULL)"
)
INSERT = f"INSERT INTO {TABLE} (body) VALUES (%s) RETURNING id"

_pool: AsyncConnectionPool | None = None


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _answer(send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def app(scope, receive, send):
    global _pool
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                size = int(os.environ.get("FLOOR_POOL_SIZE", "8"))
                _pool = AsyncConnectionPool(os.environ["FLOOR_DSN"], min_size=size, max_size=size, open=False)
                await _pool.open(wait=True)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await _pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"] == "/healthz":
        return await _answer(send, 200, b'{"status": "ok"}')
    if scope["path"] != "/insert" or scope["method"] != "POST":
        return await _answer(send, 404, b'{"error": "not_found"}')
    body = await _read_body(receive)
    async with _pool.connection() as conn:
        cursor = await conn.execute(INSERT, [body.decode("utf-8", "replace")])
        (row_id,) = await cursor.fetchone()
    await _answer(send, 202, b'{"id": %d}' % row_id)


async def django_asgi(scope, receive, send):
    """Django's ASGI handler for every view, behind the body limit: the production server before issue 21
    (bench/enqueue.py --compare uvicorn-asgi)."""
    global _django_asgi
    if _django_asgi is None:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
        from django.core.asgi import get_asgi_application

        from console.body_limit import BodyLimit

        _django_asgi = BodyLimit(get_asgi_application())
    return await _django_asgi(scope, receive, send)


_django_asgi = None


def serve(app_path: str, port: int, workers: int, **options) -> None:
    """uvicorn with TCP_NODELAY on every accepted connection, one process or `workers` (the production server's
    trick before issue 21: uvicorn's worker processes rebuild the listening socket without its protocol number,
    so asyncio does not set it; on Linux an accepted socket inherits it from the listening one)."""
    config = uvicorn.Config(
        app_path, host="127.0.0.1", port=port, workers=workers, log_config=None, access_log=False, **options
    )
    if workers == 1:
        uvicorn.Server(config).run()
        return
    sock = config.bind_socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    Multiprocess(config, sockets=[sock]).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="the floor's database (required for the floor app)")
    parser.add_argument(
        "--app",
        default="bench.floor_app:app",
        help="another ASGI app to serve the same way (bench/enqueue.py --compare)",
    )
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench.floor_app`, in every process
    if args.app != "bench.floor_app:app":
        serve(args.app, args.port, args.workers, lifespan="off", server_header=False)
        return
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(CREATE)
    os.environ["FLOOR_DSN"] = args.dsn
    serve(args.app, args.port, args.workers, lifespan="on")


if __name__ == "__main__":
    main()
