"""A LangGraph support agent whose refunds wait for a person's sign-off in the console, and run once.

    pip install './clients/python[langgraph]' langchain-openai
    createdb -h 127.0.0.1 -U postgres langgraph   # once: the database that keeps the agent's checkpoints
    HITL_URL=http://127.0.0.1:8000 HITL_TOKEN=hitl_... \\
    OPENAI_BASE_URL=https://... OPENAI_API_KEY=sk-... \\
    CHECKPOINT_DATABASE_URL=postgres://postgres@127.0.0.1:5432/langgraph \\
    python examples/langgraph_refund.py --thread order-42 "Order ord_42 arrived broken: please refund the 50 EUR."

CHECKPOINT_DATABASE_URL names a PostgreSQL database of the agent's own (not the console's): create it once, as
above (or `psql -c 'CREATE DATABASE langgraph'`); the example creates its tables in it (`checkpointer.setup()`).
The refund waits for a reviewer on the `payments` channel (the token's user needs `request_channel` there); while
it waits, the example prints the card's address in the console (`<HITL_URL>/approvals/<card id>/`) for the
reviewer to open. Stop the process while it waits and run the same command again: the thread continues from its
Postgres checkpoint, the same request, no second card. The refund goes to the payment service at PAYMENTS_URL
if set (POST /refunds), else it is only printed. OPENAI_MODEL names the model (default gpt-4o-mini).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx
import psycopg
from hitl_client import Client
from hitl_client.adapters.langgraph import ApprovalToolNode, invoke_with_approvals
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition

SYSTEM = "You are a support agent. Look orders up before refunding them; refund at most what was paid."


@tool(parse_docstring=True)
def lookup_order(order_id: str) -> dict:
    """Look an order up.

    Args:
        order_id: The order's id, e.g. ord_42.
    """
    return {"order_id": order_id, "paid_cents": 5_000, "currency": "EUR", "status": "delivered"}


@tool(parse_docstring=True)
def refund_order(order_id: str, amount_cents: int) -> dict:
    """Refund an order, in part or in full. A person approves every refund first.

    Args:
        order_id: The order's id, e.g. ord_42.
        amount_cents: How much to refund, in cents.
    """
    payments = os.environ.get("PAYMENTS_URL")
    if not payments:
        print(f"(refunding {amount_cents} cents on {order_id})")
        return {"refunded_cents": amount_cents, "order_id": order_id}
    response = httpx.post(f"{payments}/refunds", json={"order_id": order_id, "amount_cents": amount_cents}, timeout=60)
    response.raise_for_status()
    return response.json()


def customer_request(call, state) -> str:
    """The card's rationale: what the customer wrote."""
    asked = [m.content for m in state["messages"] if isinstance(m, HumanMessage)]
    return f"The customer wrote: {asked[-1]}" if asked else f"The agent wants to run {call['name']}."


def build_graph(client: Client, checkpointer: PostgresSaver):
    tools = [lookup_order, refund_order]
    model = ChatOpenAI(model=os.environ.get("OPENAI_MODEL", "gpt-4o-mini")).bind_tools(tools)

    def agent(state: MessagesState) -> dict:
        return {"messages": [model.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    # ToolNode, except that refund_order runs only with a person's yes (and their edit), once.
    builder.add_node(
        "tools",
        ApprovalToolNode(
            tools, client=client, channel="payments", needs_approval={"refund_order"}, rationale=customer_request
        ),
    )
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer)


def waiting(requests: list[dict]) -> None:
    # card_url: the card in the console, where a reviewer decides (`url` is the request's API address, which only
    # this agent's token may read).
    for request in requests:
        print(
            f"Waiting for a person to decide {request['action']}: {request['card_url']} "
            f"(request {request['request_id']})"
        )
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thread", required=True, help="the conversation's id: run again to continue it")
    parser.add_argument("message", help="what the customer writes")
    args = parser.parse_args()

    checkpoints = os.environ["CHECKPOINT_DATABASE_URL"]
    try:
        psycopg.connect(checkpoints, connect_timeout=10).close()
    except psycopg.OperationalError as exc:
        sys.exit(
            f"The checkpoint database ({checkpoints}) cannot be reached: {exc}\n"
            "Create it once (createdb, or CREATE DATABASE in psql) and make CHECKPOINT_DATABASE_URL name it."
        )
    with (
        Client(os.environ["HITL_URL"], os.environ["HITL_TOKEN"]) as client,
        PostgresSaver.from_conn_string(checkpoints) as checkpointer,
    ):
        checkpointer.setup()
        graph = build_graph(client, checkpointer)
        result = invoke_with_approvals(
            graph,
            {"messages": [HumanMessage(args.message)]},
            {"configurable": {"thread_id": args.thread}},
            client=client,
            on_wait=waiting,
        )
    for message in result["messages"]:
        print(json.dumps({"type": message.type, "name": message.name, "content": message.content}))


if __name__ == "__main__":
    main()
