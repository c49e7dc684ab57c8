"""The request body limit, enforced while the body arrives: an ASGI wrapper around the production server's app
(console/asgi.py) and a WSGI one around Django's WSGI handler (its WSGI side, and console/wsgi.py).

Django's handlers read the whole body (ASGI: into a temporary file before any middleware runs) or only a declared
Content-Length (WSGI), so a middleware that checks the size sees a 20 GB upload only once it is on disk. The ASGI
wrapper, outermost, counts the bytes of each `http.request` message instead: a declared Content-Length over the
limit is answered 413 before a byte is read, and a body without one (chunked) is cut off as soon as the bytes
received pass the limit. It then tells the app the client went away (Django's ASGI handler drops the request
without a response; the WSGI side's read fails, console.asgi) and answers 413 itself, with `Connection: close` so
that the server drops the rest of the upload instead of reading it.

The WSGI wrapper (inside console.asgi's WSGI side, and console/wsgi.py for any WSGI server) does the same for a
WSGI environ: 413 for a declared length over the limit, unread; a chunked body read here, at most limit + 1
bytes, then 413 or handed to Django with its length (Django's WSGI handler reads only a declared Content-Length).

Limits: API_MAX_BODY_BYTES under /api/; DATA_UPLOAD_MAX_MEMORY_SIZE elsewhere (the console's forms have no file
uploads, so the form limit bounds the whole body). console.middleware.ApiBodyLimitMiddleware keeps the same
limit for callers that do not come through ASGI (Django's test client).
"""

from __future__ import annotations

import io
import json

from django.conf import settings


def limit_for(path: str) -> int | None:
    if path.startswith("/api/"):
        return settings.API_MAX_BODY_BYTES
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE  # None: no limit


def _parse_length(value: bytes | str) -> int | str:
    try:
        length = int(value)
    except ValueError:
        return "invalid"
    return length if length >= 0 else "invalid"


def _declared_length(scope) -> int | None | str:
    """The Content-Length header as a number, None when absent, or "invalid"."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return _parse_length(value)
    return None


def _refusal(path: str, error: str, detail: str) -> tuple[bytes, bytes]:
    """The body and content type of a refusal: JSON under /api/, plain text elsewhere."""
    if path.startswith("/api/"):
        return json.dumps({"error": error, "detail": detail}).encode(), b"application/json"
    return detail.encode(), b"text/plain; charset=utf-8"


async def _answer(send, scope, status: int, error: str, detail: str) -> None:
    body, content_type = _refusal(scope["path"], error, detail)
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


_REASONS = {400: "400 Bad Request", 413: "413 Content Too Large"}


class WsgiBodyLimit:
    """WSGI middleware: 413 for a request body over the limit of its path, reading at most limit + 1 bytes."""

    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        limit = limit_for(path)
        if limit is None:
            return self.app(environ, start_response)
        declared = environ.get("CONTENT_LENGTH") or None
        length = None if declared is None else _parse_length(declared)
        if length == "invalid":
            return _wsgi_answer(start_response, path, 400, "bad_request", "Content-Length is not a number.")
        too_large = f"The body is larger than {limit} bytes."
        if length is not None and length > limit:
            return _wsgi_answer(start_response, path, 413, "too_large", too_large)
        if length is None and "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower():
            body = environ["wsgi.input"].read(limit + 1)
            if len(body) > limit:
                return _wsgi_answer(start_response, path, 413, "too_large", too_large)
            environ["wsgi.input"] = io.BytesIO(body)
            environ["CONTENT_LENGTH"] = str(len(body))
        return self.app(environ, start_response)


def _wsgi_answer(start_response, path: str, status: int, error: str, detail: str) -> list[bytes]:
    body, content_type = _refusal(path, error, detail)
    start_response(_REASONS[status], [("Content-Type", content_type.decode()), ("Content-Length", str(len(body)))])
    return [body]
