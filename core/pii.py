"""Personal data by reference (docs/personal-data.md): the vault.

A value a schema marks as personal (`"x-pii": true` on a property; the schema's `"x-pii-subject"` names the field,
a dotted path, that identifies the person) is sealed here and replaced by its reference, `pii:<32 hex>`. Runs,
steps, cards, receipts, logs, traces and audit entries hold only references; the clear value is in one table,
`PiiValue`, sealed with AES-256-GCM under its subject's own data key. That key is itself sealed (wrapped) by a key
of PII_KEYS and kept on the subject's row: erasing the subject deletes it, and every value of theirs becomes
unreadable at once, wherever its reference was copied (crypto-shredding). The audit chain hashes references, so it
still verifies.

- `seal(value, subject=, field=, run_id=)` -> reference; `seal_marked(data, schema)` seals what a schema marks.
- `reveal(obj)`: the clear values, for code that must hand them to an external system (`ctx.pii`). Raises.
- `present(obj, clear=)`: for a page or the API: masks (`j***@example.com`), or the clear values for a viewer
  allowed to see them (who reveals is the caller's to audit), or "[erased]". Never raises on an erased value.
- `scrub(obj, known)`: the reverse of reveal, for what comes back from an external system with clear values in it.

Errors are `PiiError`s with a message that says what to do; none of them ever carries a clear value.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import os
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, transaction
from django.utils import timezone

from core.models import PiiSubject, PiiValue

PREFIX = "pii:"
REF = re.compile(r"pii:[0-9a-f]{32}")
ERASED = "[erased]"
MARK, SUBJECT = "x-pii", "x-pii-subject"
_NONCE = 12
MAX_SCHEMA_NODES = 10_000  # marked_paths walks no more of a schema (an agent's: external.schemas)


class PiiError(Exception):
    """Personal data could not be sealed or opened. The message says why, never what the value was."""

    code = "pii_error"


class KeysMissing(PiiError, ImproperlyConfigured):
    code = "pii_keys_missing"


class KeyUnknown(PiiError):
    code = "pii_key_unknown"


class Unreadable(PiiError):
    code = "pii_unreadable"


class Erased(PiiError):
    code = "pii_erased"


class NotFound(PiiError):
    code = "pii_not_found"


class SchemaError(PiiError, ValueError):
    """A schema marks personal data it cannot seal (no subject), or the data lacks the subject's field."""

    code = "pii_schema"


# --- keys -----------------------------------------------------------------------------------------------------


def key_id(key: bytes) -> str:
    """A name for a master key, stored with each subject key it wraps (which one opens it), revealing nothing."""
    return hashlib.sha256(b"pii-key:" + key).hexdigest()[:16]


@dataclass(frozen=True)
class Keys:
    current: str  # the id of the key that wraps new subjects' keys
    by_id: dict[str, bytes]


@functools.lru_cache(maxsize=4)
def _parse(raw: str, development: bool, secret: str) -> Keys:
    entries = [entry.strip() for entry in raw.split(",") if entry.strip()]
    if not entries:
        if not development:
            raise KeysMissing(
                "PII_KEYS is not set: personal data cannot be sealed or opened without it. Set it to one or more "
                'base64-encoded 32-byte keys, comma-separated, the newest first (`python -c "import os, base64; '
                'print(base64.b64encode(os.urandom(32)).decode())"`); see docs/personal-data.md'
            )
        entries = [base64.b64encode(hashlib.sha256(b"pii-development:" + secret.encode()).digest()).decode()]
    keys = []
    for position, entry in enumerate(entries, 1):
        try:
            key = base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError):
            key = b""
        if len(key) != 32:
            raise KeysMissing(f"PII_KEYS entry {position} is not the base64 encoding of 32 bytes")
        keys.append(key)
    return Keys(current=key_id(keys[0]), by_id={key_id(key): key for key in keys})


def keys() -> Keys:
    """PII_KEYS, parsed (the first key is the current one); in development without it, a fixed key derived from
    SECRET_KEY. KeysMissing outside development when it is not set, or when an entry is not a key."""
    return _parse(getattr(settings, "PII_KEYS", ""), bool(getattr(settings, "DEVELOPMENT", False)), settings.SECRET_KEY)


def _subject_aad(subject: str) -> bytes:
    return b"pii-subject:" + subject.encode()


def _value_aad(value_id: uuid.UUID, subject: str) -> bytes:
    return b"pii-value:" + value_id.bytes + subject.encode()


def _encrypt(key: bytes, plain: bytes, aad: bytes) -> bytes:
    nonce = os.urandom(_NONCE)
    return nonce + AESGCM(key).encrypt(nonce, plain, aad)


def _decrypt(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    sealed = bytes(sealed)
    return AESGCM(key).decrypt(sealed[:_NONCE], sealed[_NONCE:], aad)


def _unwrap(row: PiiSubject) -> bytes:
    """The subject's data key. Erased: their key is gone. KeyUnknown: PII_KEYS lacks the key that wrapped it.
    Unreadable: a key of that id that does not open it (a wrong key)."""
    if row.wrapped_key is None:
        raise Erased(f"the personal data of subject {row.subject!r} was erased on {row.erased_at:%Y-%m-%d}")
    master = keys().by_id.get(row.key_id)
    if master is None:
        raise KeyUnknown(
            f"the key of subject {row.subject!r} is wrapped by PII_KEYS key {row.key_id}, which PII_KEYS does not "
            "hold: add that key back (keep old keys after a rotation until every subject is re-wrapped)"
        )
    try:
        return _decrypt(master, row.wrapped_key, _subject_aad(row.subject))
    except InvalidTag:
        raise Unreadable(
            f"the key of subject {row.subject!r} does not open with PII_KEYS key {row.key_id}: a wrong key"
        ) from None


def _subject_row(subject: str) -> PiiSubject:
    """The subject's row, created with a new data key the first time. Refused (Erased) for an erased subject: their
    data is not kept again under the same identity."""
    row = PiiSubject.objects.filter(subject=subject).first()
    if row is None:
        ring = keys()
        data_key = AESGCM.generate_key(bit_length=256)
        wrapped = _encrypt(ring.by_id[ring.current], data_key, _subject_aad(subject))
        try:
            with transaction.atomic():
                row = PiiSubject.objects.create(subject=subject, key_id=ring.current, wrapped_key=wrapped)
        except IntegrityError:  # created by a concurrent sealer: theirs is the key
            row = PiiSubject.objects.get(subject=subject)
    return row


# --- sealing ---------------------------------------------------------------------------------------------------


def is_ref(value: Any) -> bool:
    return isinstance(value, str) and REF.fullmatch(value) is not None


def refs_in(obj: Any) -> set[str]:
    found: set[str] = set()
    _each_string(obj, lambda text: found.update(REF.findall(text)))
    return found


def seal(value: Any, *, subject: str, field: str, run_id=None) -> str:
    """Seal one JSON value under `subject`'s key; its reference. A reference is returned as it is."""
    if is_ref(value):
        return value
    subject = _subject_name(subject)
    row = _subject_row(subject)
    data_key = _unwrap(row)
    value_id = uuid.uuid4()
    plain = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    PiiValue.objects.create(
        id=value_id,
        subject=row,
        field=field[:200],
        run_id=run_id,
        sealed=_encrypt(data_key, plain, _value_aad(value_id, subject)),
    )
    return PREFIX + value_id.hex


def _subject_name(subject: Any) -> str:
    if isinstance(subject, bool) or not isinstance(subject, str | int) or str(subject).strip() == "":
        raise SchemaError("the personal data's subject must be a non-empty string or integer")
    return str(subject)[:200]


def marked_paths(schema: dict) -> list[str]:
    """The dotted paths a JSON Schema marks `x-pii` (`email.to`; `items[]` for an array's items), following local
    `$ref`s (pydantic's `$defs`)."""
    defs = schema.get("$defs") or schema.get("definitions") or {}
    paths: list[str] = []

    def resolve(node: dict, seen: frozenset) -> tuple[dict, frozenset]:
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/"):
            name = node["$ref"].rsplit("/", 1)[-1]
            if name in seen or name not in defs:
                return {}, seen
            seen, node = seen | {name}, {**defs[name], **{k: v for k, v in node.items() if k != "$ref"}}
        return node, seen

    budget = [MAX_SCHEMA_NODES]

    def walk(node: Any, path: str, seen: frozenset) -> None:
        if not isinstance(node, dict):
            return
        budget[0] -= 1
        if budget[0] < 0:  # an agent's schema whose `$ref`s multiply the walk (two per level, 30 levels deep)
            raise SchemaError(f"the schema is too large to find its {MARK} marks in ({MAX_SCHEMA_NODES} nodes at most)")
        node, seen = resolve(node, seen)
        if node.get(MARK) is True and path:
            paths.append(path)
            return
        for name, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{name}" if path else name, seen)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]", seen)
        for combinator in ("anyOf", "oneOf", "allOf"):
            for option in node.get(combinator) or []:
                walk(option, path, seen)

    walk(schema, "", frozenset())
    return sorted(set(paths))


def check_schema(schema: dict) -> list[str]:
    """The marked paths of a schema; SchemaError when it marks personal data and names no `x-pii-subject`."""
    paths = marked_paths(schema) if isinstance(schema, dict) else []
    if paths and not (isinstance(schema.get(SUBJECT), str) and schema[SUBJECT].strip()):
        raise SchemaError(
            f"the schema marks personal data ({', '.join(paths)}) but names no {SUBJECT}: the field that "
            'identifies the person, whose key seals it (e.g. "x-pii-subject": "customer_id")'
        )
    return paths


def _get(data: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def seal_marked(data: Any, schema: dict, *, field: str = "", run_id=None) -> Any:
    """`data` with every value its schema marks `x-pii` sealed (a copy; references stay as they are), under the
    subject `x-pii-subject` names. SchemaError when the schema names no subject or the data lacks it."""
    paths = check_schema(schema)
    if not paths or not isinstance(data, dict):
        return data
    subject = _get(data, schema[SUBJECT])
    if subject is None:
        raise SchemaError(f"the personal data's subject field {schema[SUBJECT]!r} is missing")
    subject = _subject_name(subject)
    prefix = f"{field}." if field else ""

    def sealed(node: Any, parts: list[str], where: str) -> Any:
        if not parts:
            return node if node is None else seal(node, subject=subject, field=where, run_id=run_id)
        head, rest = parts[0], parts[1:]
        name = head.removesuffix("[]")
        if not isinstance(node, dict) or name not in node:
            return node
        here = f"{where}{head}" + ("." if rest else "")
        if head.endswith("[]"):
            items = node[name]
            return {**node, name: [sealed(item, rest, here) for item in items]} if isinstance(items, list) else node
        return {**node, name: sealed(node[name], rest, here)}

    for path in paths:
        data = sealed(data, path.split("."), prefix)
    return data


# --- opening ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Opened:
    """One reference, opened: its value, or why not (erased, or a reference the vault does not hold)."""

    value: Any = None
    erased: bool = False
    missing: bool = False
    field: str = ""
    subject: str = ""


def open_many(refs: Iterable[str]) -> dict[str, Opened]:
    """Open references in one query. Erased and unknown references are reported, not raised; a missing or wrong
    key raises (KeysMissing, KeyUnknown, Unreadable): never a guess, never clear text."""
    ids = {ref: uuid.UUID(ref[len(PREFIX) :]) for ref in set(refs) if is_ref(ref)}
    if not ids:
        return {}
    rows = {row.id: row for row in PiiValue.objects.filter(id__in=ids.values()).select_related("subject")}
    subject_keys: dict[int, bytes] = {}
    opened: dict[str, Opened] = {}
    for ref, value_id in ids.items():
        row = rows.get(value_id)
        if row is None:
            opened[ref] = Opened(missing=True)
            continue
        subject = row.subject
        if subject.wrapped_key is None:
            opened[ref] = Opened(erased=True, field=row.field, subject=subject.subject)
            continue
        if subject.pk not in subject_keys:
            subject_keys[subject.pk] = _unwrap(subject)
        try:
            plain = _decrypt(subject_keys[subject.pk], row.sealed, _value_aad(row.id, subject.subject))
        except InvalidTag:
            raise Unreadable(f"the personal value {ref} does not open with its subject's key") from None
        opened[ref] = Opened(value=json.loads(plain), field=row.field, subject=subject.subject)
    return opened


def open(ref: str) -> Any:  # noqa: A001 - the vault's verb
    """The clear value of one reference. Erased, NotFound, or a key error."""
    found = open_many([ref]).get(ref)
    if found is None or found.missing:
        raise NotFound(f"no personal value {ref}")
    if found.erased:
        raise Erased(f"the personal value {ref} ({found.field}) was erased")
    return found.value


def _each_string(obj: Any, fn: Callable[[str], None]) -> None:
    if isinstance(obj, str):
        fn(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _each_string(value, fn)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _each_string(value, fn)


def _map_strings(obj: Any, fn: Callable[[str], Any]) -> Any:
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {key: _map_strings(value, fn) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [_map_strings(value, fn) for value in obj]
    return obj


def _substitute(obj: Any, opened: dict[str, Opened], show: Callable[[Opened], Any]) -> Any:
    def one(text: str) -> Any:
        if text in opened:
            return show(opened[text])
        if PREFIX not in text:
            return text
        return REF.sub(lambda m: str(show(opened[m.group(0)])) if m.group(0) in opened else m.group(0), text)

    return _map_strings(obj, one)


def reveal(obj: Any) -> Any:
    """`obj` with every reference replaced by its clear value (a string that is one reference becomes the value,
    a reference inside a text its value as text). For the code that hands them to an external system only; raises
    Erased or NotFound rather than send a placeholder."""
    opened = open_many(refs_in(obj))
    for ref, found in opened.items():
        if found.missing:
            raise NotFound(f"no personal value {ref}")
        if found.erased:
            raise Erased(f"the personal value {ref} ({found.field}) was erased")
    return _substitute(obj, opened, lambda found: found.value)


def mask(value: Any) -> str:
    """A value's mask: an email keeps its first letter and its domain (`j***@example.com`), words their first
    letter (`A*** L***`), anything else is `***`."""
    if not isinstance(value, str) or not value:
        return "***"
    local, at, domain = value.partition("@")
    if at and local and domain:
        return f"{local[0]}***@{domain}"
    return " ".join(f"{word[0]}***" for word in value.split()) or "***"


def present(obj: Any, *, clear: bool = False) -> Any:
    """`obj` as a page or the API shows it: each reference masked (or, `clear`, its value: the caller audits the
    reveal), "[erased]" for an erased one. A missing or wrong key raises."""
    opened = open_many(refs_in(obj))

    def show(found: Opened) -> Any:
        if found.erased or found.missing:
            return ERASED
        return found.value if clear else mask(found.value)

    return _substitute(obj, opened, show)


def scrub(obj: Any, known: dict[str, str]) -> Any:
    """`obj` with each clear value of `known` (clear text -> its reference) replaced by its reference, wherever it
    appears in a string as a whole word (`Ada` in "Dear Ada," but not in "Adam"): what an external system answered
    with the values a step revealed to it."""
    texts = sorted((text for text in known if isinstance(text, str) and len(text) >= 3), key=len, reverse=True)
    if not texts:
        return obj
    pattern = re.compile(r"(?<!\w)(?:" + "|".join(re.escape(text) for text in texts) + r")(?!\w)")
    return _map_strings(obj, lambda text: pattern.sub(lambda m: known[m.group(0)], text))


def known_for_run(run_id) -> dict[str, str]:
    """The run's sealed values that are text, clear -> reference (to scrub them back out of what comes in)."""
    refs = [PREFIX + value_id.hex for value_id in PiiValue.objects.filter(run_id=run_id).values_list("id", flat=True)]
    return {
        found.value: ref
        for ref, found in open_many(refs).items()
        if isinstance(found.value, str) and not found.erased and not found.missing
    }


# --- erasure ---------------------------------------------------------------------------------------------------


def erase_key(subject: str, *, by: str) -> tuple[PiiSubject | None, int, set]:
    """Destroy `subject`'s data key (in the caller's transaction): their values can no longer be opened, anywhere.
    Returns the row (None for a subject the vault never saw), how many values it had, and the runs they belong to.
    Erasing twice is a no-op that reports the same."""
    row = PiiSubject.objects.select_for_update().filter(subject=subject).first()
    if row is None:
        return None, 0, set()
    if row.wrapped_key is not None:
        row.wrapped_key, row.erased_at, row.erased_by = None, timezone.now(), by[:150]
        row.save(update_fields=["wrapped_key", "erased_at", "erased_by"])
    values = PiiValue.objects.filter(subject=row)
    return row, values.count(), set(values.exclude(run_id=None).values_list("run_id", flat=True).distinct())
