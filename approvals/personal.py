"""Personal data on cards (docs/personal-data.md "Who can see it"): what a card keeps, and who sees it in clear.

A card keeps references (`pii:<id>`, core.pii), never clear values: the fields its proposal's schema marks
`x-pii` are sealed before the card and its args hash are written (`seal_proposal`, from approvals.cards.open_card,
the one door of cards), and an edit keeps them sealed (`keep_personal`, from the edit form and Approval.decide).
The args hash is therefore over references, which is what every view shows masked: a person approves what they
were shown.

Every page and API answer masks references (console.middleware.PersonalDataMiddleware). Seeing a card's personal
data in clear is a reveal: `reveal` here, for whoever holds `view_pii` on the card's channel
(core.access.may_view_pii), and each reveal writes one audit entry `pii.view` (who, which card, which fields: the
paths and references, never the values). Logs and traces carry references only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import transaction

from approvals import edits
from core import pii
from core.access import Forbidden, may_view_pii
from core.models import AuditEntry, PiiValue
from runs.gates import GateSpec

if TYPE_CHECKING:
    from approvals.models import Approval

VIEW = "pii.view"  # the audit action of a reveal


# --- which schema marks a card's personal data ---------------------------------------------------------------


def proposal_schema(spec: GateSpec | None) -> dict | None:
    """The JSON Schema of a gate's proposal: an external request's own (external.asks.SchemaGate.schema), else the
    gate's pydantic proposal model's (`json_schema_extra={"x-pii": True}` on a field, the model's
    `json_schema_extra={"x-pii-subject": ...}`); None when the gate declares none."""
    if spec is None:
        return None
    schema = getattr(spec, "schema", None)  # an external request's gate carries the agent's schema
    if isinstance(schema, dict):
        return schema
    return spec.proposal.model_json_schema() if spec.proposal is not None else None


def schema_of(card: Approval) -> dict | None:
    """The schema of `card`'s proposal (its gate's), or None: no gate, or one this process cannot resolve."""
    try:
        return proposal_schema(edits.gate_spec(card))
    except edits.GateUnresolved:
        return None


# --- sealing what a card keeps -------------------------------------------------------------------------------


def seal_proposal(run_id, data: Any, schema: dict | None, *, create: bool = True) -> Any:
    """`data` with each value `schema` marks `x-pii` replaced by a reference (core.pii.seal_marked, the field named
    by its path). A value this run has sealed at the same path before gets the same reference again, so that the
    same proposal gives the same card and the same args hash each time it is asked (a resumed run asks its gate
    again with the values in clear). `create=False`: only those, nothing new sealed (to find a card, not open one).
    SchemaError when the schema marks data and names no subject, or the data lacks it."""
    if not isinstance(schema, dict) or not isinstance(data, dict):
        return data
    paths = pii.check_schema(schema)
    if not paths:
        return data
    known = _sealed_at(run_id, paths)
    for path in paths:
        data = _reuse(data, path.split("."), path, known)
    return pii.seal_marked(data, schema, run_id=run_id) if create else data


def card_proposal(run_id, proposed: Any, schema: dict | None, *, create: bool = True) -> Any:
    """A proposal as its card keeps it: the values its schema marks sealed (`seal_proposal`), and any clear value of
    the run's personal data elsewhere in it (a name in a note) replaced by its reference (core.pii.scrub). The same
    proposal gives the same result each time (the args hash a resumed gate finds its card by)."""
    sealed = seal_proposal(run_id, proposed, schema, create=create)
    return pii.scrub(sealed, pii.known_for_run(run_id)) if run_id is not None else sealed


def scrub_for_run(run_id, value: Any) -> Any:
    """`value` (a card's summary, current state, citations, headline) with the run's personal values in it
    replaced by their references."""
    if run_id is None or not value:
        return value
    return pii.scrub(value, pii.known_for_run(run_id))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _sealed_at(run_id, fields: list[str]) -> dict[tuple[str, str], str]:
    """The run's sealed values at these fields: (field, canonical JSON of the value) -> reference."""
    if run_id is None:
        return {}
    rows = PiiValue.objects.filter(run_id=run_id, field__in=fields).order_by("created_at").values_list("id", "field")
    refs = {pii.PREFIX + value_id.hex: field for value_id, field in rows}
    opened = pii.open_many(refs)
    return {
        (refs[ref], _canonical(found.value)): ref
        for ref, found in opened.items()
        if not found.erased and not found.missing
    }


def _reuse(node: Any, parts: list[str], path: str, known: dict) -> Any:
    if not parts:
        if node is None or pii.is_ref(node):
            return node
        return known.get((path, _canonical(node)), node)
    head, rest = parts[0], parts[1:]
    name = head.removesuffix("[]")
    if not isinstance(node, dict) or name not in node:
        return node
    if head.endswith("[]"):
        items = node[name]
        return {**node, name: [_reuse(item, rest, path, known) for item in items]} if isinstance(items, list) else node
    return {**node, name: _reuse(node[name], rest, path, known)}


def keep_personal(card: Approval, payload: Any) -> Any:
    """An edit of `card` as it is kept: references stay references. A mask of one of the card's values left as it
    was shown (the form and the API show masks) is its reference again; a clear value of the run's personal data
    typed back in is its reference (core.pii.scrub); a new value of a field the schema marks is sealed. A mask
    two of the card's values share cannot say which one it was, and stays as typed."""
    if not isinstance(payload, dict):
        return payload
    shown = pii.present({ref: ref for ref in refs_of(card)})
    by_mask: dict[str, str | None] = {}
    for ref, mask in shown.items():
        if mask not in (pii.ERASED, "***"):
            by_mask[mask] = None if mask in by_mask else ref
    payload = pii.scrub(payload, {mask: ref for mask, ref in by_mask.items() if ref is not None})
    payload = pii.scrub(payload, pii.known_for_run(card.run_id))
    return seal_proposal(card.run_id, payload, schema_of(card))


# --- who sees it ---------------------------------------------------------------------------------------------


def refs_of(card: Approval) -> set[str]:
    """Every reference the card shows: its proposal, the current state, rationale, display and its edits."""
    return {ref for _, ref in _where(card)}


def _where(card: Approval) -> list[tuple[str, str]]:
    """(path on the card, reference) for each reference on it: `proposed.customer.email`, `edit.3.payload.to`."""
    found: list[tuple[str, str]] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, str):
            found.extend((path, ref) for ref in pii.REF.findall(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}")
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                walk(item, f"{path}.{index}")

    for name in ("proposed", "current", "summary", "headline", "citations"):
        walk(getattr(card, name), name)
    for decision in card.decisions.all():
        if decision.payload:
            walk(decision.payload, f"edit.{decision.pk}.payload")
    return found


@dataclass(frozen=True)
class Revealed:
    """One personal value of a card, in clear: where it is on the card, its reference, its value (None when erased)."""

    path: str
    ref: str
    field: str
    value: Any
    erased: bool

    def as_dict(self) -> dict:
        """As the API answers it: without the reference (every answer masks references; the audit entry has it)."""
        return {"path": self.path, "field": self.field, "value": self.value, "erased": self.erased}


def reveal(card: Approval, user, *, via: str = "console") -> list[Revealed]:
    """The card's personal values in clear, for a holder of `view_pii` on its channel (Forbidden for anyone else:
    nothing opened, nothing audited), with one audit entry `pii.view` naming the user, the card and the fields.
    An erased value is said to be erased. A missing or wrong key raises (core.pii): nothing is shown."""
    if not may_view_pii(user, card.channel):
        raise Forbidden(f"You may not see the personal data of cards on {card.channel.name} (view_pii).")
    where = _where(card)
    opened = pii.open_many(ref for _, ref in where)
    shown = [
        Revealed(
            path=path,
            ref=ref,
            field=opened[ref].field,
            value=None if opened[ref].erased or opened[ref].missing else opened[ref].value,
            erased=opened[ref].erased or opened[ref].missing,
        )
        for path, ref in where
        if ref in opened
    ]
    if shown:
        with transaction.atomic():
            AuditEntry.record(
                VIEW,
                actor=user,
                target=f"approval:{card.pk}",
                run_id=card.run_id,
                approval_id=card.pk,
                channel=card.channel.name,
                data={
                    "fields": [item.path for item in shown],
                    "refs": sorted({item.ref for item in shown}),
                    "via": via,
                },
            )
    return shown
