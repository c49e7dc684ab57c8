"""An MCP client that calls the refund server's tools through the HITL gateway (both started here, over stdio).

    export HITL_URL=http://127.0.0.1:8000 HITL_TOKEN=hitl_...
    python examples/mcp_gateway_client.py lookup_order '{"order_id": "ord_7"}'
    python examples/mcp_gateway_client.py refund_order '{"order_id": "ord_7", "amount_cents": 4200, "currency": "EUR"}'

`lookup_order` passes through at once. `refund_order` waits for a person: a card appears in the console's inbox
(payments channel); once someone approves (or edits the amount) the refund is made once and the result says who
decided; a rejection comes back as an error result with their comment. Stop it while it waits and run the same
command again: the gateway picks the same request up. Run it after a refund that went through, and the recorded
result comes back instead of a second refund (the key: `--session`, the tool and its arguments; or your own
with `--key`).

Environment: HITL_URL and HITL_TOKEN (`manage.py create_api_token agent`); PAYMENTS_URL or REFUNDS_FILE for the
refund server (examples/mcp_refund_server.py). Needs `pip install './clients/python[mcp]'`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from pathlib import Path

from hitl_client.adapters.mcp_gateway import DECISION_META, IDEMPOTENCY_KEY_META
from mcp import Client, StdioServerParameters
from mcp_types import TextContent

REFUND_SERVER = Path(__file__).with_name("mcp_refund_server.py")
# What the gateway and the refund server need from this environment (a stdio server inherits only a safe few).
PASSED_ON = ("HITL_URL", "HITL_TOKEN", "PAYMENTS_URL", "REFUNDS_FILE", "PYTHONPATH")


async def main(tool: str, arguments: dict, session: str, key: str | None) -> int:
    gateway = StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "hitl_client.adapters.mcp_gateway",
            "--upstream",
            shlex.join([sys.executable, str(REFUND_SERVER)]),
            "--channel",
            "payments",
            "--approve",
            "refund_order",
            "--session",
            session,
            "--risk",
            "high",
            "--display",
            "headline=order_id",
            "--display",
            "amount_minor=amount_cents",
            "--display",
            "currency=currency",
        ],
        env={name: os.environ[name] for name in PASSED_ON if name in os.environ},
    )
    async with Client(gateway) as client:
        tools = await client.list_tools()
        print("tools:", ", ".join(t.name for t in tools.tools), file=sys.stderr)
        result = await client.call_tool(tool, arguments, meta={IDEMPOTENCY_KEY_META: key} if key else None)
    texts = [part.text for part in result.content if isinstance(part, TextContent)]
    print(json.dumps({"is_error": result.is_error, "text": texts, "decision": (result.meta or {}).get(DECISION_META)}))
    return 1 if result.is_error else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tool")
    parser.add_argument("arguments", type=json.loads, help="the tool's arguments, a JSON object")
    parser.add_argument("--session", default="example", help="names this client's calls (the gateway's --session)")
    parser.add_argument("--key", help="this call's own idempotency key (sent in _meta)")
    options = parser.parse_args()
    sys.exit(asyncio.run(main(options.tool, options.arguments, options.session, options.key)))
