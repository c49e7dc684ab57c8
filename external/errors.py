"""Why an external agent's request, consume or result, or a person's record of its outcome, is refused: each error
names the HTTP status (`status`) and code (`error`) it maps to, with its `detail` (external.api answers with them
as JSON; external.views shows them on the run's page). A leaf, like approvals/errors.py: the logic (external.asks,
external.status, external.executions) raises these, and nothing is written when it does."""

from __future__ import annotations

import json
from typing import Any


class RequestError(Exception):
    """A request, a consume or a result refused: `status` (HTTP), `error` (code) and `detail`; nothing written."""

    status, error = 400, "bad_request"

    def __init__(self, detail: Any, **extra):
        super().__init__(detail if isinstance(detail, str) else json.dumps(detail))
        self.detail = detail
        self.extra = extra


class NotFound(RequestError):
    status, error = 404, "not_found"


class Forbidden(RequestError):
    status, error = 403, "forbidden"


class Invalid(RequestError):
    status, error = 422, "invalid"


class Conflict(RequestError):
    status, error = 409, "conflict"


class AlreadyConsumed(Conflict):
    error = "already_consumed"


class DigestMismatch(Conflict):
    error = "digest_mismatch"


class NotApproved(Conflict):
    error = "not_approved"


class NotConsumed(Conflict):
    error = "not_consumed"


class Stale(Conflict):
    error = "stale"


class RunEnded(Conflict):
    error = "run_ended"


class Locked(RequestError):
    status, error = 423, "locked"


class Unavailable(RequestError):
    status, error = 503, "unavailable"
