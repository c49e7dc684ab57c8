"""The vault (core/pii.py): sealing, opening, masks, the schema marks, erasure, and the key errors."""

from __future__ import annotations

import base64
import os

import pytest

from core import pii
from core.models import PiiSubject, PiiValue

pytestmark = pytest.mark.django_db

KEY_A = base64.b64encode(os.urandom(32)).decode()
KEY_B = base64.b64encode(os.urandom(32)).decode()

SCHEMA = {
    "x-pii-subject": "customer.id",
    "type": "object",
    "properties": {
        "customer": {"$ref": "#/$defs/Customer"},
        "cc": {"type": "array", "items": {"type": "string", "x-pii": True}},
        "amount": {"type": "integer"},
    },
    "$defs": {
        "Customer": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "name": {"type": "string", "x-pii": True},
                "email": {"anyOf": [{"type": "string"}, {"type": "null"}], "x-pii": True},
            },
        }
    },
}


@pytest.fixture
def keys(settings):
    settings.PII_KEYS = KEY_A
    settings.DEVELOPMENT = False
    return settings


def test_seal_and_open_round_trip(keys):
    ref = pii.seal({"n": 1e16, "s": "Zoë"}, subject="cus_1", field="input.x")
    assert pii.is_ref(ref)
    assert pii.open(ref) == {"n": 1e16, "s": "Zoë"}
    row = PiiValue.objects.get()
    assert b"Zo" not in bytes(row.sealed) and row.field == "input.x"


def test_marked_paths_follow_refs_arrays_and_any_of():
    assert pii.marked_paths(SCHEMA) == ["cc[]", "customer.email", "customer.name"]


def test_seal_marked_seals_only_what_is_marked(keys):
    data = {
        "customer": {"id": "cus_7", "name": "Ada Lovelace", "email": "ada@example.com"},
        "cc": ["b@x.io"],
        "amount": 5,
    }
    sealed = pii.seal_marked(data, SCHEMA, field="input")
    assert sealed["customer"]["id"] == "cus_7" and sealed["amount"] == 5
    assert all(pii.is_ref(v) for v in (sealed["customer"]["name"], sealed["customer"]["email"], sealed["cc"][0]))
    assert data["customer"]["name"] == "Ada Lovelace"  # a copy
    assert set(PiiValue.objects.values_list("field", flat=True)) == {
        "input.customer.name",
        "input.customer.email",
        "input.cc[]",
    }
    assert pii.reveal(sealed) == data
    assert pii.present(sealed)["customer"] == {"id": "cus_7", "name": "A*** L***", "email": "a***@example.com"}
    text = f"Hello {sealed['customer']['name']}, at {sealed['customer']['email']}"
    assert pii.present(text) == "Hello A*** L***, at a***@example.com"
    assert pii.present(text, clear=True) == "Hello Ada Lovelace, at ada@example.com"
    name_ref = sealed["customer"]["name"]
    assert pii.scrub({"to": ["Dear Ada Lovelace"]}, {"Ada Lovelace": name_ref}) == {"to": [f"Dear {name_ref}"]}
    # Whole words only: a short value does not eat into other words.
    assert pii.scrub("Adam asks Ada (ada@x.io).", {"Ada": "R1", "ada@x.io": "R2"}) == "Adam asks R1 (R2)."


def test_a_schema_marking_data_without_a_subject_is_refused(keys):
    with pytest.raises(pii.SchemaError, match="x-pii-subject"):
        pii.seal_marked({"a": "x"}, {"properties": {"a": {"x-pii": True}}})
    with pytest.raises(pii.SchemaError, match="missing"):
        pii.seal_marked({"customer": {"name": "x"}}, SCHEMA)
    assert not PiiValue.objects.exists()


def test_erasure_makes_every_value_of_the_subject_unreadable(keys):
    ref = pii.seal("ada@example.com", subject="cus_1", field="f", run_id=None)
    other = pii.seal("bob@example.com", subject="cus_2", field="f")
    row, count, runs = pii.erase_key("cus_1", by="admin")
    assert count == 1 and row.erased_at and row.wrapped_key is None
    with pytest.raises(pii.Erased):
        pii.open(ref)
    assert pii.present([ref, other]) == [pii.ERASED, "b***@example.com"]
    with pytest.raises(pii.Erased):  # nothing new is kept under an erased subject
        pii.seal("again", subject="cus_1", field="f")


def test_a_missing_or_wrong_key_is_a_clear_error_never_clear_text(keys):
    ref = pii.seal("ada@example.com", subject="cus_1", field="f")
    keys.PII_KEYS = ""
    with pytest.raises(pii.KeysMissing, match="PII_KEYS is not set"):
        pii.open(ref)
    keys.PII_KEYS = KEY_B
    with pytest.raises(pii.KeyUnknown, match="does not hold"):
        pii.present(ref)
    # A key of the same id that is not the same key cannot exist (the id is its hash); a corrupted wrap is caught:
    keys.PII_KEYS = KEY_A
    PiiSubject.objects.update(wrapped_key=b"\0" * 60)
    with pytest.raises(pii.Unreadable, match="wrong key"):
        pii.open(ref)
    keys.PII_KEYS = "not-a-key"
    with pytest.raises(pii.KeysMissing, match="entry 1"):
        pii.open(ref)


def test_rotation_keeps_old_subjects_readable(keys):
    ref = pii.seal("ada@example.com", subject="cus_1", field="f")
    keys.PII_KEYS = f"{KEY_B},{KEY_A}"
    new = pii.seal("bob@example.com", subject="cus_2", field="f")
    assert pii.open(ref) == "ada@example.com" and pii.open(new) == "bob@example.com"
    assert PiiSubject.objects.get(subject="cus_2").key_id == pii.key_id(base64.b64decode(KEY_B))
