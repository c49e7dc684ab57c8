"""The console's middleware: request ids and the request log, the API's body limit, input PostgreSQL cannot store,
database outages, personal data masked in every page and API answer (PersonalDataMiddleware), access refusals as
404 and 403 pages, the probes' exemption from Host checks, and the
middleware a token (API) request skips (`browser_only`)."""

from __future__ import annotations

import functools
import json
import re
import sys
import time
import uuid

import pydantic
import structlog
from django.conf import settings
from django.contrib.auth.middleware import AuthenticationMiddleware, LoginRequiredMiddleware
from django.contrib.messages.middleware import MessageMiddleware
from django.contrib.sessions.middleware import SessionMiddleware
from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.core.handlers.exception import response_for_exception
from django.core.signals import got_request_exception
from django.db import DataError, InterfaceError, OperationalError, connection
from django.http import Http404, HttpResponse, JsonResponse
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.common import CommonMiddleware as DjangoCommonMiddleware
from django.middleware.csp import ContentSecurityPolicyMiddleware
from django.middleware.csrf import CsrfViewMiddleware
from django.utils.html import escape
from django_htmx.middleware import HtmxMiddleware
from whitenoise.middleware import WhiteNoiseMiddleware

from core import pii
from core.access import Denied
from core.safe_input import unsafe_char
from jobs.worker import is_connection_error

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
    """Refuses API requests whose declared body is larger than API_MAX_BODY_BYTES with 413, before a view reads
    the body. Under ASGI (the production server) console.body_limit has already refused such a body while it
    arrived, since Django's handler reads the whole body before any middleware; this keeps the same answer for
    callers that do not come through ASGI, such as Django's test client."""

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


_BAD_REQUEST_PAGE = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Bad request</title></head>
<body>
<h1>Bad request</h1>
<p>{detail}</p>
</body>
</html>
"""
_FORM_CONTENT_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def _unsafe_input(request) -> str | None:
    """What in the request cannot be stored (a NUL character, a lone surrogate) and where, or None.

    JSON bodies of the API are checked by its parser (core.safe_input), which names the field."""
    if why := unsafe_char(request.path):
        return f"The path contains {why}."
    for where, items in (
        ("query parameter", request.GET.lists()),
        ("cookie", ((name, [value]) for name, value in request.COOKIES.items())),
        ("header", ((name, [value]) for name, value in request.headers.items())),
    ):
        for name, values in items:
            for text in (name, *values):
                if why := unsafe_char(text):
                    return f"The {where} {_quoted(name)} contains {why}."
    if (
        request.method == "POST"
        and not request.path.startswith("/api/")
        and request.content_type in _FORM_CONTENT_TYPES
    ):
        for name, values in request.POST.lists():
            for text in (name, *values):
                if why := unsafe_char(text):
                    return f"The form field {_quoted(name)} contains {why}."
    return None


def _quoted(name: str) -> str:
    # The name itself may be what holds the NUL: show it escaped, never raw.
    return ascii(name) if unsafe_char(name) else f"'{name}'"


def bad_request(request, detail: str) -> HttpResponse:
    """400 in the shape the caller reads: JSON under /api/, an HTML fragment for htmx (swapped into the form
    that sent it), a small static page otherwise (no template: nothing here should touch the session)."""
    if request.path.startswith("/api/"):
        return JsonResponse({"error": "bad_request", "detail": detail}, status=400)
    if request.headers.get("HX-Request"):
        return HttpResponse(f'<p class="message error">{escape(detail)}</p>', status=400)
    return HttpResponse(_BAD_REQUEST_PAGE.format(detail=escape(detail)), status=400)


class SafeInputMiddleware:
    """Answers 400, before any view or query sees it, a request whose path, query string, cookies, headers or
    form fields hold what PostgreSQL cannot store (a NUL character; a lone surrogate); and turns a DataError
    (a value PostgreSQL refused) raised by a console page into a 400 as well. The API maps DataError itself."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if detail := _unsafe_input(request):
            log.info("unsafe input refused", path=ascii(request.path)[:200], detail=detail)
            return bad_request(request, detail)
        return self.get_response(request)

    def process_exception(self, request, exception):
        if isinstance(exception, DataError):
            log.info("database refused a value", path=request.path, error=str(exception).strip()[:300])
            return bad_request(request, "A value in the request was refused by the database.")
        return None


_UNAVAILABLE_PAGE = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Temporarily unavailable</title></head>
<body>
<h1>Temporarily unavailable</h1>
<p>The console cannot reach its database right now. Nothing you did was lost; try again in a few seconds.</p>
</body>
</html>
"""
RETRY_AFTER_SECONDS = 5


def _database_unavailable(exc: BaseException) -> bool:
    # Django's InterfaceError ("connection already closed") may carry no driver error to look into.
    if isinstance(exc, InterfaceError) or (isinstance(exc, OperationalError) and is_connection_error(exc)):
        return True
    return _lost_while_reading_the_response(exc)


def _lost_while_reading_the_response(exc: BaseException) -> bool:
    """django-ninja validates a response by reading the view's objects (a lazy queryset, a related row): a database
    error there reaches us as pydantic's ValidationError, which keeps only the error's text. It is an outage when
    that text names a database error and the connection it came from is gone (Django marked it, and it no longer
    answers); anything else that does not fit the schema stays a 500."""
    if not isinstance(exc, pydantic.ValidationError):
        return False
    texts = [str((error.get("ctx") or {}).get("error", "")) for error in exc.errors()]
    if not any(text.startswith(("OperationalError", "InterfaceError")) for text in texts):
        return False
    return connection.errors_occurred and (connection.connection is None or not connection.is_usable())


def _remember_database_outage(sender, request=None, **kwargs) -> None:
    # Sent by Django while it turns an exception raised anywhere in the stack (a view, or a middleware such as
    # the session's) into a 500 response: the exception being handled is the one to look at.
    exc = sys.exception()
    if request is not None and exc is not None and _database_unavailable(exc):
        request.database_unavailable = exc


class DatabaseUnavailableMiddleware:
    """While the database cannot be reached, answers 503 (JSON under /api/, a static page elsewhere: rendering a
    template would need the session, hence the database) instead of a 500; the next request after the database
    is back is served normally, since Django opens a new connection per request and health-checks kept ones.

    Placed early (after RequestIdMiddleware), so the session and authentication middlewares are inside it."""

    def __init__(self, get_response):
        self.get_response = get_response
        got_request_exception.connect(_remember_database_outage, dispatch_uid="console.database_unavailable")

    def __call__(self, request):
        response = self.get_response(request)
        exc = getattr(request, "database_unavailable", None)
        if exc is not None and response.status_code == 500:
            return self._unavailable(request, exc)
        return response

    def process_exception(self, request, exception):
        if _database_unavailable(exception):
            return self._unavailable(request, exception)
        return None

    def _unavailable(self, request, exc: BaseException):
        log.warning("database unavailable", path=request.path, error=f"{type(exc).__name__}: {exc}".strip()[:300])
        if request.path.startswith("/api/"):
            # An outage may say more (runs.submission.OutcomeUnknown: which run to look for before sending again).
            detail = getattr(exc, "detail_for_client", "The database cannot be reached; try again shortly.")
            response = JsonResponse({"error": "database_unavailable", "detail": detail}, status=503)
        else:
            response = HttpResponse(_UNAVAILABLE_PAGE, status=503, content_type="text/html; charset=utf-8")
        response["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return response


# In place of a value the vault cannot open (a missing or wrong key): what is wrong, never the value.
_UNREADABLE = {
    "pii_keys_missing": "PII_KEYS is not set",
    "pii_key_unknown": "its key is not in PII_KEYS",
    "pii_unreadable": "PII_KEYS holds a wrong key",
}


class PersonalDataMiddleware:
    """Every page and API answer shows personal data masked (`j***@example.com`; docs/personal-data.md):
    each reference (`pii:<id>`) in an HTML, JSON or text body is replaced by its value's mask, escaped for the
    body it is in, or "[erased]" for an erased subject's. One place for every view (the card page, the inbox, bulk,
    the run page, the APIs, admin, the audit log), so that no view can forget it and what a person is shown of a
    card is the same everywhere; a view that may reveal clear values does so itself, audited (approvals.personal),
    and its answer then holds no reference. Streamed answers (exports) are left as they are: they carry references.

    A missing or wrong key (core.pii.KeysMissing, KeyUnknown, Unreadable) is said in place of each value on a
    page, and answered 503 `{error: "pii_keys_missing", detail}` by the API: never clear text, never a traceback.
    Placed outside everything that renders, inside DatabaseUnavailableMiddleware (opening the values reads the
    database)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        kind = response.get("Content-Type", "").split(";")[0].strip()
        if response.streaming or not (kind.startswith("text/") or kind == "application/json"):
            return response
        if pii.PREFIX.encode() not in response.content:  # most answers: no decoding, nothing read
            return response
        charset = response.charset or "utf-8"
        text = response.content.decode(charset, errors="replace")
        if kind == "application/json":
            quote = _json_text
        elif kind == "text/html":
            quote = escape
        else:
            quote = str
        refs = set(pii.REF.findall(text))
        try:
            shown = pii.present({ref: ref for ref in refs})
        except pii.PiiError as exc:
            log.error("personal data cannot be shown", path=request.path, code=exc.code, error=str(exc))
            if kind == "application/json":
                return _pii_error(exc)
            shown = dict.fromkeys(refs, f"[personal data unavailable: {_UNREADABLE.get(exc.code, exc.code)}]")
        response.content = pii.REF.sub(lambda m: quote(str(shown.get(m.group(0), pii.ERASED))), text).encode(charset)
        if response.has_header("Content-Length"):  # set inside (CommonMiddleware) for the body with references
            response["Content-Length"] = str(len(response.content))
        return response

    def process_exception(self, request, exception):
        """A view that needed a value it could not open (an edit's check, a reveal): 503, saying why."""
        if not isinstance(exception, pii.PiiError) or isinstance(exception, pii.SchemaError | pii.Erased):
            return None
        log.error("personal data cannot be opened", path=request.path, code=exception.code, error=str(exception))
        if request.path.startswith("/api/"):
            return _pii_error(exception)
        page = _UNREADABLE_PAGE.format(detail=escape(str(exception)))
        return HttpResponse(page, status=503, content_type="text/html; charset=utf-8")


_UNREADABLE_PAGE = (
    "<!doctype html><html lang=en><meta charset=utf-8><title>Personal data unavailable</title>"
    "<h1>Personal data unavailable</h1><p>{detail}</p></html>"
)


def _json_text(value: str) -> str:
    """`value` as it goes inside a JSON string (the reference it replaces was one, or part of one)."""
    return json.dumps(value)[1:-1]


def _pii_error(exc: pii.PiiError) -> HttpResponse:
    return JsonResponse({"error": exc.code, "detail": str(exc)}, status=503)


class AccessDeniedMiddleware:
    """Answers a page's access.Denied (core.access: who may do what) as Django answers Http404 and
    PermissionDenied: with its 404 page (NotVisible) or its 403 page (Forbidden). The API answers the same
    exception in JSON (console.api)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not isinstance(exception, Denied):
            return None
        answer = Http404(str(exception)) if exception.status == 404 else PermissionDenied(str(exception))
        return response_for_exception(request, answer)


def is_token_request(request) -> bool:
    """An API call that brings a bearer token (`Authorization: Bearer ...` under /api/): the API authenticates it
    by its token alone (console.api), so it has no use for a session, a login, messages, htmx, static files or a
    page's framing and CSP headers (django-axes stays: it acts on logins only); and no CSRF check to pass: a
    browser does not add an Authorization header to a cross-site request by itself (a form cannot; a cross-origin
    fetch with one needs CORS, which the console does not grant). A request without one (a signed webhook, a
    page) gets them all."""
    return request.path.startswith("/api/") and request.META.get("HTTP_AUTHORIZATION", "")[:7].lower() == "bearer "


_HOOKS = ("process_view", "process_exception", "process_template_response")


def browser_only(middleware_class):
    """`middleware_class` for every request but a token request (is_token_request), which goes straight on to the
    next middleware: a third of the API's per-request CPU was middleware it does not need (docs/PROFILE-api.md).
    A subclass, so that what checks for the middleware (the admin's, django-axes' system checks) still finds it."""

    def __call__(self, request):
        if is_token_request(request):
            return self.get_response(request)
        return middleware_class.__call__(self, request)

    namespace = {"__call__": __call__, "__module__": __name__, "__doc__": browser_only.__doc__}
    for hook in _HOOKS:
        if hasattr(middleware_class, hook):
            namespace[hook] = _unless_token_request(getattr(middleware_class, hook))
    return type(f"BrowserOnly{middleware_class.__name__}", (middleware_class,), namespace)


def _unless_token_request(hook):
    @functools.wraps(hook)
    def skipping(self, request, *args):
        return None if is_token_request(request) else hook(self, request, *args)

    return skipping


# settings.MIDDLEWARE names these: Django's (and the apps') middleware, skipped for a token request.
BrowserOnlyCspMiddleware = browser_only(ContentSecurityPolicyMiddleware)
BrowserOnlyWhiteNoiseMiddleware = browser_only(WhiteNoiseMiddleware)
BrowserOnlySessionMiddleware = browser_only(SessionMiddleware)
BrowserOnlyCsrfViewMiddleware = browser_only(CsrfViewMiddleware)
BrowserOnlyAuthenticationMiddleware = browser_only(AuthenticationMiddleware)
BrowserOnlyLoginRequiredMiddleware = browser_only(LoginRequiredMiddleware)
BrowserOnlyMessageMiddleware = browser_only(MessageMiddleware)
BrowserOnlyXFrameOptionsMiddleware = browser_only(XFrameOptionsMiddleware)
BrowserOnlyHtmxMiddleware = browser_only(HtmxMiddleware)


# The orchestrator's probes: answered whatever Host they name.
PROBE_PATHS = frozenset({"/healthz", "/readyz"})


class CommonMiddleware(DjangoCommonMiddleware):
    """Django's, except that a probe (/healthz, /readyz) is not checked against ALLOWED_HOSTS: a container's
    health check, a load balancer's and Kubernetes' probes name the replica's own address (`10.89.0.15:8000`),
    which ALLOWED_HOSTS need not list, and would mark every replica down with 400. The probes build nothing from
    the Host header; every other request is checked as before."""

    def process_request(self, request):
        if request.path_info in PROBE_PATHS:
            return None
        return super().process_request(request)
