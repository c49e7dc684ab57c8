"""What the apps' pages share: the request they are given, typed with what django-htmx adds to it."""

from __future__ import annotations

from django.http import HttpRequest
from django_htmx.middleware import HtmxDetails


class HtmxHttpRequest(HttpRequest):
    """A page's request (django-htmx's documented pattern): `htmx` is set by its middleware (console.middleware's
    BrowserOnlyHtmxMiddleware, on every request but a token request's), true when htmx sent the request, with its
    headers (`target`, `history_restore_request`...). For annotations: no request is made of this class."""

    htmx: HtmxDetails
