"""Personal data in a run's flow (docs/personal-data.md); the vault itself is core.pii.

Where personal values come into a run, they are sealed before anything is written, and the run holds their
references (`pii:<id>`) from then on:

- a run's input: the fields its workflow's input schema marks `x-pii` (runs.submission, `seal_input`);
- what a read step or a read tool returns: the fields its `pii=Pii(...)` declares (`seal_read`), before its
  checkpoint (runs.engine) or its tool call's record (runs.agent).

A step that must hand clear values to an external system asks for them (`ctx.pii(obj)`: runs.steps.Context.pii),
which remembers what it revealed (clear -> reference, a `Known`), so that what comes back (the effect's answer, an
error's text, the step's tape and output) is scrubbed back to references before it is written. The model sees
references only, and so do logs and traces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core import pii
from core.models import PiiSubject
from runs.errors import Fatal, Stop


@dataclass(frozen=True)
class Pii:
    """The personal fields of what a read step or a read tool returns: `fields`, dotted paths into its answer
    (`"name"`, `"contact.email"`, `"emails[]"` for each item of a list), and `subject`, the path of the field that
    identifies the person whose key seals them (`"id"`). `@workflow.read(pii=Pii(...))`, `@tool(pii=Pii(...))`."""

    fields: tuple[str, ...]
    subject: str

    def __post_init__(self) -> None:
        if isinstance(self.fields, str) or not self.fields or not all(isinstance(f, str) and f for f in self.fields):
            raise ValueError("Pii(fields=...) takes a tuple of dotted paths, at least one")
        if not isinstance(self.subject, str) or not self.subject.strip():
            raise ValueError("Pii(subject=...) names the field that identifies the person (a dotted path)")

    def schema(self) -> dict:
        """The JSON Schema the vault reads its marks from (core.pii.seal_marked): `x-pii` at each field."""
        root: dict = {"type": "object", "properties": {}, pii.SUBJECT: self.subject}
        for path in self.fields:
            node = root
            parts = path.split(".")
            for position, part in enumerate(parts):
                last = position == len(parts) - 1
                name = part.removesuffix("[]")
                child = node.setdefault("properties", {}).setdefault(name, {})
                if part.endswith("[]"):
                    child = child.setdefault("items", {})
                if last:
                    child[pii.MARK] = True
                node = child
        return root


def marks(schema: dict | None) -> list[str]:
    """The paths a JSON Schema marks personal; SchemaError when it marks them and names no subject."""
    return pii.check_schema(schema) if isinstance(schema, dict) else []


def subject_path(schema: dict | None) -> str:
    """The `x-pii-subject` a schema names ("" when none)."""
    found = schema.get(pii.SUBJECT) if isinstance(schema, dict) else None
    return found.strip() if isinstance(found, str) else ""


def subject_of(data: Any, schema: dict | None) -> str | None:
    """The subject `data` is about, by its schema's `x-pii-subject` (None when it names none or the data lacks it)."""
    path = subject_path(schema)
    if not path:
        return None
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return None if data is None or isinstance(data, dict | list | bool) else str(data)


def check_not_erased(subject: str | None) -> None:
    """pii.Erased when `subject` was erased: nothing of theirs is taken in again under the same identity."""
    if subject is None:
        return
    row = PiiSubject.objects.filter(subject=subject).only("subject", "erased_at").first()
    if row is not None and row.erased_at is not None:
        raise pii.Erased(f"the personal data of subject {subject!r} was erased on {row.erased_at:%Y-%m-%d}")


def seal_input(data: Any, schema: dict | None, run_id) -> Any:
    """A new run's input with the fields its schema marks sealed (references as they are); an erased subject's is
    refused (pii.Erased). An input that marks nothing costs no query (submission's round trips, issue 11): a run of
    an erased subject that only names them is stopped where a read would seal their data (`seal_read`)."""
    if not marks(schema):
        return data
    check_not_erased(subject_of(data, schema))
    return pii.seal_marked(data, schema, field="input", run_id=run_id)


def _erased_stops_the_run(exc: pii.Erased) -> Stop:
    """A run that meets an erased subject's data ends cancelled, as their erasure cancels their runs in flight."""
    return Stop({"outcome": "cancelled", "reason": str(exc)})


def sealed_pairs(clear: Any, sealed: Any) -> dict[str, str]:
    """What sealing replaced: each clear text of `clear` -> the reference at the same place of `sealed`."""
    found: dict[str, str] = {}
    if isinstance(clear, dict) and isinstance(sealed, dict):
        for key, value in clear.items():
            found.update(sealed_pairs(value, sealed.get(key)))
    elif isinstance(clear, list) and isinstance(sealed, list):
        for before, after in zip(clear, sealed, strict=False):
            found.update(sealed_pairs(before, after))
    elif pii.is_ref(sealed) and not pii.is_ref(clear):
        if isinstance(clear, str):
            found[clear] = sealed
        elif clear is not None and not isinstance(clear, bool):
            found[str(clear)] = sealed  # a number: scrubbed from text as its digits
    return found


class Known(dict):
    """The clear values a step's attempt handled, clear text -> its reference: sealed from a read, or revealed by
    `ctx.pii`. What is written from the step (its output, tape, error, an effect's answer) is scrubbed with it."""

    def scrub(self, obj: Any) -> Any:
        return pii.scrub(obj, self) if self else obj

    def scrub_error(self, exc: BaseException) -> BaseException:
        """`exc` (and the errors it chains) with the clear values it quotes replaced by their references, in
        place: its message is recorded on the step, in the dead letter and in the log."""
        seen: set[int] = set()
        error: BaseException | None = exc
        while self and error is not None and id(error) not in seen:
            seen.add(id(error))
            error.args = tuple(self.scrub(arg) if isinstance(arg, str | dict | list) else arg for arg in error.args)
            error = error.__cause__ or error.__context__
        return exc


def seal_read(declared: Pii | None, answer: Any, *, field: str, run_id, known: Known) -> Any:
    """A read's answer with the fields `declared` names sealed (a copy); what was sealed is added to `known`, so
    that the step's tape (which recorded the answer as the system gave it) is scrubbed too."""
    if declared is None or not isinstance(answer, dict):
        return answer
    if subject_of(answer, declared.schema()) is None:
        if any(_holds(answer, path) for path in declared.fields):
            raise Fatal(
                f"{field} answered personal data without its subject ({declared.subject!r}): whose key would seal "
                "it? Not kept"
            )
        return answer  # nothing of a person (an error, a "not found"): nothing to seal
    try:
        sealed = pii.seal_marked(answer, declared.schema(), field=field, run_id=run_id)
    except pii.Erased as exc:
        raise _erased_stops_the_run(exc) from None
    known.update(sealed_pairs(answer, sealed))
    return sealed


def _holds(data: Any, path: str) -> bool:
    """Whether `data` has a value (not None) at a declared field's path."""
    for part in path.split("."):
        name = part.removesuffix("[]")
        if not isinstance(data, dict) or data.get(name) is None:
            return False
        data = data[name]
        if part.endswith("[]"):
            return isinstance(data, list) and any(item is not None for item in data)
    return True


def reveal(obj: Any, known: Known) -> Any:
    """`obj` with its references replaced by their clear values (core.pii.reveal), each clear text remembered in
    `known`. Nothing is ever sent with a placeholder: an erased value ends the run cancelled (Stop), a reference
    the vault does not hold fails it (Fatal), a missing or wrong key raises its own error (core.pii: the step is
    retried, and says why)."""
    refs = pii.refs_in(obj)
    if not refs:
        return obj
    try:
        clear = pii.reveal(obj)
    except pii.Erased as exc:
        raise _erased_stops_the_run(exc) from None
    except pii.NotFound as exc:
        raise Fatal(f"personal data needed by this step cannot be opened: {exc}") from None
    for ref, found in pii.open_many(refs).items():
        if isinstance(found.value, str):
            known[found.value] = ref
        elif found.value is not None and not isinstance(found.value, bool | dict | list):
            known[str(found.value)] = ref
    return clear
