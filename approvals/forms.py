"""The card's decision forms: reject (comment + reason) and edit (the proposed payload, field by field).

The edit form is built from what the card runs (its `proposed` object, or the pending edit of a card that waits
for a second person) and its gate's declaration (approvals.edits): one field per editable leaf, of the leaf's own
type (an int stays an int); the other leaves are shown as they are. Cards whose payload is not a flat-enough
object get one JSON textarea instead. Either way the payload is checked by the same validator that
Approval.decide() applies, so the form refuses exactly what the API refuses.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from django import forms
from django.contrib.auth.models import User
from django.core.validators import RegexValidator

from approvals import edits
from approvals.errors import CannotCheckEdit
from approvals.models import RejectReason
from core import safe_input

COMMENT_MAX = 5000
CURRENCY = RegexValidator(r"^[A-Z]{3}\Z", "A currency is a three-letter ISO code, such as EUR.")


class AwayForm(forms.Form):
    """ "Away until ..., cover: X". The rules (not yourself, in the future, X may approve your channels) are
    approvals.models.Delegation.refusal, checked when it is set; this form only reads the fields."""

    cover = forms.ModelChoiceField(
        queryset=User.objects.none(),
        to_field_name="username",
        error_messages={"required": "Choose who covers for you.", "invalid_choice": "Choose one of the listed users."},
    )
    until = forms.DateTimeField(
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
        input_formats=["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M"],
        error_messages={"required": "Say until when you are away.", "invalid": "Enter a date and time."},
    )

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Every active user but a superuser's own listing: who may approve which channel is checked on save.
        self.fields["cover"].queryset = User.objects.filter(is_active=True).order_by("username")


class RejectForm(forms.Form):
    reason = forms.ChoiceField(
        choices=[("", "Choose a reason…"), *RejectReason.choices],
        error_messages={"required": "Choose a reason.", "invalid_choice": "Choose one of the listed reasons."},
    )
    comment = forms.CharField(
        max_length=COMMENT_MAX,
        widget=forms.Textarea(attrs={"rows": 3}),
        error_messages={"required": "A rejection needs a comment saying why."},
    )


def _leaves(value: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, item in sorted(value.items(), key=lambda kv: str(kv[0])):  # the order of the card's diff
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(item, dict) and item:
            out += _leaves(item, path)
        else:
            out.append((path, item))
    return out


def _set(payload: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for key in parents:
        payload = payload[key]
    payload[last] = value


def _is_scalar(value: Any) -> bool:
    return isinstance(value, str | int | float | bool) and value is not None


class EditForm(forms.Form):
    """The proposed payload as editable fields (`p:<path>`), or one JSON textarea (`payload_json`)."""

    comment = forms.CharField(max_length=COMMENT_MAX, required=False, widget=forms.Textarea(attrs={"rows": 2}))

    def __init__(self, card, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.card = card
        # It starts from what runs (a pending edit, else the proposal); what it makes is checked against the
        # proposal all the same (approvals.edits).
        to_run = card.to_execute
        self.proposed = proposed = to_run if to_run is not None else card.proposed
        leaves = _leaves(proposed) if isinstance(proposed, dict) else []
        self.structured = bool(leaves) and all(_is_scalar(value) for _, value in leaves)
        paths = [path for path, _ in leaves]
        # The gate's editable leaves when it declares them, else every leaf (whose shape may not change).
        declared = edits.editable_paths(card)
        self.editable = [path for path in declared if path in paths] if declared is not None else paths
        self.fixed: list[tuple[str, Any]] = []
        if not self.structured:
            self.fields["payload_json"] = forms.CharField(
                label="Payload (JSON)",
                initial=json.dumps(proposed, indent=2, ensure_ascii=False),
                widget=forms.Textarea(attrs={"rows": 12, "spellcheck": "false", "class": "card-json"}),
                error_messages={"required": "The payload is required."},
            )
            return
        for path, value in leaves:
            if path not in self.editable:
                self.fixed.append((path, value))
                continue
            self.fields[f"p:{path}"] = self._field_for(path, value)
        self.order_fields([name for name in self.fields if name != "comment"] + ["comment"])

    @staticmethod
    def _field_for(path: str, value: Any) -> forms.Field:
        label = path
        if isinstance(value, bool):
            return forms.BooleanField(label=label, required=False, initial=value)
        if isinstance(value, int):
            minimum = 1 if path.endswith("amount_cents") else None
            return forms.IntegerField(label=label, initial=value, min_value=minimum)
        if isinstance(value, float):
            return forms.FloatField(label=label, initial=value)
        widget = forms.Textarea(attrs={"rows": 6}) if "\n" in value or len(value) > 120 else forms.TextInput()
        if path.rsplit(".", 1)[-1] == "currency":
            return forms.CharField(label=label, initial=value, widget=widget, validators=[CURRENCY])
        # An empty proposed string may stay empty; a non-empty one may not be blanked.
        return forms.CharField(label=label, initial=value, widget=widget, required=bool(value.strip()), strip=False)

    def field_rows(self):
        """(bound field or None, path, fixed value) in the proposal's order, for the template."""
        rows = []
        for path, value in _leaves(self.proposed) if self.structured else []:
            name = f"p:{path}"
            rows.append((self[name] if name in self.fields else None, path, value))
        return rows

    def clean(self):
        cleaned = super().clean()
        if self.structured:
            payload = copy.deepcopy(self.proposed)
            for path, _value in _leaves(self.proposed):
                name = f"p:{path}"
                if name in self.fields and name in cleaned:
                    new = cleaned[name]
                    if isinstance(new, str):
                        new = new.replace("\r\n", "\n")
                    _set(payload, path, new)
            return self._checked(cleaned, payload)
        raw = cleaned.get("payload_json")
        if raw is None:
            return cleaned
        try:
            payload = safe_input.loads(raw, root="payload")  # NaN, NUL, lone surrogates... are not JSON here
        except ValueError as exc:
            self.add_error("payload_json", f"Not valid JSON: {exc}")
            return cleaned
        return self._checked(cleaned, payload)

    def _checked(self, cleaned: dict, payload) -> dict:
        """The one validator of edits (approvals.edits), each error on its field when it has one."""
        if self.errors:
            return cleaned
        try:
            errors = edits.edit_errors(self.card, payload)
        except edits.GateUnresolved as exc:
            raise CannotCheckEdit(str(exc)) from exc  # the card page answers 409, as Approval.decide would
        for error in errors:
            name = f"p:{error['loc']}"
            self.add_error(name if name in self.fields else None, f"{error['loc']} {error['msg']}")
        if not self.errors:
            cleaned["payload"] = payload
        return cleaned
