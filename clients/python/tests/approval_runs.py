"""What the tests of the adapters whose runs stop for approvals (`run_with_approvals` of the OpenAI Agents SDK and
of Pydantic AI) drive them with: an in-memory chat-completions model (through httpx.MockTransport), a payment
system that counts every refund, and one `Adapter` per framework that says how that framework spells the same
things (its agent, its context parameter, its file, how it hands back a tool's output). The frameworks run for
real; each is imported only by its own `Adapter` (and its annotations are evaluated where they stand: the
frameworks read a tool function's context parameter from them)."""

import ast
import asyncio
import json
import time
from types import ModuleType
from typing import Any

import httpx
import pytest
from conftest import BASE_URL
from fake_console import FakeConsole, ProcessDied
from openai import AsyncOpenAI

from hitl_client import AsyncClient


class Model:
    """A chat-completions model that calls the tools it is scripted to call, then answers with the outputs it
    was sent (so a test reads what the model was told). Every request body is kept."""

    def __init__(self, calls: list[tuple[str, dict[str, Any] | str]]) -> None:
        self.calls, self.requests = calls, []
        self.die_with_output = False

    def handler(self, http: httpx.Request) -> httpx.Response:
        body = json.loads(http.content)
        self.requests.append(body)
        last = body["messages"][-1]
        if last["role"] == "tool":
            if self.die_with_output:
                raise ProcessDied
            outputs = [m["content"] for m in body["messages"] if m["role"] == "tool"]
            message = {"role": "assistant", "content": "Done. " + " | ".join(outputs)}
            return _completion(message, "stop")
        tool_calls = [
            {
                "id": f"call_{n}",
                "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
            for n, (name, args) in enumerate(self.calls)
        ]
        return _completion({"role": "assistant", "content": None, "tool_calls": tool_calls}, "tool_calls")

    def tool_outputs(self) -> dict[str, str]:
        """What the model was sent as each call's output, by call id (the last request's view)."""
        return {m["tool_call_id"]: m["content"] for m in self.requests[-1]["messages"] if m["role"] == "tool"}

    def openai(self) -> AsyncOpenAI:
        return AsyncOpenAI(
            base_url="http://model.test/v1",
            api_key="test",
            http_client=httpx.AsyncClient(transport=httpx.MockTransport(self.handler)),
            max_retries=0,
        )


def _completion(message: dict[str, Any], finish: str) -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "test",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        },
    )


class Adapter:
    """One framework's `run_with_approvals`, as the shared scenarios drive it."""

    name: str
    module: ModuleType
    # run_with_approvals' file option, and the name the run's output is kept under once it has ended.
    path_option: str
    output_key: str

    def agent(self, model: Model, *tools: Any) -> Any:
        raise NotImplementedError

    def output(self, result: Any) -> Any:
        """The run's output, as the framework's result holds it."""
        raise NotImplementedError

    def finished_output(self, finished: Exception) -> Any:
        raise NotImplementedError

    def recorded(self, told: str) -> Any:
        """A tool's dict result, read back from what the model was sent."""
        raise NotImplementedError

    def context_tool(self, seen: list[tuple[str | None, dict[str, Any]]], **options: Any) -> Any:
        """An async approval tool whose function takes the framework's context first (and a default amount)."""
        raise NotImplementedError

    def plain_tool_needing_approval(self, made: list[str]) -> Any:
        """A tool that needs approval in the framework's own way, not an approval_tool."""
        raise NotImplementedError

    async def approve_without_the_console(self, agent: Any) -> None:
        """Runs `agent` and approves its calls in the framework alone, as a caller could."""
        raise NotImplementedError

    def refused(self, error: BaseException) -> BaseException:
        """The adapter's refusal inside what the framework raised."""
        return error

    # What the model is told of arguments that do not fit the tool (an extra one, then text that is not JSON).
    bad_arguments_told: tuple[tuple[str, ...], tuple[str, ...]]

    def run(self, console: FakeConsole, agent: Any, **options: Any) -> Any:
        async def main() -> Any:
            transport = httpx.MockTransport(console.handler)
            async with AsyncClient(BASE_URL, "tok-alice", transport=transport, backoff=0, max_backoff=0) as client:
                options.setdefault("session", "ticket-42")
                return await self.module.run_with_approvals(agent, "Refund order o-42.", client=client, **options)

        return asyncio.run(main())


class OpenAIAgents(Adapter):
    name = "openai_agents"
    path_option = "state_path"
    output_key = "final_output"
    bad_arguments_told = (("refund_order did not run", "note"), ("not JSON",))

    def __init__(self) -> None:
        agents = pytest.importorskip("agents")
        agents.set_tracing_disabled(True)
        from hitl_client.adapters import openai_agents  # noqa: PLC0415 - only where the SDK is installed

        self.module, self.sdk = openai_agents, agents

    def agent(self, model: Model, *tools: Any) -> Any:
        chat = self.sdk.OpenAIChatCompletionsModel(model="test", openai_client=model.openai())
        instructions = "Refund what you are asked to."
        return self.sdk.Agent(name="refunds", instructions=instructions, tools=list(tools), model=chat)

    def output(self, result: Any) -> Any:
        return result.final_output

    def finished_output(self, finished: Exception) -> Any:
        return finished.final_output  # type: ignore[attr-defined]

    def recorded(self, told: str) -> Any:
        return ast.literal_eval(told)  # the SDK shows a tool's dict as its str()

    def context_tool(self, seen: list[tuple[str | None, dict[str, Any]]], **options: Any) -> Any:
        from agents.tool_context import ToolContext  # noqa: PLC0415 - the SDK is optional

        @self.module.approval_tool(channel="payments", **options)
        async def refund_order(context: ToolContext[Any], order_id: str, amount_cents: int = 100) -> str:
            """Refund an order."""
            seen.append((context.tool_call_id, {"order_id": order_id, "amount_cents": amount_cents}))
            return "refunded"

        return refund_order

    def plain_tool_needing_approval(self, made: list[str]) -> Any:
        @self.sdk.function_tool(needs_approval=True)
        def refund_order(order_id: str, amount_cents: int) -> str:
            """Refund an order."""
            made.append(order_id)
            return "ok"

        return refund_order

    async def approve_without_the_console(self, agent: Any) -> None:
        result = await self.sdk.Runner.run(agent, "Refund order o-42.")
        state = result.to_state()
        for item in result.interruptions:
            state.approve(item)
        await self.sdk.Runner.run(agent, state)

    def refused(self, error: BaseException) -> BaseException:
        # The SDK wraps what a tool raises in its UserError.
        from agents.exceptions import UserError  # noqa: PLC0415 - the SDK is optional

        assert isinstance(error, UserError)
        return error.__cause__ or error


class PydanticAI(Adapter):
    name = "pydantic_ai"
    path_option = "history_path"
    output_key = "output"
    bad_arguments_told = (("note", "Extra inputs are not permitted"), ("Invalid JSON",))

    def __init__(self) -> None:
        self.ai = pytest.importorskip("pydantic_ai")
        from hitl_client.adapters import pydantic_ai  # noqa: PLC0415 - only where Pydantic AI is installed

        self.module = pydantic_ai

    def agent(self, model: Model, *tools: Any) -> Any:
        from pydantic_ai.models.openai import OpenAIChatModel  # noqa: PLC0415 - Pydantic AI is optional
        from pydantic_ai.providers.openai import OpenAIProvider  # noqa: PLC0415 - Pydantic AI is optional

        chat = OpenAIChatModel("test", provider=OpenAIProvider(openai_client=model.openai()))
        return self.ai.Agent(chat, instructions="Refund what you are asked to.", tools=list(tools))

    def output(self, result: Any) -> Any:
        return result.output

    def finished_output(self, finished: Exception) -> Any:
        return finished.output  # type: ignore[attr-defined]

    def recorded(self, told: str) -> Any:
        return json.loads(told)

    def context_tool(self, seen: list[tuple[str | None, dict[str, Any]]], **options: Any) -> Any:
        from pydantic_ai import RunContext  # noqa: PLC0415 - Pydantic AI is optional

        @self.module.approval_tool(channel="payments", **options)
        async def refund_order(ctx: RunContext[Any], order_id: str, amount_cents: int = 100) -> str:
            """Refund an order."""
            seen.append((ctx.tool_call_id, {"order_id": order_id, "amount_cents": amount_cents}))
            return "refunded"

        return refund_order

    def plain_tool_needing_approval(self, made: list[str]) -> Any:
        def refund_order(order_id: str, amount_cents: int) -> str:
            """Refund an order."""
            made.append(order_id)
            return "ok"

        return self.ai.Tool(refund_order, requires_approval=True)

    async def approve_without_the_console(self, agent: Any) -> None:
        outputs = [str, self.ai.DeferredToolRequests]
        result = await agent.run("Refund order o-42.", output_type=outputs)
        assert isinstance(result.output, self.ai.DeferredToolRequests)
        approvals = {call.tool_call_id: True for call in result.output.approvals}
        await agent.run(
            message_history=result.all_messages(),
            deferred_tool_results=self.ai.DeferredToolResults(approvals=approvals),
            output_type=outputs,
        )


ADAPTERS = {"openai_agents": OpenAIAgents, "pydantic_ai": PydanticAI}


class Refunds:
    """The payment system: counts every refund it is asked for (deliberately not idempotent)."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.made: list[tuple[str, int]] = []
        self.die = False
        self.fail = False

    def tool(self, **options: Any) -> Any:
        @self.adapter.module.approval_tool(channel="payments", rationale="the parcel never arrived", **options)
        def refund_order(order_id: str, amount_cents: int) -> dict[str, Any]:
            """Refund an order."""
            self.made.append((order_id, amount_cents))
            if self.die:
                raise ProcessDied  # the process dies after the refund, before its report
            if self.fail:
                raise RuntimeError("the bank said no")
            return {"refund_id": f"r-{len(self.made)}", "amount_cents": amount_cents}

        return refund_order
