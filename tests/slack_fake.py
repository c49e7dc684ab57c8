"""Slack for tests: a local fake of its Web API, and clicks signed as Slack signs them. Never the internet.

`FakeSlack` is a threaded HTTP server that answers the Web API methods slack_sdk's WebClient calls
(`POST <base_url>chat.postMessage`, `chat.update`) with `{"ok": true, "channel": ..., "ts": ...}` as Slack does,
and takes the POSTs Slack's `response_url`s get (`/actions/...`). It records each call: `calls(method)` gives the
JSON bodies, `responses()` the ephemeral answers. `fail_next(n)` answers the next n Web API calls 500.

`click(...)` is a block_actions payload in the shape Slack documents (docs.slack.dev, "block_actions payloads"),
and `signed(payload, secret)` its request: the form-encoded `payload=<json>` body and the v0 headers,
HMAC-SHA256 computed here with the standard library (not by the code under test)."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlencode

from tests.serving import serve_in_thread

BOT_TOKEN = "xoxb-test-token"
SIGNING_SECRET = "test-slack-signing-secret"
TEAM = "T0TESTTEAM"


class FakeSlack:
    def __init__(self):
        self.requests: list[dict] = []  # {"path", "headers", "json"}
        self._failures = 0
        self._ts = itertools.count(1)
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"raw": raw.decode("utf-8", "replace")}
                status, answer = fake._answer(self.path, dict(self.headers), body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.api_url = f"{self.url}/api/"  # WebClient(base_url=...)
        self.hooks_url = f"{self.url}/actions/"  # where response_urls point
        serve_in_thread(self.server)

    def _answer(self, path: str, headers: dict, body: dict) -> tuple[int, dict]:
        with self._lock:
            self.requests.append({"path": path, "headers": headers, "json": body})
            if path.startswith("/actions/"):
                return 200, {"ok": True}
            if self._failures:
                self._failures -= 1
                return 500, {"ok": False, "error": "internal_error"}
            if headers.get("Authorization") != f"Bearer {BOT_TOKEN}":
                return 200, {"ok": False, "error": "invalid_auth"}
            channel = body.get("channel", "")
            # A direct message to a member is posted in its own conversation, as Slack does.
            channel = "D" + channel[1:] if channel.startswith("U") else channel
            ts = body.get("ts") or f"{int(time.time())}.{next(self._ts):06d}"
            return 200, {"ok": True, "channel": channel, "ts": ts, "message": {"text": body.get("text", "")}}

    def fail_next(self, count: int) -> None:
        with self._lock:
            self._failures = count

    def calls(self, method: str) -> list[dict]:
        """The JSON bodies of the Web API calls of `method` (chat.postMessage, chat.update), in order."""
        with self._lock:
            return [r["json"] for r in self.requests if r["path"] == f"/api/{method}"]

    def responses(self) -> list[dict]:
        """What was posted to response_urls (the clickers' ephemeral answers)."""
        with self._lock:
            return [r["json"] for r in self.requests if r["path"].startswith("/actions/")]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """Slack's v0 signature: HMAC-SHA256 of `v0:<timestamp>:<body>`, hex, under the signing secret."""
    return "v0=" + hmac.new(secret.encode(), b"v0:" + timestamp.encode() + b":" + body, hashlib.sha256).hexdigest()


def signed(payload: dict, secret: str = SIGNING_SECRET, timestamp: int | None = None) -> tuple[bytes, dict]:
    """The request Slack sends for `payload`: (body, headers)."""
    body = urlencode({"payload": json.dumps(payload)}).encode()
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    headers = {
        "Content-Type": "application/x-www-form-urlencoded",
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": signature(secret, stamp, body),
    }
    return body, headers


def click(
    card_id: int,
    version: int,
    *,
    action: str = "approve",
    user: str = "U0BOB",
    team: str = TEAM,
    comment: str | None = None,
    response_url: str = "https://hooks.slack.com/actions/T0TESTTEAM/1/abc",
    channel: str = "C0PAYMENTS",
    message_ts: str = "1700000000.000100",
) -> dict:
    """A block_actions payload for a click on one of the card message's buttons (approve or reject)."""
    value = json.dumps({"card": card_id, "version": version}, separators=(",", ":"))
    return {
        "type": "block_actions",
        "user": {"id": user, "username": "someone", "name": "someone", "team_id": team},
        "api_app_id": "A0TESTAPP",
        "token": "verification-token-not-used",
        "container": {"type": "message", "message_ts": message_ts, "channel_id": channel, "is_ephemeral": False},
        "trigger_id": "123.456.abc",
        "team": {"id": team, "domain": "example"},
        "enterprise": None,
        "is_enterprise_install": False,
        "channel": {"id": channel, "name": "payments-approvals"},
        "message": {"type": "message", "ts": message_ts, "text": f"Card {card_id}", "blocks": []},
        "state": {"values": {"hitl_comment": {"comment": {"type": "plain_text_input", "value": comment}}}},
        "response_url": response_url,
        "actions": [
            {
                "action_id": f"hitl_{action}",
                "block_id": f"hitl_card_{card_id}",
                "text": {"type": "plain_text", "text": action.capitalize(), "emoji": True},
                "value": value,
                "style": "primary" if action == "approve" else "danger",
                "type": "button",
                "action_ts": f"{time.time():.6f}",
            }
        ],
    }
