"""The JSON API (django-ninja): bearer-token auth and errors as `{error, detail}` JSON."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import Http404, HttpRequest
from ninja import NinjaAPI, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.security import HttpBearer

from console.models import ApiToken


class BearerToken(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str):
        user = ApiToken.authenticate(token)
        if user is not None:
            request.user = user
        return user


api = NinjaAPI(title="HITL approval console", version="1", auth=BearerToken(), urls_namespace="api")


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


@api.exception_handler(RequestDataTooBig)
def _too_large(request, exc):
    return error(request, 413, "too_large", f"The body is larger than {settings.API_MAX_BODY_BYTES} bytes.")


def _mount_app_routers() -> None:
    from approvals.api import router as approvals_router
    from console.channels import router as channels_router
    from runs.api import router as runs_router

    api.add_router("/", runs_router)
    api.add_router("/", approvals_router)
    api.add_router("/", channels_router)


class Me(Schema):
    username: str
    groups: list[str]


@api.get("/me", response=Me, summary="Who the token belongs to")
def me(request):
    return {"username": request.user.username, "groups": sorted(g.name for g in request.user.groups.all())}


_mount_app_routers()
