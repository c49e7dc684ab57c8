"""Any JSON result, stored. An agent's result is whatever its system answered (core.safe_input: any valid JSON).
PostgreSQL's jsonb keeps integers of any size exactly (numeric) but refuses a NUL character in a string or a key
(and a lone surrogate cannot be encoded at all): such a result is kept as its JSON text, under `result_json`
instead of `result`, in the receipt, the step's output and the audit entry alike, and answered as the value it
stands for (external.executions stores it, external.status answers with it).
"""

from __future__ import annotations

import json
from typing import Any

from core import safe_input


def _jsonb_holds(value: Any) -> bool:
    """Whether jsonb stores `value` as it is: no string or key with a NUL or a lone surrogate. Walked without
    recursion, as safe_input.check is."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if safe_input.unsafe_char(item):
                return False
        elif isinstance(item, dict):
            if any(safe_input.unsafe_char(key) for key in item):
                return False
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def storable(result: Any) -> dict:
    """A result as the console stores it: {"result": value}, or {"result_json": its JSON text} (ASCII: the NUL
    and any surrogate written as \\u escapes) when jsonb cannot hold it."""
    if _jsonb_holds(result):
        return {"result": result}
    return {"result_json": json.dumps(result, ensure_ascii=True, sort_keys=True)}


def stored_result(stored: dict) -> Any:
    """The value a stored outcome (or a step's output) holds: the inverse of storable."""
    if "result_json" in stored:
        return json.loads(stored["result_json"])
    return stored.get("result")


def same_outcome(stored: dict | None, outcome: dict) -> bool:
    """Whether a recorded outcome is `outcome` (an agent's retry after a lost answer): the same JSON, compared as
    text so that true is not 1 and 1 is not 1.0 (Python's == says they are)."""

    def text(value: dict) -> str:
        fields = {key: item for key, item in value.items() if key not in ("result", "result_json")}
        return json.dumps({**fields, "result": stored_result(value)}, ensure_ascii=True, sort_keys=True)

    return stored is not None and text(stored) == text(outcome)
