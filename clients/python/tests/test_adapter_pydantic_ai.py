"""What only the Pydantic AI adapter has (the scenarios it shares with the OpenAI Agents SDK's are
test_run_with_approvals.py): a call approved inside Pydantic AI itself, and the run's own options."""

from __future__ import annotations

import pytest
from approval_runs import Model, PydanticAI, Refunds

ASKED = {"order_id": "o-42", "amount_cents": 500}


@pytest.fixture
def adapter() -> PydanticAI:
    return PydanticAI()


def test_a_call_approved_inside_pydantic_ai_is_refused_even_under_run_with_approvals(adapter, console):
    # Pydantic AI's own inline handler approves every deferred call: the tool is reached with no card asked.
    capabilities = pytest.importorskip("pydantic_ai.capabilities", reason="no capabilities in this Pydantic AI")
    refunds, model = Refunds(adapter), Model([("refund_order", ASKED)])
    approve_all = capabilities.HandleDeferredToolCalls(
        handler=lambda ctx, requests: requests.build_results(approve_all=True)
    )

    with pytest.raises(adapter.module.NoApprovalSession, match="did not ask the console"):
        adapter.run(console, adapter.agent(model, refunds.tool()), capabilities=[approve_all])
    assert refunds.made == [] and console.seen == []


def test_the_history_and_the_deferred_results_are_run_with_approvals_own(adapter, console):
    model = Model([("refund_order", ASKED)])
    agent = adapter.agent(model, Refunds(adapter).tool())
    for option in ("message_history", "deferred_tool_results"):
        with pytest.raises(TypeError, match=option):
            adapter.run(console, agent, **{option: None})
    assert console.seen == [] and model.requests == []
