"""The canonical digest that binds an approval to the arguments it approved (the contract's one definition)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def canonical_json(arguments: Mapping[str, Any]) -> bytes:
    """Sorted keys, no whitespace, UTF-8 (not `\\u` escapes): the bytes the server hashes too. NaN and the
    infinities are refused here (they are not JSON, and the server refuses them) rather than hashed."""
    text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def arguments_digest(arguments: Mapping[str, Any]) -> str:
    """Lowercase hex SHA-256 of the arguments' canonical JSON, as `consume` expects it."""
    return hashlib.sha256(canonical_json(arguments)).hexdigest()
