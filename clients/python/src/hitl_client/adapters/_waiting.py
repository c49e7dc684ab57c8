"""What the adapters whose runs stop for approvals (the OpenAI Agents SDK's and Pydantic AI's `run_with_approvals`)
share: the `on_wait` hook that says where a person decides, and the reviewer's comment as the model reads it after
an edit (LangGraph's and MCP's words). No framework is imported here."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from hitl_client.client import AsyncClient
from hitl_client.models import ApprovalRequest

OnWait = Callable[[list[dict[str, Any]]], "None | Awaitable[None]"]


def comment(decided: ApprovalRequest | None) -> str:
    """The reviewer's comment on a decision, as the model reads it after an edit."""
    return f" Their comment: {decided.comment}" if decided is not None and decided.comment else ""


def waiting(client: AsyncClient, request: ApprovalRequest, call_id: str) -> dict[str, Any]:
    """What `on_wait` is told of a request the run waits for."""
    return {
        "request_id": request.id,
        "url": request.url,
        "card_id": request.card_id,
        "card_url": client.card_url(request.card_id),
        "action": request.action,
        "tool_call_id": call_id,
    }


async def tell(on_wait: OnWait, requests: list[dict[str, Any]]) -> None:
    told = on_wait(requests)
    if inspect.isawaitable(told):
        await told
