"""A tiny MCP server over stdio with two tools: `lookup_order`, harmless, and `refund_order`, which refunds
every time it is called (it is deliberately not idempotent): the kind of server to put behind the HITL gateway.

    python -m hitl_client.adapters.mcp_gateway --upstream "python examples/mcp_refund_server.py" \\
        --channel payments --approve refund_order

Refunds go to PAYMENTS_URL (POST /refunds, a payment system), or, without it, are appended to the file
REFUNDS_FILE (refunds.jsonl) one JSON line each: count the lines to see how many refunds were made.
Needs `pip install mcp==2.3.0`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import httpx
from mcp.server.mcpserver import MCPServer

server = MCPServer("refunds", instructions="Look orders up and refund them.")


@server.tool()
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up: its status and what was paid.

    Args:
        order_id: The order, e.g. ord_7.
    """
    return {"order_id": order_id, "status": "lost in transit", "amount_cents": 4_200, "currency": "EUR"}


@server.tool()
def refund_order(order_id: str, amount_cents: int, currency: str) -> dict[str, Any]:
    """Refund an order to the customer's card. Every call refunds: call it once per refund.

    Args:
        order_id: The order to refund, e.g. ord_7.
        amount_cents: The amount in cents.
        currency: ISO 4217 code, e.g. EUR.
    """
    refund = {"order_id": order_id, "amount_cents": amount_cents, "currency": currency}
    payments = os.environ.get("PAYMENTS_URL")
    if payments:
        response = httpx.post(f"{payments}/refunds", json=refund, timeout=60)
        response.raise_for_status()
        return response.json()
    with Path(os.environ.get("REFUNDS_FILE", "refunds.jsonl")).open("a", encoding="utf-8") as file:
        file.write(json.dumps(refund) + "\n")
    return {"refunded": refund}


if __name__ == "__main__":
    # stdout is the MCP connection: the log goes to stderr (the pid, for whoever needs to find this process).
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    logging.getLogger("mcp_refund_server").info("mcp_refund_server pid %d", os.getpid())
    server.run("stdio")
