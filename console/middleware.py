from __future__ import annotations

import re
import time
import uuid

import structlog
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse

log = structlog.get_logger("console.request")

# A caller's request id is kept only when it looks like one; anything else is replaced.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class RequestIdMiddleware:
    """Gives every request an id (the caller's X-Request-ID or a new one), binds it to every log line written
    while the request is handled, echoes it in the response, and logs one line per request."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        incoming = request.headers.get("X-Request-ID", "")
        request_id = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        request.request_id = request_id
        started = time.perf_counter()
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            response = self.get_response(request)
            log.info(
                "request",
                method=request.method,
                path=request.path,
                status=response.status_code,
                latency_ms=round((time.perf_counter() - started) * 1000, 1),
            )
        response["X-Request-ID"] = request_id
        return response


class ApiBodyLimitMiddleware:
    """Refuses API requests whose declared body is larger than API_MAX_BODY_BYTES with 413, before anything
    reads the body. A body without a Content-Length (`Transfer-Encoding: chunked`, which uvicorn passes on) is
    measured once read: Django reads at most DATA_UPLOAD_MAX_MEMORY_SIZE of it."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path.startswith("/api/"):
            try:
                length = int(request.META.get("CONTENT_LENGTH") or 0)
            except ValueError:
                return JsonResponse({"error": "bad_request", "detail": "Content-Length is not a number."}, status=400)
            limit = settings.API_MAX_BODY_BYTES
            if not length and request.META.get("HTTP_TRANSFER_ENCODING"):
                try:
                    length = len(request.body)
                except RequestDataTooBig:
                    length = limit + 1
            if length > limit:
                return JsonResponse(
                    {"error": "too_large", "detail": f"The body is larger than {limit} bytes."}, status=413
                )
        return self.get_response(request)
