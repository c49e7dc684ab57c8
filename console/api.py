"""The JSON API (django-ninja): bearer-token auth and errors as `{error, detail}` JSON."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import DataError
from django.http import Http404, HttpRequest
from ninja import NinjaAPI, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser
from ninja.security import HttpBearer

from approvals.api import router as approvals_router
from console.channels import router as channels_router
from core import pii, safe_input
from core.access import Denied
from core.api import ERRORS
from core.models import ApiToken
from core.safe_input import UnsafeJson
from evals.api import router as evals_router
from external import api as external_api
from external.api import router as external_router
from runs.api import router as runs_router
from runs.breaker_api import router as breakers_router
from runs.webhook_api import router as webhooks_router


class BearerToken(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str):
        found = ApiToken.find(token)
        if found is None:
            return None
        request.user, request.api_token = found.user, found
        return found.user


# The routes (by url_name) whose body has fields that take any valid JSON (core.safe_input.loads' `free`): an
# external agent's result, what its system answered, which must be recordable whatever it is.
FREE_JSON_FIELDS = {external_api.RESULT_URL_NAME: external_api.ResultIn.FREE_JSON}


class SafeJsonParser(Parser):
    """django-ninja's body parser. ninja turns any exception raised here into a 400 "Cannot parse request body"
    HttpError raised `from` it; `_http_error` below answers an UnsafeJson cause with a 422 that names the field."""

    def parse_body(self, request):
        match = getattr(request, "resolver_match", None)
        free = FREE_JSON_FIELDS.get(match.url_name, ()) if match is not None else ()
        return safe_input.loads(request.body, free=free)


class ConsoleApi(NinjaAPI):
    def validation_error_from_error_contexts(self, error_contexts):
        """A 422's fields named as the client sent them: ninja's `loc` starts with where the value came from and,
        for a body read into one parameter, that parameter's name (["body", "body", "payload", "refund"]), neither
        of which the client wrote. Here: the field's dotted path in the body ("payload.refund"), or a query or path
        parameter's name ("status"); "body" for the body as a whole. The API's own field errors (a workflow's
        input, an agent's arguments) and the parser's (core.safe_input) are written the same way."""
        errors = []
        for context in error_contexts:
            single = getattr(context.model, "__read_from_single_attr__", None)
            for error in super().validation_error_from_error_contexts([context]).errors:
                source, *path = error["loc"]
                if single is not None and path[:1] == [single]:
                    path = path[1:]
                errors.append({**error, "loc": safe_input.field_path(path) or source})
        return ValidationError(errors)

    def get_openapi_schema(self, *, path_prefix=None, path_params=None):
        # The parser's and the middleware's refusals (NUL, numbers beyond ±2**53) stated where a client reads
        # them: in every request body and parameter of the document (core.safe_input.declare).
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        return safe_input.declare(schema)


api = ConsoleApi(
    title="HITL approval console",
    version="1",
    auth=BearerToken(),
    urls_namespace="api",
    parser=SafeJsonParser(),
)


def error(request, status: int, error_code: str, detail) -> object:
    return api.create_response(request, {"error": error_code, "detail": detail}, status=status)


@api.exception_handler(AuthenticationError)
def _unauthorized(request, exc):
    response = error(request, 401, "unauthorized", "A valid 'Authorization: Bearer <token>' header is required.")
    response["WWW-Authenticate"] = "Bearer"
    return response


@api.exception_handler(ValidationError)
def _invalid(request, exc):
    return error(request, 422, "invalid", exc.errors)


@api.exception_handler(HttpError)
def _http_error(request, exc):
    # ninja wraps whatever the body parser raised in a 400 "Cannot parse request body"; a body that parsed
    # but holds a value we refuse is a 422 naming the field, like any other invalid field.
    if isinstance(exc.__cause__, UnsafeJson):
        return error(request, 422, "invalid", exc.__cause__.errors())
    return error(request, exc.status_code, _ERROR_CODES.get(exc.status_code, "error"), str(exc))


_ERROR_CODES = {
    400: "bad_request",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    413: "too_large",
    422: "invalid",
    429: "too_many_requests",
}


@api.exception_handler(Http404)
def _not_found(request, exc):
    return error(request, 404, "not_found", "Not found.")


@api.exception_handler(Denied)
def _denied(request, exc):
    # Who may (core.access): a 404 says nothing of the thing, not even that it exists; a 403 says why.
    if exc.status == 404:
        return error(request, 404, "not_found", "Not found.")
    return error(request, 403, "forbidden", str(exc))


@api.exception_handler(pii.PiiError)
def _personal_data(request, exc):
    # The vault cannot seal or open (core.pii): a schema that marks personal data without its subject is the
    # caller's (422); an erased value asked for is gone (409); a missing or wrong key is the console's (503). The
    # message says what is wrong, never a value.
    if isinstance(exc, pii.SchemaError):
        return error(request, 422, "invalid", str(exc))
    if isinstance(exc, pii.Erased | pii.NotFound):
        return error(request, 409, exc.code, str(exc))
    return error(request, 503, exc.code, str(exc))


@api.exception_handler(RequestDataTooBig)
def _too_large(request, exc):
    return error(request, 413, "too_large", f"The body is larger than {settings.API_MAX_BODY_BYTES} bytes.")


@api.exception_handler(DataError)
def _data_error(request, exc):
    # A value PostgreSQL refuses (out of range, too long, not encodable) is the client's, not a server fault.
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "A value was refused by the database."
    return error(request, 400, "bad_request", f"The database refused a value: {detail}")


def _mount_app_routers() -> None:
    api.add_router("/", runs_router)
    api.add_router("/", approvals_router)
    api.add_router("/", channels_router)
    api.add_router("/", breakers_router)
    api.add_router("/", external_router)
    api.add_router("/", evals_router)
    api.add_router("/", webhooks_router)  # signed, no bearer token (auth=None on its route)


class Me(Schema):
    username: str
    groups: list[str]


@api.get("/me", response={200: Me, **ERRORS}, summary="Who the token belongs to")
def me(request):
    return {"username": request.user.username, "groups": sorted(g.name for g in request.user.groups.all())}


_mount_app_routers()
