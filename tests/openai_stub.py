"""A local OpenAI-compatible chat-completions server for tests: never the internet.

It answers `POST /v1/chat/completions` from a script, a queue of responses built with the helpers below
(`text`, `tool_calls`, `refusal`, `error`), or with a callable `responder(request_json) -> response` for a test
that answers from the conversation. When the script is empty it answers its `default` (a response or a responder),
or else 500 with a message saying so. It records every request body (`requests`) and its headers (`headers`), and
counts the calls (`calls`).

    def test_it(openai_stub):            # the fixture points settings.MODEL_BASE_URL at the stub
        openai_stub.script(error(429), text('{"ok": true}'))

A real worker process reaches it over TCP: `start_worker(**openai_stub.env)`.
"""

from __future__ import annotations

import functools
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

API_KEY = "sk-stub-key"

Response = dict  # {"status": int, "body": dict | str, "delay": seconds}
Responder = Callable[[dict], Response]

_ids = itertools.count(1)


def error(status: int, body: dict | str | None = None, *, delay: float = 0) -> Response:
    """An error answer, by default with the body OpenAI sends; `delay` seconds first (to trigger a timeout)."""
    body = {"error": {"message": f"stub error {status}", "type": "stub", "code": None}} if body is None else body
    return {"status": status, "body": body, "delay": delay}


def completion(
    message: dict, *, finish_reason: str = "stop", prompt_tokens: int = 10, completion_tokens: int = 5, delay=0
) -> Response:
    """A chat completion with one choice, in the shape the SDK parses."""
    return {
        "status": 200,
        "delay": delay,
        "body": {
            "id": f"chatcmpl-stub{next(_ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "",  # the request's model, filled in when served
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        },
    }


def text(content: str, *, prompt_tokens: int = 10, completion_tokens: int = 5, **kwargs) -> Response:
    """A plain answer (`content`: a JSON string for `complete`)."""
    message = {"role": "assistant", "content": content, "refusal": None}
    return completion(message, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, **kwargs)


def tool_calls(calls: list[tuple[str, dict | str]], content: str | None = None, **kwargs) -> Response:
    """An answer that calls tools: each (name, arguments), arguments a dict (sent as JSON) or a raw string (sent
    as it is, to test arguments that are not valid JSON)."""
    message = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "tool_calls": [
            {
                "id": f"call_stub{next(_ids)}",
                "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
            for name, args in calls
        ],
    }
    return completion(message, finish_reason="tool_calls", **kwargs)


def refusal(reason: str, **kwargs) -> Response:
    return completion({"role": "assistant", "content": None, "refusal": reason}, **kwargs)


class OpenAIStub:
    """The server, on 127.0.0.1 and a free port, in a daemon thread; a context manager (`with OpenAIStub() as
    stub:`), or `start()` and `stop()`."""

    def __init__(self, *responses: Response | Responder, default: Response | Responder | None = None):
        self.default = default
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self._script: deque = deque(responses)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._server: ThreadingHTTPServer | None = None

    @property
    def calls(self) -> int:
        with self._lock:
            return len(self.requests)

    @property
    def url(self) -> str:
        """The base URL, as MODEL_BASE_URL takes it."""
        return f"http://127.0.0.1:{self._server.server_port}/v1"

    @property
    def env(self) -> dict:
        """The environment that points a worker process at the stub."""
        return {"MODEL_BASE_URL": self.url, "MODEL_API_KEY": API_KEY}

    def script(self, *responses: Response | Responder) -> None:
        """Queue answers, served one per request in order."""
        with self._lock:
            self._script.extend(responses)

    def start(self) -> OpenAIStub:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        serve = functools.partial(self._server.serve_forever, poll_interval=0.05)  # a quick stop()
        threading.Thread(target=serve, daemon=True, name="openai-stub").start()
        return self

    def stop(self) -> None:
        self._stopped.set()  # wakes delayed answers
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OpenAIStub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _answer(self, request: dict, headers: dict) -> Response:
        with self._lock:
            self.requests.append(request)
            self.headers.append(headers)
            answer = self._script.popleft() if self._script else self.default
        if callable(answer):
            answer = answer(request)
        if answer is None:
            return error(500, {"error": {"message": "the OpenAI stub's script is empty", "type": "stub"}})
        return answer

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.0: one request per connection, so that no idle keep-alive connection outlives the stub.
            protocol_version = "HTTP/1.0"

            def do_POST(self):  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(error(404, {"error": {"message": f"no route {self.path}"}}))
                request = json.loads(body or b"{}")
                answer = stub._answer(request, {k.lower(): v for k, v in self.headers.items()})
                if answer.get("delay") and stub._stopped.wait(answer["delay"]):
                    return None
                body = answer.get("body", "")
                if isinstance(body, dict) and body.get("object") == "chat.completion":
                    body = {**body, "model": body["model"] or request.get("model", "")}
                return self._send(answer, body)

            def _send(self, answer: Response, body=None) -> None:
                body = answer.get("body", "") if body is None else body
                payload = (body if isinstance(body, str) else json.dumps(body)).encode()
                try:
                    self.send_response(answer["status"])
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass  # the client gave up (a timeout test)

            def log_message(self, *args):
                pass

        return Handler


@pytest.fixture
def openai_stub(settings):
    """A running stub, with settings.MODEL_BASE_URL and MODEL_API_KEY pointing at it (in this process)."""
    with OpenAIStub() as stub:
        settings.MODEL_BASE_URL = stub.url
        settings.MODEL_API_KEY = API_KEY
        yield stub
