"""The JSON Schema an external agent sends with its request (external.asks): checked once when it is asked,
then used to check the agent's arguments and every reviewer's edit of the card, in the web thread.

The schema is the agent's text, so nothing in it may stall that thread, reach the network or the filesystem, or
turn into a 500:
- size and depth are capped (MAX_BYTES, MAX_DEPTH);
- patterns (`pattern`, `patternProperties` and the keys that decide `additionalProperties`) run on RE2, whose
  time is linear in the text; a pattern RE2 cannot compile (backreferences, lookaround) is refused when asked;
- `$ref` (and `$dynamicRef`, `$recursiveRef`) stays within the document (`#...`), and every one of them is
  resolved when asked; validation uses a registry that retrieves nothing;
- a validation counts its steps (one per keyword evaluated, and one per key that patternProperties or
  additionalProperties searches with each pattern) and stops past MAX_STEPS, or past MAX_CPU seconds of its
  thread's CPU time (a step on a large value costs more: each error it finds writes the value into its message),
  so a schema whose work grows exponentially (`anyOf` of two `$ref`s to the next level, 30 levels deep) or that
  refers to itself without end is refused rather than run; `uniqueItems` compares in one pass (jsonschema's is
  quadratic on items it cannot sort);
- the check of the schema itself counts steps alone (MAX_CHECK_STEPS, patterns charged by their RE2 program's
  size), so that a schema gets the same answer on a busy machine as on a quiet one, in every process;
- a subschema's own `$schema` picks its draft, whose keywords are counted and on RE2 as well;
- `unevaluatedProperties` is refused in a schema that also has `patternProperties`: jsonschema decides which
  properties were evaluated with Python's backtracking `re`, outside the keywords this module replaces.

problems(schema) says what makes a schema unusable ([] when nothing does); errors(schema, value) says where a
value does not fit it, and raises Unusable when the schema cannot be evaluated after all (a card opened before
these checks existed, or a validation past MAX_STEPS or MAX_CPU).
"""

from __future__ import annotations

import contextvars
import functools
import json
import time
from collections.abc import Iterator
from typing import Any

import attrs
import jsonschema
import re2
import referencing
import referencing.exceptions
import referencing.jsonschema
from jsonschema.exceptions import ValidationError

from core import pii

MAX_BYTES = 32 * 1024  # the schema as compact JSON (UTF-8): room for the arguments beside it in a 64 KiB body
MAX_DEPTH = 24  # objects and arrays nested in each other, the schema itself counting as one
# Keyword evaluations in one validation. Measured on this project's machines: 20,000 of the costliest kind
# ($ref and anyOf) take 0.2-0.4 s of CPU; a plain one (type, pattern) a tenth of that. Arguments of 750 line items
# of 6 checked fields each (55 KB) need 16,500.
MAX_STEPS = 20_000
# The same validation's CPU time, for steps that are costly one by one: 20,000 failures of `type` on a 60 KB
# object took 2.7 s (each error's message holds the object's repr). The 750 line items above take 0.06 s.
MAX_CPU = 0.5
# Checking the schema itself (when asked; then once per process, by its text) counts steps, never the CPU time,
# so that the same schema gets the same answer on a busy machine as on a quiet one, when asked and at each edit
# after. A step of the metaschema's pass takes 15-25 us of CPU, about 30 of them per subschema: 30,000 are 0.5-0.75
# s (450 `$ref`s to 450 `$anchor`s, 29 KB, take 26,578). 32 KiB of empty subschemas would take 270,000 (5 s).
MAX_CHECK_STEPS = 30_000
# A pattern is charged one step per PROGRAM_PER_STEP instructions of its RE2 program (0.5-0.7 us each to compile):
# a counted repetition of a Unicode class (`[\p{L}\p{N}]{1,60}`, 80,000 instructions) takes 35-60 ms, so 600 of
# them, 27 KB, would take 15 s and are charged 1.5 million steps. (Charged whether this process compiled it
# before or not: the answer is the same in every process.)
PROGRAM_PER_STEP = 32
# RE2's memory for one compiled pattern (its default is 8 MiB): what a pattern kept in _compiled may hold, and a
# bound on its compile time. `[\p{L}\p{N}]{1,64}` fits; `[\p{L}\p{N}]{1,200}` does not (`+` with maxLength does).
RE2_MAX_MEM = 2 << 20

# Keywords whose value is a schema, a list of schemas, or an object of schemas (by name): what the walk below
# descends into. Every other value is data (`const`, `enum`, `default`, `examples`) or an annotation.
_SCHEMA = (
    "additionalItems",
    "additionalProperties",
    "contains",
    "contentSchema",
    "else",
    "if",
    "items",
    "not",
    "propertyNames",
    "then",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SCHEMAS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("$defs", "definitions", "dependentSchemas", "dependencies", "patternProperties", "properties")
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")

# Empty: a `$ref` this registry cannot answer from the document (or the drafts' own metaschemas, which
# jsonschema adds) is unresolvable, never fetched. (jsonschema's default registry fetches http(s) URLs.)
_NOTHING = referencing.Registry()


class _Budget:
    """What the check under way may still spend: errors() sets one for each validation (MAX_STEPS, MAX_CPU),
    problems() one for each schema it checks (MAX_CHECK_STEPS and no CPU time, so that its answer does not depend
    on the machine's load)."""

    __slots__ = ("steps", "max_steps", "cpu_until", "max_cpu")

    def __init__(self, max_steps: int, max_cpu: float | None):
        self.steps, self.max_steps = 0, max_steps
        self.max_cpu = max_cpu
        self.cpu_until = time.thread_time() + max_cpu if max_cpu is not None else None


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("schema_budget", default=None)


class Unusable(ValueError):
    """The schema cannot be evaluated: `errors` as [{loc, msg}]."""

    def __init__(self, errors: list[dict]):
        super().__init__("; ".join(f"{e['loc']} {e['msg']}" for e in errors))
        self.errors = errors


class _TooMuchWork(Exception):
    """The validation's budget is spent: args[0] says which ("more than 20000 steps")."""


# --- patterns on RE2 ---------------------------------------------------------------------------------------------


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is the agent's mistake, answered as such: not a log line
    options.max_mem = RE2_MAX_MEM
    return options


_OPTIONS = _options()


@functools.lru_cache(maxsize=64)  # at most RE2_MAX_MEM each: 128 MiB
def _compiled(pattern: str):
    """The pattern compiled by RE2 (raises re2.error for one it cannot compile: backreferences, lookaround...)."""
    return re2.compile(pattern, _OPTIONS)


def _search(pattern: str, text: str) -> bool:
    try:
        return _compiled(pattern).search(text) is not None
    except re2.error as exc:  # only a schema that skipped problems() gets here
        raise Unusable([{"loc": "schema", "msg": f"pattern {pattern!r} is not RE2: {_why(exc)}"}]) from None


def _why(exc: Exception) -> str:
    why = exc.args[0] if exc.args else exc
    return why.decode("utf-8", "replace") if isinstance(why, bytes) else str(why)


def _key_matches(pattern: str, key: str) -> bool:
    # A step each: patternProperties and additionalProperties search every key with every pattern, all within one
    # keyword's evaluation (2,200 patterns by 6,500 keys took 24 s).
    _spend()
    return _search(pattern, key)


# jsonschema's own keywords, with re.search replaced by RE2 (same checks, same messages).


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _search(pattern, instance):  # (the keyword's own step)
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, pattern_properties, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in pattern_properties.items():
        for key, value in instance.items():
            if _key_matches(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator, additional, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    properties, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extras = {
        key for key in instance if key not in properties and not any(_key_matches(pattern, key) for pattern in patterns)
    }
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        if patterns:
            verb = "does" if len(extras) == 1 else "do"
            joined = ", ".join(repr(each) for each in sorted(extras))
            listed = ", ".join(repr(each) for each in sorted(patterns))
            yield ValidationError(f"{joined} {verb} not match any of the regexes: {listed}")
        else:
            joined = ", ".join(repr(each) for each in sorted(extras, key=str))
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(f"Additional properties are not allowed ({joined} {verb} unexpected)")


def _unique_items(validator, unique, instance, schema):
    # jsonschema compares the items pairwise when it cannot sort them (objects, or strings beside numbers):
    # quadratic, 10 s of CPU for 3,000 small objects (32 KB). One pass, each item by its _identity, answers the same.
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[tuple] = set()
    for item in instance:
        key = _identity(item)
        if key in seen:
            yield ValidationError(f"{instance!r} has non-unique elements")
            return
        seen.add(key)


def _identity(value: Any) -> tuple:
    """What makes two JSON values equal in JSON Schema: true is not 1 (Python says it is: hence the tags), 1.0 is
    1 (Python agrees: equal, with equal hashes), an object's key order does not count (sorted keys)."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", value)
    if isinstance(value, dict | list):
        return ("j", json.dumps(_as_json_value(value), sort_keys=True, separators=(",", ":")))
    return ("s", value)  # a string, or None


def _as_json_value(value: Any) -> Any:
    """`value` with each integral float as an int, as json.dumps writes 1.0 and 1 apart."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _as_json_value(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_json_value(item) for item in value]
    return value


_REPLACED = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "uniqueItems": _unique_items,
}


def _counted(keyword):
    """The keyword's function, counting one step each time it is evaluated (for any instance, at any depth), and
    watching the CPU time (one step on its own takes milliseconds at most: the budget is overrun by no more)."""

    @functools.wraps(keyword)
    def evaluate(validator, value, instance, schema):
        _spend()
        return keyword(validator, value, instance, schema)

    return evaluate


def _spend(steps: int = 1) -> None:
    """`steps` steps of the check under way (see _Budget)."""
    budget = _budget.get()
    if budget is not None:
        budget.steps += steps
        if budget.steps > budget.max_steps:
            raise _TooMuchWork(f"more than {budget.max_steps} steps")
        if budget.cpu_until is not None and time.thread_time() > budget.cpu_until:
            raise _TooMuchWork(f"more than {budget.max_cpu} s of CPU")


@functools.cache
def _validator_class(base: type) -> type:
    """`base` (a draft's validator) with RE2 patterns and every keyword counted. jsonschema.validators.extend
    creates a class without registering it as its draft's validator: jsonschema's own stay as they are."""
    keywords = {name: _REPLACED.get(name, keyword) for name, keyword in base.VALIDATORS.items()}
    cls = jsonschema.validators.extend(base, {name: _counted(keyword) for name, keyword in keywords.items()})
    cls.evolve = functools.partialmethod(_evolve, base)
    return cls


def _evolve(validator, base: type, **changes):
    """A validator for a subschema: jsonschema's evolve takes the class its `$schema` names, which is jsonschema's
    own (Python's `re`, nothing counted), so a subschema saying `"$schema"` would escape RE2 and the budget: here
    it gets that draft's class from _validator_class instead (the metaschemas' own resources say `$schema` too)."""
    schema = changes.setdefault("schema", validator.schema)
    cls = _validator_class(jsonschema.validators.validator_for(schema, default=base))
    for field in attrs.fields(type(validator)):
        if field.init and field.alias not in changes:
            changes[field.alias] = getattr(validator, field.name)
    return cls(**changes)


def _draft(schema: dict) -> type:
    # A `$schema` jsonschema does not know is read as the latest draft, as before (no warning: the default is ours).
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


# --- what makes a schema unusable --------------------------------------------------------------------------------


def problems(schema: Any) -> list[dict]:
    """Why the agent's `schema` cannot be used, as [{loc, msg}] (loc "schema", or a dotted path into it); []
    when it can. The size is checked first; the rest stops after MAX_CHECK_STEPS steps."""
    if not isinstance(schema, dict):
        return [{"loc": "schema", "msg": "must be a JSON object"}]
    if _depth(schema) > MAX_DEPTH:
        return [{"loc": "schema", "msg": f"nests objects and arrays too deep: at most {MAX_DEPTH} levels are allowed"}]
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    if (size := len(text.encode())) > MAX_BYTES:
        return [{"loc": "schema", "msg": f"is {size} bytes as compact JSON; at most {MAX_BYTES} are allowed"}]
    return [dict(problem) for problem in _checked(text)]


@functools.lru_cache(maxsize=256)
def _checked(text: str) -> tuple[dict, ...]:
    """The checks of a schema within the limits, by its text with sorted keys (PostgreSQL's jsonb stores the
    keys of the card's schema in an order of its own): a card's schema is checked again at each edit, which
    need not take the metaschema's 0.5 s (29 KB) each time. The answer is the same in every process: the limit
    counts steps, not CPU time."""
    schema = json.loads(text)
    draft = _draft(schema)
    if draft is jsonschema.Draft3Validator:
        return ({"loc": "schema", "msg": "draft-03 is not supported: use draft-04 or later"},)
    token = _budget.set(_Budget(MAX_CHECK_STEPS, None))
    try:
        # The draft's metaschema, evaluated by the same RE2 validator and without format checks: jsonschema's own
        # check_schema would compile every pattern with Python's `re` (the metaschema's `format: regex`).
        meta = _validator_class(draft)(draft.META_SCHEMA, registry=_NOTHING)
        for error in meta.iter_errors(schema):
            return ({"loc": "schema", "msg": f"is not a valid JSON Schema: {error.message}"},)
        return tuple(_walk(schema, draft))
    except _TooMuchWork as exc:
        return ({"loc": "schema", "msg": f"takes {exc.args[0]} to check: simplify it"},)
    finally:
        _budget.reset(token)


def _depth(value: Any) -> int:
    """How deep objects and arrays nest in `value` (1: not at all), counted no further than MAX_DEPTH + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if items is not None:
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
            stack.extend((item, depth + 1) for item in items)
    return deepest


def _specification(draft: type) -> referencing.Specification:
    return referencing.jsonschema.specification_with(
        draft.META_SCHEMA.get("$id") or draft.META_SCHEMA.get("id"), default=referencing.jsonschema.DRAFT202012
    )


def _crawled(schema: dict, draft: type) -> referencing.Registry:
    """A registry of the schema alone (nothing to retrieve), its anchors and embedded resources found once: a
    registry not crawled ahead crawls the whole document again at each `#anchor` looked up (480 of them in 31 KB:
    2.4 s)."""
    resource = _specification(draft).create_resource(schema)
    return _NOTHING.with_resource(resource.id() or "", resource).crawl()


def _walk(schema: dict, draft: type) -> Iterator[dict]:
    """Every subschema, in place and behind every `$ref`: its references (local, resolvable) and its patterns
    (RE2). A subschema reached only through a `$ref` is reported at that `$ref`."""
    specification = _specification(draft)
    root = _crawled(schema, draft).resolver(base_uri=specification.id_of(schema) or "")
    stack: list[tuple[Any, referencing.Resolver, tuple]] = [(schema, root, ())]
    behind_refs: list[tuple[Any, referencing.Resolver, tuple]] = []
    seen: set[int] = set()
    has_pattern_properties = has_unevaluated = None
    while stack or behind_refs:
        node, resolver, path = stack.pop() if stack else behind_refs.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if any(isinstance(node.get(key), str) for key in ("$id", "id")):
            resolver = resolver.in_subresource(specification.create_resource(node))
        for keyword in _REFS:
            ref = node.get(keyword)
            if not isinstance(ref, str):
                continue
            loc = _loc(*path, keyword)
            if not ref.startswith("#"):
                yield {
                    "loc": loc,
                    "msg": f"{ref!r} is outside the schema: only references within it (#...) are allowed",
                }
                continue
            try:
                resolved = resolver.lookup(ref)
            except referencing.exceptions.Unresolvable:
                yield {"loc": loc, "msg": f"{ref!r} points at nothing in the schema"}
                continue
            behind_refs.append((resolved.contents, resolved.resolver, (*path, keyword)))
        if isinstance(pattern := node.get("pattern"), str):
            yield from _pattern_problem(pattern, _loc(*path, "pattern"))
        if isinstance(named := node.get("patternProperties"), dict):
            has_pattern_properties = has_pattern_properties or _loc(*path, "patternProperties")
            for pattern in named:
                yield from _pattern_problem(pattern, _loc(*path, "patternProperties"))
        if "unevaluatedProperties" in node:
            has_unevaluated = has_unevaluated or _loc(*path, "unevaluatedProperties")
        stack.extend(_subschemas(node, resolver, path))
    if has_pattern_properties and has_unevaluated:
        yield {
            "loc": has_unevaluated,
            "msg": "is not supported in a schema with patternProperties "
            f"({has_pattern_properties}): use additionalProperties",
        }


def _subschemas(node: dict, resolver, path: tuple) -> Iterator[tuple]:
    for keyword in _SCHEMA:
        if isinstance(node.get(keyword), dict):
            yield node[keyword], resolver, (*path, keyword)
    for keyword in _SCHEMAS:
        if isinstance(node.get(keyword), list):
            yield from ((each, resolver, (*path, keyword, i)) for i, each in enumerate(node[keyword]))
    for keyword in _NAMED:
        if isinstance(node.get(keyword), dict):
            yield from ((each, resolver, (*path, keyword, name)) for name, each in node[keyword].items())


def _pattern_problem(pattern: str, loc: str) -> Iterator[dict]:
    try:
        _spend(1 + _compiled(pattern).programsize // PROGRAM_PER_STEP)  # overrun by one compile at most
    except re2.error as exc:
        why = _why(exc)
        hint = (
            "a counted repetition of a large class, such as [\\p{L}]{1,200}, is too large: write + and maxLength"
            if "too large" in why
            else "patterns are RE2 syntax, which has no backreferences or lookaround and runs in linear time"
        )
        yield {"loc": loc, "msg": f"{pattern!r} is not a pattern RE2 accepts ({why}): {hint}"}


def _loc(*path) -> str:
    return ".".join(map(str, ("schema", *path)))


# --- where a value does not fit ----------------------------------------------------------------------------------


def errors(schema: dict, value: Any, prefix: str = "") -> list[dict]:
    """Where `value` does not fit `schema` (one problems() accepted), as [{loc, msg}] (loc dotted, under `prefix`;
    "payload" for the value itself). Raises Unusable when the schema cannot be evaluated on this value."""
    draft = _draft(schema)
    validator = _validator_class(draft)(schema, registry=_crawled(schema, draft))
    token = _budget.set(_Budget(MAX_STEPS, MAX_CPU))
    try:
        found = list(validator.iter_errors(value))
    except _TooMuchWork as exc:
        raise Unusable([{"loc": "schema", "msg": f"takes {exc.args[0]} to check this value: simplify it"}]) from None
    except RecursionError:
        raise Unusable([{"loc": "schema", "msg": "refers to itself without end"}]) from None
    except referencing.exceptions.Unresolvable as exc:
        raise Unusable([{"loc": "schema", "msg": f"has a $ref that points at nothing ({exc})"}]) from None
    finally:
        _budget.reset(token)
    return [
        {"loc": ".".join(str(p) for p in (prefix, *error.absolute_path) if p != "") or "payload", "msg": error.message}
        for error in sorted(found, key=lambda e: list(map(str, e.absolute_path)))
    ]


# --- the two uses: the ask, and a reviewer's edit of its card -----------------------------------------------------


def ask_errors(schema: Any, arguments: Any) -> list[dict]:
    """Why an ask with this schema and these arguments is refused (422), as [{loc, msg}]: what makes the schema
    unusable, else where the arguments do not fit it (loc under "arguments"); [] when nothing does."""
    if found := problems(schema):
        return found
    if found := personal_data_errors(schema, arguments):
        return found
    try:
        return errors(schema, arguments, "arguments")
    except Unusable as exc:
        return exc.errors


def personal_data_errors(schema: dict, arguments: Any) -> list[dict]:
    """A schema may mark arguments as personal data (`"x-pii": true` on a property; docs/personal-data.md): the
    console keeps them sealed under the subject its root `"x-pii-subject"` names (a dotted path into the arguments).
    Refused (422): marks without a subject, or arguments that lack it."""
    if pii.MARK not in json.dumps(schema):
        return []  # marks nothing: nothing to walk
    try:
        paths = pii.check_schema(schema)
    except pii.SchemaError as exc:
        return [{"loc": f"schema.{pii.SUBJECT}", "msg": str(exc)}]
    if not paths:
        return []
    subject = arguments
    for part in schema[pii.SUBJECT].split("."):
        subject = subject.get(part) if isinstance(subject, dict) else None
    if subject is None or isinstance(subject, bool) or not isinstance(subject, str | int) or str(subject).strip() == "":
        return [
            {
                "loc": f"arguments.{schema[pii.SUBJECT]}",
                "msg": f"is the personal data's subject ({pii.SUBJECT}): a non-empty string or integer is required",
            }
        ]
    return []


def edit_errors(schema: Any, edited: Any) -> list[dict]:
    """Where a reviewer's edit does not fit the card's schema. A card opened before these checks existed may hold
    a schema they would have refused: its edits are refused, saying so (loc "schema"), never a 500 or a stalled
    thread; the card can still be approved as asked or rejected."""
    try:
        if not (found := problems(schema)):
            return errors(schema, edited)
    except Unusable as exc:
        found = exc.errors
    why = "; ".join(f"{e['loc']} {e['msg']}" for e in found)
    return [{"loc": "schema", "msg": f"the agent's schema for this action is unusable ({why}): approve or reject"}]
