"""Client of the HITL approval console: ask a person to sign off one action, then run it exactly once.

client = Client("http://127.0.0.1:8000", token="...")

@require_approval(client, channel="payments", rationale="refund a late order")
def refund(order_id: str, amount_cents: int) -> dict: ...
"""

from hitl_client.client import AsyncClient, Client
from hitl_client.decorator import require_approval, run_compensations, run_compensations_async
from hitl_client.digest import arguments_digest, canonical_json
from hitl_client.errors import (
    ActionFailed,
    AlreadyConsumed,
    ApiError,
    Cancelled,
    Conflict,
    ConnectionFailed,
    Declined,
    DigestMismatch,
    Expired,
    Forbidden,
    HitlError,
    Invalid,
    Locked,
    NotApproved,
    NotConsumed,
    NotFound,
    OutcomeUnknown,
    RateLimited,
    Rejected,
    ReportFailed,
    ServerError,
    Unauthorized,
    UnexpectedResponse,
    WaitTimeout,
)
from hitl_client.models import ApprovalRequest, Execution, ExecutionStatus, Go, RequestStatus

__all__ = [
    "ActionFailed",
    "AlreadyConsumed",
    "ApiError",
    "ApprovalRequest",
    "AsyncClient",
    "Cancelled",
    "Client",
    "Conflict",
    "ConnectionFailed",
    "Declined",
    "DigestMismatch",
    "Execution",
    "ExecutionStatus",
    "Expired",
    "Forbidden",
    "Go",
    "HitlError",
    "Invalid",
    "Locked",
    "NotApproved",
    "NotConsumed",
    "NotFound",
    "OutcomeUnknown",
    "RateLimited",
    "Rejected",
    "ReportFailed",
    "RequestStatus",
    "ServerError",
    "Unauthorized",
    "UnexpectedResponse",
    "WaitTimeout",
    "arguments_digest",
    "canonical_json",
    "require_approval",
    "run_compensations",
    "run_compensations_async",
]
