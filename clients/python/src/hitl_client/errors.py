"""Every error the client raises: `HitlError` is the base of all of them.

Two families: `ApiError`, the console said no (its status, `error` code and `detail`), and the outcomes of
`require_approval` that are not a result (`Rejected`, `Expired`, `Cancelled`, `ActionFailed`, `OutcomeUnknown`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hitl_client.models import ApprovalRequest, Execution


class HitlError(Exception):
    """Base of every error of this client."""


class ConnectionFailed(HitlError):
    """The console could not be reached, or the connection broke before its answer (after the retries that
    were safe to make). The httpx error is the `__cause__`."""


class UnexpectedResponse(HitlError):
    """The console's answer does not match the contract (a missing field, a wrong type, not JSON): the client
    stops rather than guess."""

    def __init__(self, message: str, body: object = None) -> None:
        super().__init__(message)
        self.body = body


class ApiError(HitlError):
    """The console refused: `status` (HTTP), `error` (the contract's code) and `detail` (text, or the field
    errors of a 422)."""

    def __init__(self, status: int, error: str, detail: Any = "") -> None:
        super().__init__(f"{status} {error}: {detail}" if detail not in ("", None) else f"{status} {error}")
        self.status, self.error, self.detail = status, error, detail


class Invalid(ApiError):
    """400, 413 or 422: the request itself is wrong (a field, the body); sending it again will not help."""


class Unauthorized(ApiError):
    """401: the token is missing, unknown or revoked."""


class Forbidden(ApiError):
    """403: the token's user may not do this (e.g. no `request_channel` permission on the channel)."""


class NotFound(ApiError):
    """404: no such channel, run or request, or one of another user."""


class Conflict(ApiError):
    """409: the request's state forbids this. Its subclasses name the contract's 409 codes."""


class AlreadyConsumed(Conflict):
    """409 already_consumed: "go" was given before, to another consume (another process, or an earlier run of
    this one: the console gives the same go again only to the same consume's nonce). `execution` is the receipt
    recorded then (None if the console did not say)."""

    def __init__(self, status: int, error: str, detail: Any = "", *, execution: Execution | None = None) -> None:
        super().__init__(status, error, detail)
        self.execution = execution


class DigestMismatch(Conflict):
    """409 digest_mismatch: the digest is not the approved arguments' (nothing was written)."""


class NotApproved(Conflict):
    """409 not_approved: the request is pending, rejected, expired or cancelled (`detail` says which)."""


class NotConsumed(Conflict):
    """409 not_consumed: a result was reported for a request that was never consumed."""


class Locked(ApiError):
    """423: the channel's (or the global) kill switch is engaged. Nothing was written and nothing ran: the
    request stays approved; call again once the switch is released (the same idempotency key) to run it once."""


class RateLimited(ApiError):
    """429: too many requests for this token (after the retries that were safe to make)."""


class ServerError(ApiError):
    """5xx: the console failed (after the retries that were safe to make)."""


class WaitTimeout(HitlError, TimeoutError):
    """`wait` gave up before anyone decided. The request is still pending: wait again, or re-run the decorated
    call with the same key, to pick it up where it is."""

    def __init__(self, request: ApprovalRequest, timeout: float) -> None:
        super().__init__(f"Request {request.id} was not decided within {timeout:g} s.")
        self.request = request


class Declined(HitlError):
    """The action may not run: rejected, expired or cancelled. `request` is the request as decided."""

    def __init__(self, request: ApprovalRequest, message: str) -> None:
        super().__init__(message)
        self.request = request


class Rejected(Declined):
    """A person rejected the action: their `comment`, the `reason` and who (`decided_by`)."""

    def __init__(self, request: ApprovalRequest) -> None:
        who = request.decided_by or "a reviewer"
        super().__init__(request, f"{request.action} was rejected by {who}: {request.comment or request.reason}")
        self.comment, self.reason, self.decided_by = request.comment, request.reason, request.decided_by


class Expired(Declined):
    """Nobody decided in time; expiry never approves."""

    def __init__(self, request: ApprovalRequest) -> None:
        super().__init__(request, f"{request.action} was not decided in time (expired at {request.expires_at}).")


class Cancelled(Declined):
    """The request was cancelled (its run was cancelled) before it was decided or used."""

    def __init__(self, request: ApprovalRequest) -> None:
        super().__init__(request, f"{request.action} was cancelled: {request.reason or request.comment}")


class ActionFailed(HitlError):
    """The action ran once before, and failed: its recorded `error`. It is not run again."""

    def __init__(self, request: ApprovalRequest) -> None:
        super().__init__(f"{request.action} ran before and failed: {request.execution.error}")
        self.request, self.error = request, request.execution.error


class OutcomeUnknown(HitlError):
    """The "go" was given, and no result was ever reported: the process that had it died between consume and
    report (or another process holds it now). The action may or may not have happened, so it is never run again
    by the client; a person must check (the card and the run page show "outcome unknown")."""

    def __init__(self, request: ApprovalRequest) -> None:
        super().__init__(
            f"{request.action} (request {request.id}) was consumed at {request.execution.consumed_at} and no "
            "outcome was reported: it may or may not have run. It is not run again; check it by hand."
        )
        self.request = request


class ReportFailed(HitlError):
    """The action ran and returned `result`, but the console did not take the report (the receipt still says
    "outcome unknown"). The cause is the `__cause__`; `client.report(...)` can be sent again."""

    def __init__(self, request: ApprovalRequest, result: Any) -> None:
        super().__init__(f"{request.action} ran, but its result could not be reported (request {request.id}).")
        self.request, self.result = request, result
