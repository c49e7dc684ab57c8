"""Standard Webhooks signatures (https://www.standardwebhooks.com), for the deliveries we receive
(runs.webhooks) and the notifications we send (approvals.notify).

A message carries `webhook-id`, `webhook-timestamp` (unix seconds) and `webhook-signature: v1,<base64
HMAC-SHA256 of "<id>.<timestamp>.<raw body>">`, several space-separated while a secret rotates. The id is under
the signature: a captured message resent under a new id (to pass the receiver's dedup) no longer verifies, and
the timestamp bounds how long the same id and body can be replayed at all.

A secret is `whsec_<base64>`, as Standard Webhooks writes it (the key is the decoded bytes), or any other
string, whose UTF-8 bytes are the key (so `demo-secret` keeps working). Several, comma-separated, during a
rotation: we accept a signature by any of them, and sign with each.

Signing uses the `standardwebhooks` library (its `Webhook(key).sign`). Verifying does not use its
`Webhook.verify` (1.1.0), which does not fit a receiver here: its tolerance is a fixed 5 minutes on its own
clock (ours is WEBHOOK_TOLERANCE_SECONDS); it decodes the body as UTF-8 and raises UnicodeDecodeError for other
bytes (a signed delivery with such a body must be answered 400 and recorded); a signature entry without a comma
or with bad base64 raises ValueError, not its verification error (a 500, not a 401). Nor is a secret handed to
it as a string: without the prefix it is base64-decoded leniently (`demo-secret` becomes 7 unrelated bytes), so
it gets the key's bytes. The check below is the specification's, over the raw bytes; the tests check that it
accepts what the library signs and that the library verifies what we sign.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from standardwebhooks import Webhook

SECRET_PREFIX = "whsec_"
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")


class BadSignature(Exception):
    """Why a message is not taken as signed: its `detail` is the answer's (401)."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


def secret_list(value: str) -> list[str]:
    """The secrets in a comma-separated setting, as WEBHOOK_SECRET_<SOURCE> lists them."""
    return [item.strip() for item in value.split(",") if item.strip()]


def key(secret: str) -> bytes:
    """The HMAC key of a secret: a `whsec_` one's base64-decoded bytes, else the string's UTF-8 bytes. Raises
    ValueError for an empty secret or a `whsec_` one that is not base64."""
    if secret.startswith(SECRET_PREFIX):
        encoded = secret.removeprefix(SECRET_PREFIX)
        try:
            decoded = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
        except binascii.Error:
            raise ValueError(f"a {SECRET_PREFIX} secret must be base64 after its prefix") from None
        if not decoded:
            raise ValueError(f"a {SECRET_PREFIX} secret must not be empty after its prefix")
        return decoded
    if not secret:
        raise ValueError("a webhook secret must not be empty")
    return secret.encode()


def sign(secrets: Sequence[str], msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value: one v1 signature per secret, space-separated (the new and the old one
    while a secret rotates, so a receiver that knows either verifies it)."""
    when = datetime.fromtimestamp(timestamp, tz=UTC)
    return " ".join(Webhook(key(secret)).sign(msg_id, when, body.decode()) for secret in secrets)


def signed_headers(secrets: Sequence[str], msg_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The three headers of a message we send now."""
    timestamp = int(time.time() if now is None else now)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secrets, msg_id, timestamp, body),
    }


def verify(
    secrets: Sequence[str], headers: Mapping[str, str], body: bytes, *, tolerance: float, now: float | None = None
) -> None:
    """Raises BadSignature unless `webhook-timestamp` is within `tolerance` seconds of our clock either way and
    a v1 signature in `webhook-signature` is one of the secrets' over `webhook-id`, the timestamp and the raw
    body. An absent `webhook-id` is signed as empty (the receiver then refuses the message for lacking one)."""
    headers = {name.lower(): value for name, value in headers.items()}
    timestamp = headers.get("webhook-timestamp", "").strip()
    if not timestamp:
        raise BadSignature("The webhook-timestamp header (unix seconds) is missing.")
    if not _TIMESTAMP.match(timestamp):
        raise BadSignature("The webhook-timestamp header must be unix seconds.")
    now = time.time() if now is None else now
    if abs(now - int(timestamp)) > tolerance:
        raise BadSignature(f"The webhook-timestamp is more than {tolerance:g} s away from the server's clock.")

    given = _signatures(headers.get("webhook-signature", ""))
    signed_content = f"{headers.get('webhook-id', '')}.{timestamp}.".encode() + body
    expected = [hmac.new(key(secret), signed_content, hashlib.sha256).digest() for secret in secrets]
    # Every pair is compared, each in constant time, so which secret matched (or how close) does not show.
    matches = [hmac.compare_digest(want, got) for want in expected for got in given]
    if not any(matches):
        raise BadSignature("The signature does not match.")


def _signatures(header: str) -> list[bytes]:
    """The v1 signatures in a `webhook-signature` value. Entries of another version (e.g. `v1a`, asymmetric)
    are skipped, as the specification says; an entry that is not `<version>,<base64>` makes the whole header
    malformed."""
    if not header.strip():
        raise BadSignature("The webhook-signature header is missing.")
    malformed = BadSignature(
        "The webhook-signature header must be 'v1,<base64 HMAC-SHA256>' signatures, separated by spaces."
    )
    signatures = []
    for entry in header.split():
        version, comma, value = entry.partition(",")
        if not comma or not version or not value:
            raise malformed
        if version != "v1":
            continue
        try:
            signatures.append(base64.b64decode(value, validate=True))
        except binascii.Error:
            raise malformed from None
    if not signatures:
        raise BadSignature("The webhook-signature header holds no v1 signature.")
    return signatures
