"""The request body limit, enforced while the body arrives (an ASGI wrapper around Django, console/asgi.py).

Django's ASGI handler reads the whole body into a temporary file before any middleware runs, so a middleware
that checks the size sees a 20 GB upload only once it is on disk. This wrapper counts the bytes of each
`http.request` message instead: a declared Content-Length over the limit is answered 413 before a byte is read,
and a body without one (chunked) is cut off as soon as the bytes received pass the limit. It then tells Django
the client went away (Django drops the request without a response) and answers 413 itself, with
`Connection: close` so that the server drops the rest of the upload instead of reading it.

Limits: API_MAX_BODY_BYTES under /api/; DATA_UPLOAD_MAX_MEMORY_SIZE elsewhere (the console's forms have no file
uploads, so the form limit bounds the whole body). console.middleware.ApiBodyLimitMiddleware keeps the same
limit for callers that do not come through ASGI (Django's test client).
"""

from __future__ import annotations

import json

from django.conf import settings


def limit_for(path: str) -> int | None:
    if path.startswith("/api/"):
        return settings.API_MAX_BODY_BYTES
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE  # None: no limit


def _declared_length(scope) -> int | None | str:
    """The Content-Length header as a number, None when absent, or "invalid"."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return "invalid"
            return length if length >= 0 else "invalid"
    return None


async def _answer(send, scope, status: int, error: str, detail: str) -> None:
    if scope["path"].startswith("/api/"):
        body = json.dumps({"error": error, "detail": detail}).encode()
        content_type = b"application/json"
    else:
        body = detail.encode()
        content_type = b"text/plain; charset=utf-8"
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: 413 for a request body over the limit of its path, without buffering it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = limit_for(scope["path"])
        if limit is None:
            return await self.app(scope, receive, send)
        too_large = f"The body is larger than {limit} bytes."
        declared = _declared_length(scope)
        if declared == "invalid":
            return await _answer(send, scope, 400, "bad_request", "Content-Length is not a number.")
        if declared is not None and declared > limit:
            return await _answer(send, scope, 413, "too_large", too_large)

        received = 0
        cut_off = False
        response_started = False

        async def counting_receive():
            nonlocal received, cut_off
            if cut_off:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Django drops a request whose client disconnected while it read the body.
                    cut_off = True
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message):
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        await self.app(scope, counting_receive, tracking_send)
        if cut_off and not response_started:
            await _answer(send, scope, 413, "too_large", too_large)
