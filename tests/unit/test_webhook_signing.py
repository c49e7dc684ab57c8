"""Standard Webhooks signatures (core.webhook_signing): what we sign and what we accept, checked against the
specification's own test vector, a signature worked out here apart from the code under test, and the
`standardwebhooks` library both ways. That a delivery refused by it is answered 401 and records nothing, and that
the settings' secrets and tolerance are the ones the endpoint uses: tests/integration/runs/test_webhooks.py."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from datetime import UTC, datetime

import pytest
import standardwebhooks
from django.core.exceptions import ImproperlyConfigured
from standardwebhooks.webhooks import WebhookVerificationError

from core import webhook_signing
from core.webhook_signing import BadSignature
from tests.settings_of import settings_of

SECRET = "demo-secret"
WHSEC = "whsec_" + base64.b64encode(b"the 32-byte key of a whsec secret").decode()
BODY = json.dumps({"customer_id": "c-1", "amount_cents": 1200}).encode()
TOLERANCE = 300


def signature(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """What a provider computes (Standard Webhooks), worked out here apart from the code under test: `v1,` and
    the base64 HMAC-SHA256 of "<id>.<timestamp>.<body>" under the key (a `whsec_` secret's decoded bytes, else
    the string's UTF-8 bytes)."""
    key = base64.b64decode(secret.removeprefix("whsec_")) if secret.startswith("whsec_") else secret.encode()
    digest = hmac.new(key, f"{delivery_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed(
    body: bytes, *, delivery_id: str | None = "dlv-1", secret: str = SECRET, timestamp: int | str | None = None
) -> dict:
    """The headers of a delivery: without an id (None), signed over an empty one."""
    timestamp = str(int(time.time()) if timestamp is None else timestamp)
    headers = {
        "webhook-timestamp": timestamp,
        "webhook-signature": signature(secret, delivery_id or "", timestamp, body),
    }
    if delivery_id is not None:
        headers["webhook-id"] = delivery_id
    return headers


def verify(headers: dict, body: bytes = BODY, secrets: list[str] | None = None, **kwargs) -> None:
    webhook_signing.verify(secrets or [SECRET], headers, body, tolerance=TOLERANCE, **kwargs)


# --- signing ----------------------------------------------------------------------------------------------------


def test_a_signature_covers_the_id_the_timestamp_and_the_body():
    body = b'{"a": 1}'
    expected = hmac.new(b"demo-secret", b"dlv-7.1700000000." + body, hashlib.sha256).digest()
    assert (
        webhook_signing.sign(["demo-secret"], "dlv-7", 1700000000, body) == "v1," + base64.b64encode(expected).decode()
    )
    # Two secrets (a rotation): one signature each, space-separated, in the order given.
    both = webhook_signing.sign(["demo-secret", WHSEC], "dlv-7", 1700000000, body)
    assert both == " ".join(signature(s, "dlv-7", "1700000000", body) for s in ("demo-secret", WHSEC))


def test_it_reproduces_and_accepts_the_standard_webhooks_test_vector():
    """The specification's published example: secret, id, timestamp, body and the signature they make."""
    secret, msg_id, timestamp, body = (
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "msg_p5jXN8AQM9LWM0D4loKWxJek",
        1614265330,
        b'{"test": 2432232314}',
    )
    expected = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

    assert webhook_signing.sign([secret], msg_id, timestamp, body) == expected
    headers = {"webhook-id": msg_id, "webhook-timestamp": str(timestamp), "webhook-signature": expected}
    webhook_signing.verify([secret], headers, body, tolerance=300, now=timestamp + 299)
    with pytest.raises(BadSignature, match="300 s away"):
        webhook_signing.verify([secret], headers, body, tolerance=300, now=timestamp + 301)
    with pytest.raises(BadSignature, match="does not match"):
        webhook_signing.verify([secret], {**headers, "webhook-id": "msg_other"}, body, tolerance=300, now=timestamp)


def test_the_headers_we_send_verify_with_the_library_under_each_secret():
    at = webhook_signing.signed_headers([SECRET], "ntf-8", BODY, now=1_700_000_000.9)
    assert (at["webhook-id"], at["webhook-timestamp"]) == ("ntf-8", "1700000000")
    assert at["webhook-signature"] == signature(SECRET, "ntf-8", "1700000000", BODY)
    # The library checks the timestamp against its own clock: headers made now.
    headers = webhook_signing.signed_headers([WHSEC, "old-one"], "ntf-9", BODY)
    for secret in (WHSEC, "old-one"):
        assert standardwebhooks.Webhook(webhook_signing.key(secret)).verify(BODY, headers) == json.loads(BODY)
    with pytest.raises(WebhookVerificationError):
        standardwebhooks.Webhook(webhook_signing.key("another-one")).verify(BODY, headers)


@pytest.mark.parametrize(
    "secret",
    ["whsec_", "whsec_not*base64", ""],
    ids=["whsec_ and nothing", "whsec_ and not base64", "empty"],
)
def test_a_secret_that_is_no_key_is_refused(secret):
    with pytest.raises(ValueError):
        webhook_signing.key(secret)


def test_a_whsec_secret_without_its_padding_is_still_its_key():
    key = b"sixteen byte key"
    assert webhook_signing.key("whsec_" + base64.b64encode(key).decode().rstrip("=")) == key


def test_secrets_are_listed_comma_separated():
    assert webhook_signing.secret_list(" new-one, old-one ,,") == ["new-one", "old-one"]
    assert webhook_signing.secret_list("") == []


# --- verifying ----------------------------------------------------------------------------------------------------


def test_a_header_with_several_signatures_is_accepted_when_one_of_them_matches():
    """A sender rotating its secret signs with the new and the old one; signatures of another version (v1a:
    asymmetric) are skipped, as the specification says."""
    others = {
        "a signature by another secret": signed(BODY, secret="another-secret")["webhook-signature"],
        "a signature of other bytes": "v1," + base64.b64encode(b"x" * 32).decode(),
        "a signature of another version": "v1a," + base64.b64encode(b"y" * 64).decode(),
    }
    headers = signed(BODY)
    valid = headers["webhook-signature"]
    for other in others.values():
        for first, second in ((other, valid), (valid, other)):
            verify({**headers, "webhook-signature": f"{first} {second}"})


def test_several_signatures_none_of_which_matches_are_refused():
    headers = signed(BODY, secret="another-secret")
    headers["webhook-signature"] += " " + signed(BODY, secret="a-third-secret")["webhook-signature"]
    with pytest.raises(BadSignature) as refused:
        verify(headers)
    assert refused.value.detail == "The signature does not match."


def test_a_rotation_accepts_a_signature_by_any_of_its_secrets():
    for secret in (WHSEC, "old-secret"):
        verify(signed(BODY, secret=secret), secrets=[WHSEC, "old-secret"])
    with pytest.raises(BadSignature, match="does not match"):
        verify(signed(BODY, secret=SECRET), secrets=[WHSEC, "old-secret"])


def test_a_whsec_secret_is_the_key_its_base64_decodes_to():
    timestamp = int(time.time())
    # Signed by the standardwebhooks library itself, as a provider using it would.
    library_signature = standardwebhooks.Webhook(WHSEC).sign(
        "dlv-lib", datetime.fromtimestamp(timestamp, UTC), BODY.decode()
    )
    headers = {"webhook-id": "dlv-lib", "webhook-timestamp": str(timestamp), "webhook-signature": library_signature}
    verify(headers, secrets=[WHSEC])
    verify(signed(BODY, secret=WHSEC), secrets=[WHSEC])
    # The secret's text is not the key: a signature made with its UTF-8 bytes is refused.
    as_text = hmac.new(WHSEC.encode(), f"dlv-text.{timestamp}.".encode() + BODY, hashlib.sha256).digest()
    headers = {
        "webhook-id": "dlv-text",
        "webhook-timestamp": str(timestamp),
        "webhook-signature": "v1," + base64.b64encode(as_text).decode(),
    }
    with pytest.raises(BadSignature, match="does not match"):
        verify(headers, secrets=[WHSEC])


def test_a_plain_secret_is_the_key_its_utf8_bytes_are():
    timestamp = int(time.time())
    library_signature = standardwebhooks.Webhook("démo-secret".encode()).sign(
        "dlv-plain", datetime.fromtimestamp(timestamp, UTC), BODY.decode()
    )
    headers = {"webhook-id": "dlv-plain", "webhook-timestamp": str(timestamp), "webhook-signature": library_signature}
    verify(headers, secrets=["démo-secret"])
    # The library would base64-decode a plain string handed to it as one (into other bytes): not our key.
    lenient = standardwebhooks.Webhook("demo-secret").sign("dlv-b64", datetime.fromtimestamp(timestamp, UTC), "{}")
    headers = {"webhook-id": "dlv-b64", "webhook-timestamp": str(timestamp), "webhook-signature": lenient}
    with pytest.raises(BadSignature, match="does not match"):
        verify(headers, body=b"{}", secrets=["demo-secret"])


def test_a_body_that_is_not_utf8_is_verified_over_its_bytes():
    """The library would raise UnicodeDecodeError; a signed delivery with such a body must reach the endpoint's
    400 (and be recorded), not a 500."""
    body = b'{"note": "\xff"}'
    verify(signed(body), body=body)


def test_the_tolerance_is_the_callers_either_way():
    now = int(time.time())
    for offset in (-290, 290):
        verify(signed(BODY, timestamp=now + offset))
    for offset in (-500, 500):
        webhook_signing.verify([SECRET], signed(BODY, timestamp=now + offset), BODY, tolerance=600, now=now)
    for offset in (-90, 90):
        with pytest.raises(BadSignature) as refused:
            webhook_signing.verify([SECRET], signed(BODY, timestamp=now + offset), BODY, tolerance=60, now=now)
        assert refused.value.detail == "The webhook-timestamp is more than 60 s away from the server's clock."


def test_header_names_are_read_whatever_their_case():
    verify({name.title(): value for name, value in signed(BODY).items()})


def _tampered(headers: dict) -> dict:
    digest = headers["webhook-signature"].removeprefix("v1,")
    return {**headers, "webhook-signature": "v1," + ("A" if digest[0] != "A" else "B") + digest[1:]}


def _without(headers: dict, name: str) -> dict:
    return {key: value for key, value in headers.items() if key != name}


def _now() -> int:
    return int(time.time())


def _digest() -> str:
    """The base64 part of a valid signature of BODY."""
    return signed(BODY)["webhook-signature"].removeprefix("v1,")


MALFORMED = "The webhook-signature header must be 'v1,<base64 HMAC-SHA256>' signatures, separated by spaces."
MISMATCH = "The signature does not match."
NOT_UNIX_SECONDS = "The webhook-timestamp header must be unix seconds."
STALE = f"The webhook-timestamp is more than {TOLERANCE} s away from the server's clock."
REFUSED = {
    "a tampered signature": (lambda: _tampered(signed(BODY)), MISMATCH),
    "another secret's signature": (lambda: signed(BODY, secret="not-the-secret"), MISMATCH),
    "a signature of another body": (lambda: signed(b'{"amount_cents": 1}'), MISMATCH),
    "a signature of another timestamp": (
        lambda: {**signed(BODY, timestamp=_now() - 1), "webhook-timestamp": str(_now())},
        MISMATCH,
    ),
    "a signature of another id": (lambda: {**signed(BODY, delivery_id="dlv-0"), "webhook-id": "dlv-1"}, MISMATCH),
    "a signature of an id, sent without it": (
        lambda: _without(signed(BODY, delivery_id="dlv-1"), "webhook-id"),
        MISMATCH,
    ),
    "a signature of the timestamp and body alone": (
        lambda: {
            **signed(BODY),
            "webhook-signature": "v1,"
            + base64.b64encode(
                hmac.new(SECRET.encode(), f"{_now()}.".encode() + BODY, hashlib.sha256).digest()
            ).decode(),
        },
        MISMATCH,
    ),
    "a signature in hex": (  # hex digits are base64 too: it decodes, to other bytes
        lambda: {**signed(BODY), "webhook-signature": "v1," + base64.b64decode(_digest()).hex()},
        MISMATCH,
    ),
    "no signature": (lambda: _without(signed(BODY), "webhook-signature"), "The webhook-signature header is missing."),
    "an empty signature": (
        lambda: {**signed(BODY), "webhook-signature": " "},
        "The webhook-signature header is missing.",
    ),
    "a signature without its version": (lambda: {**signed(BODY), "webhook-signature": _digest()}, MALFORMED),
    "a version without its signature": (lambda: {**signed(BODY), "webhook-signature": "v1,"}, MALFORMED),
    "a signature that is not base64": (lambda: {**signed(BODY), "webhook-signature": "v1,not*base64!"}, MALFORMED),
    "a malformed entry beside a valid one": (
        lambda: {**signed(BODY), "webhook-signature": "garbage " + signed(BODY)["webhook-signature"]},
        MALFORMED,
    ),
    "the old sha256=<hex> form": (
        lambda: {**signed(BODY), "webhook-signature": "sha256=" + base64.b64decode(_digest()).hex()},
        MALFORMED,
    ),
    "only a signature of another version": (
        lambda: {**signed(BODY), "webhook-signature": "v2," + _digest()},
        "The webhook-signature header holds no v1 signature.",
    ),
    "no timestamp": (
        lambda: _without(signed(BODY), "webhook-timestamp"),
        "The webhook-timestamp header (unix seconds) is missing.",
    ),
    "a timestamp 6 minutes old": (lambda: signed(BODY, timestamp=_now() - 360), STALE),
    "a timestamp 6 minutes ahead": (lambda: signed(BODY, timestamp=_now() + 360), STALE),
    "a timestamp that is not unix seconds": (lambda: signed(BODY, timestamp="2026-12-01T10:00:00Z"), NOT_UNIX_SECONDS),
    "a timestamp with a fraction": (lambda: signed(BODY, timestamp=f"{_now()}.5"), NOT_UNIX_SECONDS),
    "a timestamp in milliseconds": (lambda: signed(BODY, timestamp=_now() * 1000), NOT_UNIX_SECONDS),
}


@pytest.mark.parametrize(("make_headers", "detail"), REFUSED.values(), ids=REFUSED.keys())
def test_an_unsigned_or_stale_message_is_refused_saying_why(make_headers, detail):
    with pytest.raises(BadSignature) as refused:
        verify(make_headers())
    assert refused.value.detail == detail


# --- the secrets, from the environment --------------------------------------------------------------------------

PRODUCTION = {"CONSOLE_ENV": "production", "SECRET_KEY": "test-only-" + "k" * 50}


def _secrets(monkeypatch, env: dict) -> dict:
    return settings_of(monkeypatch, env, without=("WEBHOOK_SECRET_", "NOTIFY_WEBHOOK_SECRET"))["WEBHOOK_SECRETS"]


def test_secrets_come_from_the_environment_one_or_more_per_source(monkeypatch):
    both = {**PRODUCTION, "WEBHOOK_SECRET_DEMO": "new-one, old-one", "WEBHOOK_SECRET_CRM_EVENTS": "crm"}
    assert _secrets(monkeypatch, both) == {"crm_events": ["crm"], "demo": ["new-one", "old-one"]}
    # Outside development the demo source has no default secret: it is not served until one is set.
    assert _secrets(monkeypatch, PRODUCTION) == {}
    assert _secrets(monkeypatch, {**PRODUCTION, "CONSOLE_ENV": "development"}) == {"demo": ["demo-secret"]}
    assert _secrets(monkeypatch, {**PRODUCTION, "WEBHOOK_SECRET_DEMO": f"{WHSEC},old-one"}) == {
        "demo": [WHSEC, "old-one"]
    }


@pytest.mark.parametrize(
    ("name", "value"), [("WEBHOOK_SECRET_DEMO", "whsec_not*base64"), ("NOTIFY_WEBHOOK_SECRET", "new-one,whsec_")]
)
def test_a_whsec_secret_that_is_no_key_stops_the_start_naming_the_variable(monkeypatch, name, value):
    """Rather than failing each delivery."""
    with pytest.raises(ImproperlyConfigured, match=f"^{name}: a whsec_ secret must"):
        _secrets(monkeypatch, {**PRODUCTION, "NOTIFY_WEBHOOK_SECRET": "notify", name: value})
