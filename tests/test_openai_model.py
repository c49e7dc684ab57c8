"""The OpenAI-compatible model client, against a small chat-completions server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from demo.model import ScriptedModel
from runs.llm import OpenAICompatibleModel, model_for_run
from runs.models import Run
from runs.workflow import Fatal, Retryable


class _ChatServer(BaseHTTPRequestHandler):
    status = 200
    body: dict | str = {}
    seen: list = []

    def do_POST(self):  # noqa: N802 - the http.server API
        length = int(self.headers["Content-Length"])
        type(self).seen.append((self.path, self.headers["Authorization"], json.loads(self.rfile.read(length))))
        payload = self.body if isinstance(self.body, str) else json.dumps(self.body)
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(payload.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def chat(settings):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ChatServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    settings.MODEL_BASE_URL = f"http://127.0.0.1:{server.server_port}/v1"
    settings.MODEL_API_KEY = "sk-test"
    _ChatServer.seen = []
    yield _ChatServer
    server.shutdown()
    server.server_close()


@pytest.fixture
def run(db):
    return Run(workflow="refund", workflow_version=1, input={"amount_cents": 100})


def _answer(content: dict) -> dict:
    return {
        "choices": [{"message": {"content": json.dumps(content)}}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 30},
    }


def test_it_is_used_when_an_endpoint_is_configured(chat, run, settings):
    assert isinstance(model_for_run(run, "classify"), OpenAICompatibleModel)
    settings.MODEL_BASE_URL = ""
    assert isinstance(model_for_run(run, "classify"), ScriptedModel)


def test_it_returns_the_json_answer_and_counts_tokens(chat, run):
    chat.status, chat.body = 200, _answer({"category": "damaged_item"})
    model = OpenAICompatibleModel(run, "classify")
    assert model.complete("classify", reason="broken") == {"category": "damaged_item"}
    assert (model.usage.tokens_in, model.usage.tokens_out) == (120, 30) and model.usage.cost > 0
    path, auth, request = chat.seen[0]
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
    assert json.loads(request["messages"][1]["content"]) == {"reason": "broken"}


@pytest.mark.parametrize(("status", "error"), [(429, Retryable), (503, Retryable), (400, Fatal), (401, Fatal)])
def test_http_errors_are_classified(chat, run, status, error):
    chat.status, chat.body = status, {"error": "nope"}
    with pytest.raises(error):
        OpenAICompatibleModel(run, "classify").complete("classify")


def test_an_answer_that_is_not_json_is_retryable(chat, run):
    chat.status, chat.body = 200, {"choices": [{"message": {"content": "I think it is damaged."}}]}
    with pytest.raises(Retryable, match="not the JSON"):
        OpenAICompatibleModel(run, "classify").complete("classify")


def test_an_unreachable_endpoint_is_retryable(run, settings):
    settings.MODEL_BASE_URL = "http://127.0.0.1:9/v1"  # discard port: nothing listens
    with pytest.raises(Retryable, match="unreachable"):
        OpenAICompatibleModel(run, "classify").complete("classify")
