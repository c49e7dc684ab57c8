"""A refund agent on the OpenAI Agents SDK whose refunds a person signs off on the console.

    export HITL_URL=http://127.0.0.1:8000 HITL_TOKEN=hitl_... OPENAI_BASE_URL=https://api.openai.com/v1
    export OPENAI_API_KEY=sk-...
    python examples/openai_agents_refund.py ticket-42 "Order ord_7 never arrived: please refund the 42.00 EUR."

Each refund the model wants becomes a card in the console's inbox (payments channel); the agent waits, and the
refund runs once, with what the reviewer approved (an edited amount, say), or not at all (the model reads the
reviewer's comment). Kill it while it waits, or even while it refunds, and run the same command again: it goes on
from where it stopped and never refunds twice (the paused run is kept in STATE_DIR/<ticket>.json).

Environment: HITL_URL and HITL_TOKEN (`manage.py create_api_token agent`: the demo's agent may ask on payments);
OPENAI_BASE_URL and OPENAI_API_KEY (any OpenAI-compatible chat-completions server), OPENAI_MODEL (gpt-4o-mini);
PAYMENTS_URL, the payment system (POST /refunds; without it the refund is only printed); STATE_DIR (agent-state).
Needs `pip install './clients/python[openai-agents]'`.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
from agents import Agent, set_default_openai_api, set_default_openai_client, set_tracing_disabled
from agents.tool_context import ToolContext
from hitl_client import AsyncClient
from hitl_client.adapters.openai_agents import SessionFinished, approval_tool, run_with_approvals
from openai import AsyncOpenAI


@approval_tool(
    channel="payments",
    rationale="The customer's ticket asks for this refund.",
    risk="high",
    display={"headline": "order_id", "amount_minor": "amount_cents", "currency": "currency"},
)
def refund_order(context: ToolContext, order_id: str, amount_cents: int, currency: str) -> dict:
    """Refund an order to the customer's card.

    Args:
        order_id: The order to refund, e.g. ord_7.
        amount_cents: The amount in cents.
        currency: ISO 4217 code, e.g. EUR.
    """
    payments = os.environ.get("PAYMENTS_URL")
    refund = {"order_id": order_id, "amount_cents": amount_cents, "currency": currency}
    if not payments:
        print(f"(no PAYMENTS_URL: not sent) refund {refund}", flush=True)
        return {"refunded": refund}
    # The call's id names the refund at the payment system too: its own duplicate check, where it has one.
    response = httpx.post(
        f"{payments}/refunds", json=refund, headers={"Idempotency-Key": context.tool_call_id}, timeout=60
    )
    response.raise_for_status()
    return response.json()


agent = Agent(
    name="refund-agent",
    instructions=(
        "You handle refund requests from support tickets. Refund what the ticket asks for with refund_order, "
        "once, then tell the customer in one sentence what was refunded (or why not)."
    ),
    tools=[refund_order],
    model=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"),
)


def waiting(requests: list[dict]) -> None:
    """Says where a person decides, while the agent waits: the card in the console."""
    for request in requests:
        print(
            f"Waiting for a person to decide {request['action']}: {request['card_url']} "
            f"(request {request['request_id']})",
            flush=True,
        )


async def main(ticket: str, text: str) -> int:
    # Any OpenAI-compatible server, over chat completions; no traces leave the machine.
    set_default_openai_client(
        AsyncOpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ.get("OPENAI_API_KEY", "unused")),
        use_for_tracing=False,
    )
    set_default_openai_api("chat_completions")
    set_tracing_disabled(True)
    state = Path(os.environ.get("STATE_DIR", "agent-state")) / f"{ticket}.json"
    async with AsyncClient(os.environ["HITL_URL"], os.environ["HITL_TOKEN"]) as console:
        try:
            result = await run_with_approvals(
                agent, text, client=console, session=ticket, state_path=state, on_wait=waiting
            )
        except SessionFinished as done:
            print(f"{ticket} was handled before: {done.final_output}")
            return 0
    print(result.final_output)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} TICKET TEXT")
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2])))
