"""The OpenAI-compatible model client (runs.llm, on the openai SDK), against the local stub (tests.openai_stub)."""

from __future__ import annotations

import json
import socket
from decimal import Decimal

import pytest

from core.models import AuditEntry
from demo.model import ScriptedModel
from jobs.models import DeadLetter
from runs import submission
from runs.llm import Model, OpenAICompatibleModel, model_for_run
from runs.models import Run, Step
from runs.workflow import Fatal, Retryable, Workflow, register
from tests.engine_helpers import drive
from tests.openai_stub import API_KEY, error, refusal, text, tool_calls

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup_customer",
        "description": "The customer's record.",
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
    },
}
MESSAGES = [{"role": "user", "content": "Refund order 17, please."}]


@pytest.fixture
def run(db):
    return Run(workflow="refund", workflow_version=1, input={"amount_cents": 100})


@pytest.fixture
def model(openai_stub, run):
    return OpenAICompatibleModel(run, "agent")


def test_it_is_used_when_an_endpoint_is_configured(openai_stub, run, settings):
    assert isinstance(model_for_run(run, "classify"), OpenAICompatibleModel)
    assert model_for_run(run, "classify").name == settings.MODEL_NAME
    settings.MODEL_BASE_URL = ""
    assert isinstance(model_for_run(run, "classify"), ScriptedModel)


# --- chat: one turn with tool calling --------------------------------------------------------------------------------


def test_chat_returns_tool_calls_as_a_chat_message(openai_stub, run, settings):
    settings.MODEL_NAME = "gpt-4o-mini"
    model = OpenAICompatibleModel(run, "agent")
    calls = [("lookup_customer", {"id": "cus_1"}), ("lookup_orders", '{"customer": "cus_1"')]
    openai_stub.script(tool_calls(calls, prompt_tokens=1000, completion_tokens=200))
    message = model.chat(MESSAGES, [LOOKUP])
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": message["tool_calls"][0]["id"],
                "type": "function",
                "function": {"name": "lookup_customer", "arguments": '{"id": "cus_1"}'},
            },
            {
                "id": message["tool_calls"][1]["id"],
                "type": "function",
                "function": {"name": "lookup_orders", "arguments": '{"customer": "cus_1"'},  # as sent, invalid
            },
        ],
    }
    assert json.loads(json.dumps(message)) == message  # JSON-able, to be recorded as a step's output
    assert (model.usage.tokens_in, model.usage.tokens_out) == (1000, 200)
    assert model.usage.cost == Decimal("0.15") * 1000 / 10**6 + Decimal("0.60") * 200 / 10**6

    (request,) = openai_stub.requests
    assert request["model"] == "gpt-4o-mini" and request["tools"] == [LOOKUP] and request["tool_choice"] == "auto"
    assert request["messages"] == MESSAGES
    assert openai_stub.headers[0]["authorization"] == f"Bearer {API_KEY}"


def test_chat_returns_a_text_answer_and_prices_an_unknown_model_at_the_default(openai_stub, model, settings):
    model.name = "my-local-llama"
    openai_stub.script(text("Refunded.", prompt_tokens=500, completion_tokens=100))
    assert model.chat(MESSAGES, [LOOKUP]) == {"role": "assistant", "content": "Refunded.", "tool_calls": []}
    price_in, price_out = map(Decimal, settings.MODEL_DEFAULT_PRICE)
    assert model.usage.cost == (price_in * 500 + price_out * 100) / 10**6
    assert openai_stub.requests[0]["model"] == "my-local-llama"


def test_a_recorded_turn_goes_back_as_a_message_with_the_tool_results(openai_stub, model):
    openai_stub.script(tool_calls([("lookup_customer", {"id": "cus_1"})]), text("I asked."), text("Done."))
    turn = model.chat(MESSAGES, [LOOKUP])
    result = {"role": "tool", "tool_call_id": turn["tool_calls"][0]["id"], "content": '{"name": "Ada"}'}
    answer = model.chat([*MESSAGES, turn, result], [LOOKUP])
    assert answer["content"] == "I asked."
    assert openai_stub.requests[1]["messages"] == [*MESSAGES, turn, result]
    # A text turn's `tool_calls: []` is left out of the request: OpenAI refuses an empty array.
    model.chat([*MESSAGES, turn, result, answer, {"role": "user", "content": "Thanks"}], [])
    assert openai_stub.requests[2]["messages"][3] == {"role": "assistant", "content": "I asked."}
    assert "tools" not in openai_stub.requests[2] and "tool_choice" not in openai_stub.requests[2]


def test_a_responder_answers_from_the_conversation(openai_stub, model):
    openai_stub.default = lambda request: text(f"you said {request['messages'][-1]['content']}")
    assert model.chat(MESSAGES, [])["content"] == "you said Refund order 17, please."
    assert model.chat(MESSAGES, [])["content"] == "you said Refund order 17, please."
    assert openai_stub.calls == 2


def test_an_empty_answer_is_retryable(openai_stub, model):
    openai_stub.script(text(""))
    with pytest.raises(Retryable, match="empty"):
        model.chat(MESSAGES, [LOOKUP])


def test_a_model_without_tool_calling_says_so(run):
    with pytest.raises(Fatal, match="cannot call tools"):
        Model(run, "agent").chat(MESSAGES, [LOOKUP])


# --- errors, classified for the engine -------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 500, 503])
def test_429_and_5xx_are_retryable_and_name_the_status(openai_stub, model, status):
    openai_stub.script(error(status))
    with pytest.raises(Retryable, match=rf"\b{status}\b"):
        model.chat(MESSAGES, [LOOKUP])
    assert openai_stub.calls == 1  # the SDK does not retry: the engine does


@pytest.mark.parametrize("status", [400, 401, 404])
def test_other_4xx_are_fatal_with_the_body(openai_stub, model, status):
    openai_stub.script(error(status, {"error": {"message": "tools[0] is not a valid tool"}}))
    with pytest.raises(Fatal, match=rf"{status}.*not a valid tool"):
        model.chat(MESSAGES, [LOOKUP])
    assert openai_stub.calls == 1


def test_a_slow_answer_is_a_retryable_timeout(openai_stub, model, settings):
    settings.MODEL_TIMEOUT_SECONDS = 0.3
    openai_stub.script(text("late", delay=5))
    with pytest.raises(Retryable, match="timed out"):
        model.chat(MESSAGES, [LOOKUP])
    assert openai_stub.calls == 1


def test_a_refused_connection_is_retryable(run, settings):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        settings.MODEL_BASE_URL = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    with pytest.raises(Retryable, match="unreachable"):
        OpenAICompatibleModel(run, "agent").chat(MESSAGES, [LOOKUP])


def test_a_refusal_is_fatal_and_its_tokens_are_counted(openai_stub, model):
    openai_stub.script(refusal("I can't help with that.", prompt_tokens=40, completion_tokens=8))
    with pytest.raises(Fatal, match="refused: I can't help"):
        model.chat(MESSAGES, [LOOKUP])
    assert (model.usage.tokens_in, model.usage.tokens_out) == (40, 8)


def test_a_filtered_answer_is_fatal(openai_stub, model):
    openai_stub.script(text("", finish_reason="content_filter"))
    with pytest.raises(Fatal, match="content filter"):
        model.chat(MESSAGES, [LOOKUP])


def test_an_answer_without_choices_is_retryable(openai_stub, model):
    answer = text("x")
    answer["body"]["choices"] = []
    openai_stub.script(answer)
    with pytest.raises(Retryable, match="no choices"):
        model.chat(MESSAGES, [LOOKUP])


def test_an_empty_script_answers_500_with_a_clear_message(openai_stub, model):
    with pytest.raises(Retryable, match="500"):
        model.chat(MESSAGES, [LOOKUP])
    assert "script is empty" in str(_cause(model))


def _cause(model) -> BaseException:
    try:
        model.chat(MESSAGES, [])
    except Retryable as exc:
        return exc.__cause__


# --- complete: a JSON answer for a fixed step ------------------------------------------------------------------------


def test_complete_returns_the_json_object_and_counts_tokens(openai_stub, model):
    openai_stub.script(text('{"category": "damaged_item"}', prompt_tokens=120, completion_tokens=30))
    assert model.complete("classify", reason="broken") == {"category": "damaged_item"}
    assert (model.usage.tokens_in, model.usage.tokens_out) == (120, 30) and model.usage.cost > 0
    (request,) = openai_stub.requests
    assert request["response_format"] == {"type": "json_object"} and "tools" not in request
    assert json.loads(request["messages"][1]["content"]) == {"reason": "broken"}


@pytest.mark.parametrize("content", ["I think it is damaged.", '["damaged_item"]'])
def test_complete_classifies_an_answer_that_is_not_a_json_object_as_retryable(openai_stub, model, content):
    openai_stub.script(text(content))
    with pytest.raises(Retryable, match="not the JSON"):
        model.complete("classify")


def test_the_scripted_model_is_priced_as_scripted(run, settings):
    settings.MODEL_PRICES = {**settings.MODEL_PRICES, "scripted": ("1000000", "0")}
    model = ScriptedModel(run, "classify")
    model._account(3, 1000)
    assert model.name == "scripted" and model.usage.cost == 3  # $1M per million input tokens


# --- in the engine: a fixed workflow whose compute step asks the model -----------------------------------------------

asks_the_model = register(Workflow("test_asks_the_model"))


@asks_the_model.compute
def classify(ctx):
    return ctx.model.complete("classify", reason="Item arrived damaged")


def _retry_causes(run: Run) -> list[str]:
    return [e.data["cause"] for e in AuditEntry.objects.filter(action="run.retry", run_id=run.id)]


def test_a_429_is_retried_then_the_run_succeeds_with_its_usage(openai_stub, db, settings):
    settings.MODEL_NAME = "gpt-4o"
    openai_stub.script(error(429), text('{"category": "damaged_item"}', prompt_tokens=2000, completion_tokens=100))
    run, _ = submission.submit(workflow="test_asks_the_model", input={})
    with pytest.raises(Retryable, match="429"):
        drive(run, attempts=0)
    run = drive(run, attempts=1)
    assert run.status == Run.Status.SUCCEEDED and run.result == {"category": "damaged_item"}
    step = Step.objects.get(run=run, name="classify")
    expected = Decimal("2.50") * 2000 / 10**6 + Decimal("10.00") * 100 / 10**6
    assert (step.tokens_in, step.tokens_out, step.cost) == (2000, 100, expected)
    assert (run.tokens_in, run.cost) == (2000, expected)
    assert _retry_causes(run) == ["model_429"]
    assert openai_stub.calls == 2


def test_a_500_on_every_attempt_ends_in_the_dead_letter_queue(openai_stub, db):
    openai_stub.default = error(500)
    run, _ = submission.submit(workflow="test_asks_the_model", input={})
    for attempt in range(run.max_attempts - 1):
        with pytest.raises(Retryable):
            drive(run, attempts=attempt)
    run = drive(run, attempts=run.max_attempts - 1)
    assert run.status == Run.Status.FAILED
    letter = DeadLetter.objects.get(run_id=run.id)
    assert letter.attempts == run.max_attempts and letter.step == "classify" and "500" in letter.error
    assert _retry_causes(run) == ["model_5xx"] * (run.max_attempts - 1)
    assert openai_stub.calls == run.max_attempts


def test_a_400_is_dead_lettered_at_once(openai_stub, db):
    openai_stub.default = error(400, {"error": {"message": "Unknown parameter: 'response_format'."}})
    run, _ = submission.submit(workflow="test_asks_the_model", input={})
    run = drive(run)  # no exception: nothing for the job to retry
    assert run.status == Run.Status.FAILED
    letter = DeadLetter.objects.get(run_id=run.id)
    assert letter.error_class == "Fatal" and "400" in letter.error and "response_format" in letter.error
    assert openai_stub.calls == 1 and not _retry_causes(run)
