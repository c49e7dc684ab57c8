"""The application the production server (uvicorn, console/webserver.py) serves: Django as WSGI in a fixed pool of
threads for every sync view, Django's ASGI handler only for async views (none today), behind the body limit
(console/body_limit.py). The approval-request long-poll waits at this edge, in the event loop, between its
passes through Django's WSGI side (console/long_poll.py).

Why not Django's ASGI handler for everything: it runs a sync view and the sync middlewares in a thread of their
own per request and crosses from the event loop to a thread and back several times per request (the one-INSERT
baseline cost 4.4-5.1 ms of web-process CPU that way against 1.3-1.7 under gunicorn, before issue 21's trims of
the request path; docs/BENCHMARKS.md, enqueue). Why not a WSGI server alone (gunicorn gthread, granian): a
long-poll would hold one of its threads for up to a minute; here it holds none. Its price: ~0.5 ms of CPU per
request more than their own threads (the loop-to-thread hop), measured in the same runs.

The WSGI side (a2wsgi's WSGIMiddleware): WEB_THREADS threads per process (default 8, as the database pool's
DATABASE_POOL_MAX_SIZE: one connection per thread). The body is read whole in the event loop before the request
goes to a thread (Hybrid): a view never sees a truncated body, nor runs for a client gone before its body came.
"""

from __future__ import annotations

import functools
import os
import warnings

from a2wsgi import WSGIMiddleware
from asgiref.sync import iscoroutinefunction
from django.core.asgi import get_asgi_application
from django.core.wsgi import get_wsgi_application
from django.urls import Resolver404, resolve

from console import long_poll
from console.body_limit import BodyLimit, WsgiBodyLimit
from console.env import env_int

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
# WhiteNoise hands Django's ASGI handler a file iterator, which Django reads in a thread and warns about on
# every static file: the price of serving hashed, compressed, far-future-cached files without a CDN.
warnings.filterwarnings("ignore", message="StreamingHttpResponse must consume synchronous iterators")


@functools.lru_cache(maxsize=4096)
def is_async_view(path: str) -> bool:
    """Whether the view of `path` is async (served by Django's ASGI handler). Cached: an API path repeats."""
    try:
        return iscoroutinefunction(resolve(path).func)
    except Resolver404:
        return False


class Hybrid:
    def __init__(self, wsgi, asgi):
        self.wsgi, self.asgi = wsgi, asgi

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_async_view(scope["path"]):
            return await self.asgi(scope, receive, send)
        # The body first, here in the event loop (its size is bounded: BodyLimit, outside), then the request's
        # thread: a client gone before its body arrived whole is dropped without a view running (as Django's ASGI
        # handler drops it), and the thread does not come back to the loop for each part of the body.
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None  # if BodyLimit cut the body off, it answers 413
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        if waiting := long_poll.long_poll(scope):
            # The approval-request long-poll waits here, in the event loop, between its passes through Django.
            return await long_poll.serve(self.wsgi, scope, body, receive, send, *waiting)

        async def replay():
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        return await self.wsgi(scope, replay, send)


def build():
    asgi = get_asgi_application()  # sets Django up
    # The WSGI body limit inside: it reads a chunked body (at most the limit + 1 bytes) and hands Django its
    # length, which a2wsgi, like Django's WSGI handler, would otherwise not know (so Django would read nothing).
    wsgi = WSGIMiddleware(WsgiBodyLimit(get_wsgi_application()), workers=env_int("WEB_THREADS", 8))
    # The body limit outside: a declared length over the limit is refused before a byte is read.
    return BodyLimit(Hybrid(wsgi, asgi))


application = build()
