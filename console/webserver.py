"""The production web server: uvicorn serving console.asgi (sync views as WSGI in a pool of WEB_THREADS threads per
process, async views such as the approval-request long-poll as ASGI), logging through Django's JSON LOGGING.

`python -m console.webserver --host 127.0.0.1 --port 8000 [--workers N]`

Database connections come from a pool per process (DATABASE_POOL, on by default here; off for workers), one per
thread. SIGTERM or SIGINT: uvicorn stops accepting, lets the requests in flight finish (their threads included),
then exits. The choice of server, measured against gunicorn gthread and granian: docs/BENCHMARKS.md, enqueue.
"""

from __future__ import annotations

import argparse
import os
import socket

import uvicorn
from uvicorn.supervisors import Multiprocess


def use_pool_by_default() -> None:
    """The web server takes its database connections from a pool (console/settings.py, DATABASE_POOL) unless
    told otherwise: a new PostgreSQL connection per request is most of an API call's cost (docs/BENCHMARKS.md,
    enqueue). Set before Django loads; uvicorn's worker processes inherit the environment. Kept connections
    (DATABASE_CONN_MAX_AGE > 0) and a pool exclude each other: an explicit CONN_MAX_AGE wins."""
    if "DATABASE_POOL" not in os.environ and os.environ.get("DATABASE_CONN_MAX_AGE", "0").strip() in ("", "0"):
        os.environ["DATABASE_POOL"] = "1"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    use_pool_by_default()
    config = uvicorn.Config(
        "console.asgi:application",
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_config=None,  # Django's LOGGING (set up when the app loads) renders uvicorn's records as JSON too
        access_log=False,  # console.middleware logs one line per request, with its request id
        lifespan="off",
        server_header=False,  # no "server: uvicorn" banner naming what to attack
        # X-Forwarded-For/-Proto are believed from FORWARDED_ALLOW_IPS only (uvicorn reads it; default 127.0.0.1,::1),
        # so a client cannot pick the address that login throttling counts against.
    )
    if config.workers == 1:
        uvicorn.Server(config).run()
        return
    sock = config.bind_socket()
    # uvicorn's worker processes rebuild the listening socket without its protocol number, so asyncio does not
    # set TCP_NODELAY on the connections they accept, and every request on a kept-alive connection waits ~40 ms
    # (Nagle's algorithm against delayed ACKs). On Linux, accepted sockets inherit it from the listening one.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    Multiprocess(config, sockets=[sock]).run()


if __name__ == "__main__":
    main()
