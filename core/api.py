"""The API's error body, declared on every operation so that the OpenAPI document says what a client may get:
`{error, detail}` with 400, 401, 403, 404, 409, 413, 422, 429, or 503 while the database is unreachable.

A module of the views floor (it imports ninja): only the apps' API routers import it (pyproject.toml,
[tool.importlinter])."""

from __future__ import annotations

from typing import Any

from ninja import Schema


class ErrorOut(Schema):
    error: str
    detail: Any


ERRORS = {frozenset({400, 401, 403, 404, 409, 413, 422, 429, 503}): ErrorOut}
