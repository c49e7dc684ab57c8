"""What a client may send: the checks that keep bad input away from the database.

PostgreSQL refuses NUL characters in text and jsonb and lone UTF-16 surrogates cannot be encoded to UTF-8, so
either one reaching a query turns a client's mistake into a 500; jsonb has no NaN or Infinity, and a JSON
consumer in JavaScript cannot hold an integer beyond 2**53 exactly. The API's JSON parser refuses them, naming the
field; console.middleware.SafeInputMiddleware refuses them in paths, query strings, cookies and form fields.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ninja.parser import Parser

MAX_DEPTH = 32  # objects and arrays nested in each other, the body itself counting as one
MAX_SAFE_INTEGER = 2**53
# Longer digit strings are refused without converting them (int() of a huge string is slow and may raise).
_MAX_INT_DIGITS = len(str(MAX_SAFE_INTEGER)) + 1

_UNSAFE_CHAR = re.compile("[\x00\ud800-\udfff]")


def unsafe_char(text: str) -> str | None:
    """Why `text` cannot be stored ("a NUL character", "a lone surrogate"), or None when it can."""
    found = _UNSAFE_CHAR.search(text)
    if found is None:
        return None
    return "a NUL character" if found.group() == "\x00" else "a lone surrogate"


class UnsafeJson(ValueError):
    """A JSON body that parses but must not be accepted. `loc` is the path to the offending value, in the
    shape of pydantic's error locations (["body", "input", "items", 3]), as the API's 422 reports them."""

    def __init__(self, loc: list, msg: str):
        super().__init__(f"{'.'.join(map(str, loc))}: {msg}")
        self.loc = loc
        self.msg = msg

    def errors(self) -> list[dict]:
        return [{"type": "unsafe_json", "loc": self.loc, "msg": self.msg}]


class _Refused:
    """Stands, in the parsed tree, for a literal the parser saw but must refuse (NaN, a huge integer), so the
    walk that follows can name where it was."""

    def __init__(self, why: str):
        self.why = why


def _parse_constant(name: str) -> _Refused:
    return _Refused(f"{name} is not a number JSON allows")


def _parse_int(digits: str) -> int | _Refused:
    if len(digits.lstrip("-")) > _MAX_INT_DIGITS:
        return _Refused(f"integers beyond ±2**53 are not allowed ({digits[:20]}...)")
    return int(digits)


def loads(body: bytes | str, root: str = "body") -> Any:
    """json.loads, refusing what must not reach the database: raises UnsafeJson naming the field (its path
    starting at `root`), or ValueError for text that is not JSON. UnsafeJson is a ValueError too, so a form
    field that reports "not valid JSON" on ValueError reports these as well."""
    try:
        data = json.loads(body, parse_constant=_parse_constant, parse_int=_parse_int)
    except RecursionError:
        raise UnsafeJson([root], f"nested deeper than {MAX_DEPTH} levels") from None
    check(data, root)
    return data


def check(data: Any, root: str = "body") -> None:
    """Walks parsed JSON without recursion (its depth is what is being checked) and raises UnsafeJson at the
    first value or key that must not be stored."""
    stack: list[tuple[Any, list, int]] = [(data, [root], 0)]
    while stack:
        value, loc, depth = stack.pop()
        if isinstance(value, dict | list):
            depth += 1
            if depth > MAX_DEPTH:
                raise UnsafeJson(loc, f"nested deeper than {MAX_DEPTH} levels")
            if isinstance(value, dict):
                for key, item in value.items():
                    if why := unsafe_char(key):
                        raise UnsafeJson(loc, f"a key contains {why}")
                    stack.append((item, [*loc, key], depth))
            else:
                stack.extend((item, [*loc, index], depth) for index, item in enumerate(value))
        elif isinstance(value, str):
            if why := unsafe_char(value):
                raise UnsafeJson(loc, f"contains {why}")
        elif isinstance(value, _Refused):
            raise UnsafeJson(loc, value.why)
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            if abs(value) > MAX_SAFE_INTEGER:
                raise UnsafeJson(loc, "integers beyond ±2**53 are not allowed")
        elif isinstance(value, float) and not math.isfinite(value):
            # 1e400 parses as a float infinity: jsonb could not store it.
            raise UnsafeJson(loc, "the number is out of range")


class SafeJsonParser(Parser):
    """django-ninja's body parser. ninja turns any exception raised here into a 400 "Cannot parse request body"
    HttpError raised `from` it; console.api answers an UnsafeJson cause with a 422 that names the field."""

    def parse_body(self, request):
        return loads(request.body)
