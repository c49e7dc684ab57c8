"""What a client may send: the checks that keep bad input away from the database.

PostgreSQL refuses NUL characters in text and jsonb and lone UTF-16 surrogates cannot be encoded to UTF-8, so
either one reaching a query turns a client's mistake into a 500; jsonb has no NaN or Infinity, and a JSON
consumer in JavaScript cannot hold an integer beyond 2**53 exactly. The API's JSON parser (console.api, with
loads below) refuses them, naming the field; console.middleware.SafeInputMiddleware refuses them in paths, query
strings, cookies and form fields.

One exception: a field that records what happened outside the console (an external agent's result: whatever its
system answered) must take any valid JSON, or that outcome could never be recorded. loads() takes such fields
(`free`) as they are: integers exact at any size Python prints (4,300 digits), NUL characters and lone
surrogates (their storage is the caller's: external.results keeps such a value as its JSON text), nesting to
MAX_FREE_DEPTH. The OpenAPI document says so on the field (`ANY_JSON`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from decimal import Decimal
from typing import Any

MAX_DEPTH = 32  # objects and arrays nested in each other, the body itself counting as one
MAX_SAFE_INTEGER = 2**53
# A free field's nesting, the body counting as one (as MAX_DEPTH). Python's json parses and prints ~1,400 levels
# with its C code but the run and audit pages print data indented, with Python code under a recursion limit of
# 1,000 shared with the request's own stack: 256 levels leave room for both.
MAX_FREE_DEPTH = 256
# The most digits an integer may have in a free field: what Python converts to and from text
# (sys.get_int_max_str_digits()), fixed here so that the answer does not depend on the process's setting.
MAX_FREE_DIGITS = 4300
# On a field's JSON Schema (json_schema_extra): any JSON value, which declare() leaves as it is.
ANY_JSON = "x-any-json"
# Longer digit strings are refused without converting them (int() of a huge string is slow and may raise).
_MAX_INT_DIGITS = len(str(MAX_SAFE_INTEGER)) + 1

_UNSAFE_CHAR = re.compile("[\x00\ud800-\udfff]")


def unsafe_char(text: str) -> str | None:
    """Why `text` cannot be stored ("a NUL character", "a lone surrogate"), or None when it can."""
    found = _UNSAFE_CHAR.search(text)
    if found is None:
        return None
    return "a NUL character" if found.group() == "\x00" else "a lone surrogate"


def field_path(parts) -> str:
    """A field's path as a client wrote it in its JSON: keys and list indexes joined by dots ("input.tags.1"),
    as every 422 of the API names its fields."""
    return ".".join(str(part) for part in parts)


class UnsafeJson(ValueError):
    """A JSON body that parses but must not be accepted. `loc` is the path to the offending value from the
    parser's root (["body", "input", "items", 3]); the API's 422 names it below the root, as the client wrote
    it ("input.items.3"), or the root itself for the whole body."""

    def __init__(self, loc: list, msg: str):
        super().__init__(f"{field_path(loc)}: {msg}")
        self.loc = loc
        self.msg = msg

    def errors(self) -> list[dict]:
        return [{"type": "unsafe_json", "loc": field_path(self.loc[1:]) or str(self.loc[0]), "msg": self.msg}]


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


def _parse_float(text: str) -> int | float | _Refused:
    value = float(text)
    if not math.isfinite(value):
        # 1e400 parses as a float infinity: jsonb could not store it.
        return _Refused("the number is out of range")
    if value.is_integer():
        # JSON has one kind of number, and so have JSON Schema (the OpenAPI document's language) and JavaScript:
        # 65.0 is the integer 65, which a strict integer field takes, and 1e300 is an integer beyond ±2**53,
        # which check() refuses as such. The rule is on the value, not on how it is written: no schema can tell
        # 1e300 from 1000...0, so a rule on the spelling could not be stated in the document.
        return int(value)
    return value


def _parse_any_int(digits: str) -> int | _Refused:
    if len(digits.lstrip("-")) > MAX_FREE_DIGITS:
        return _Refused(f"integers of more than {MAX_FREE_DIGITS} digits are not allowed ({digits[:20]}...)")
    return int(digits)


def _parse_any_float(text: str) -> int | float | _Refused:
    """A number with a fraction or an exponent, read exactly first: an integer (1.39e16, 1e400) stays exactly
    that integer (jsonb's numeric holds it), anything else becomes the nearest double, as RFC 8259 says JSON
    numbers interoperate."""
    value = Decimal(text)
    if value == value.to_integral_value():
        if value.adjusted() >= MAX_FREE_DIGITS:
            return _Refused(f"integers of more than {MAX_FREE_DIGITS} digits are not allowed ({text[:20]}...)")
        return int(value)
    nearest = float(value)
    if not math.isfinite(nearest):
        # A fraction after more than 308 digits: no double holds it, and an integer would not be the number sent.
        return _Refused("a number with a fraction beyond ±1.8e308 cannot be kept")
    return nearest


def loads(body: bytes | str, root: str = "body", free: Collection[str] = ()) -> Any:
    """json.loads, refusing what must not reach the database: raises UnsafeJson naming the field (its path
    starting at `root`), or ValueError for text that is not JSON. UnsafeJson is a ValueError too, so a form
    field that reports "not valid JSON" on ValueError reports these as well.

    `free`: top-level fields of a body object that take any valid JSON (see the module's docstring); every other
    field keeps the rules."""
    if free:
        parse_int, parse_float, deepest = _parse_any_int, _parse_any_float, MAX_FREE_DEPTH
    else:
        parse_int, parse_float, deepest = _parse_int, _parse_float, MAX_DEPTH
    try:
        data = json.loads(body, parse_constant=_parse_constant, parse_int=parse_int, parse_float=parse_float)
    except RecursionError:
        raise UnsafeJson([root], f"nested deeper than {deepest} levels") from None
    if free and isinstance(data, dict):
        rest = {key: value for key, value in data.items() if key not in free}
        check(rest, root)
        for key in free:
            if key in data:
                check_free(data[key], [root, key])
    else:
        check(data, root)
    return data


def check_free(data: Any, loc: list) -> None:
    """The walk of check() for a free field (`loc`: its path, the body's root first): only what Python itself
    cannot carry is refused, nesting beyond MAX_FREE_DEPTH and integers beyond MAX_FREE_DIGITS digits."""
    stack: list[tuple[Any, list, int]] = [(data, loc, len(loc) - 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, dict | list):
            depth += 1
            if depth > MAX_FREE_DEPTH:
                raise UnsafeJson(where, f"nested deeper than {MAX_FREE_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((item, [*where, key], depth) for key, item in items)
        elif isinstance(value, _Refused):
            raise UnsafeJson(where, value.why)


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
                raise UnsafeJson(loc, "numbers beyond ±2**53 are not allowed")
        elif isinstance(value, float) and not math.isfinite(value):  # (from Python callers; loads has none)
            raise UnsafeJson(loc, "the number is out of range")


# --- the same rules, stated in the OpenAPI document ------------------------------------------------------------

# What str.strip() removes (every character for which str.isspace() is true), as a regular expression class that
# reads the same in Python, ECMA-262 (JSON Schema) and Rust (pydantic). ECMA's \s is a different set (it has
# U+FEFF, lacks U+001C-U+001F and U+0085), hence the explicit list; a test compares it with str.isspace().
_WHITESPACE_CLASS = r"\t\n\x0b\x0c\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# A string with something in it besides whitespace: what the server's `.strip()` leaves non-empty.
NOT_BLANK = f"[^{_WHITESPACE_CLASS}]"
NO_NUL = r"^[^\u0000]*$"
JSON_VALUE = "JsonValue"
_JSON_VALUE_REF = {"$ref": f"#/components/schemas/{JSON_VALUE}"}


def _json_value_schema() -> dict:
    return {
        "description": (
            "Any JSON value the API stores: no NUL character in a string or a key (nor a lone UTF-16 surrogate), "
            f"numbers within ±2**53 (JavaScript's safe integers; 65.0 is the integer 65), at most {MAX_DEPTH} "
            "levels of objects and arrays in the whole body."
        ),
        "anyOf": [
            {"type": "null"},
            {"type": "boolean"},
            {"type": "number", "minimum": -MAX_SAFE_INTEGER, "maximum": MAX_SAFE_INTEGER},
            {"type": "string", "pattern": NO_NUL},
            {"type": "array", "items": _JSON_VALUE_REF},
            {"type": "object", "propertyNames": {"pattern": NO_NUL}, "additionalProperties": _JSON_VALUE_REF},
        ],
    }


def declare(openapi: dict) -> dict:
    """States the parser's rules (no NUL in a string or a key, numbers within ±2**53; and the middleware's, no NUL
    in a parameter) in `openapi`, on every request body, every schema a request body uses and every parameter, so
    that a client generated from the document cannot send what loads() or the middleware refuses. A free-form
    object or array (a run's `input`, an edit's `payload`, the fields a body may carry besides its own, which are
    ignored) holds JsonValues. Response schemas are left as they are (those a request body shares too, harmlessly:
    what the API answers was stored)."""
    components = openapi.setdefault("components", {}).setdefault("schemas", {})
    components[JSON_VALUE] = _json_value_schema()
    seen: set[str] = {JSON_VALUE}
    pending: list[str] = []

    def walk(schema: Any) -> None:
        if isinstance(schema, list):
            for item in schema:
                walk(item)
            return
        if not isinstance(schema, dict) or schema.get(ANY_JSON):
            return
        ref = schema.get("$ref", "")
        if ref.startswith("#/components/schemas/"):
            name = ref.rsplit("/", 1)[1]
            if name not in seen:
                seen.add(name)
                pending.append(name)
            return
        kind = schema.get("type")
        if kind == "string" and "enum" not in schema and "const" not in schema:
            pattern = schema.get("pattern")
            if pattern is None:
                schema["pattern"] = NO_NUL
            elif pattern != NO_NUL:
                schema.setdefault("allOf", []).append({"pattern": NO_NUL})
        elif kind in ("integer", "number"):
            if not schema.get("exclusiveMinimum", -math.inf) > -MAX_SAFE_INTEGER:
                schema["minimum"] = max(schema.get("minimum", -MAX_SAFE_INTEGER), -MAX_SAFE_INTEGER)
            if not schema.get("exclusiveMaximum", math.inf) < MAX_SAFE_INTEGER:
                schema["maximum"] = min(schema.get("maximum", MAX_SAFE_INTEGER), MAX_SAFE_INTEGER)
        elif kind == "object":
            schema.setdefault("propertyNames", {"pattern": NO_NUL})
            if schema.get("additionalProperties", True) is True:
                schema["additionalProperties"] = dict(_JSON_VALUE_REF)
        elif kind == "array" and not schema.get("items"):  # none, or `{}` (pydantic's `list`): anything
            schema["items"] = dict(_JSON_VALUE_REF)
        for key in ("properties", "patternProperties", "$defs"):
            for child in schema.get(key, {}).values():
                walk(child)
        # Not into `not` or `if`: a constraint added there would widen what the schema admits.
        for key in ("items", "additionalProperties", "propertyNames", "then", "else"):
            walk(schema.get(key))
        for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
            walk(schema.get(key, []))

    for operations in openapi.get("paths", {}).values():
        for operation in operations.values():
            if not isinstance(operation, dict):
                continue
            for parameter in operation.get("parameters", []):
                walk(parameter.get("schema"))
            for media in operation.get("requestBody", {}).get("content", {}).values():
                walk(media.get("schema"))
    while pending:
        walk(components.get(pending.pop()))
    return openapi
