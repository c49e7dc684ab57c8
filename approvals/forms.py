"""The card's decision forms: the decision as posted (DecideForm: which, against which version, with what), and
within it reject (comment + reason) and edit (the proposed payload, field by field).

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

from approvals import edits, links, personal
from approvals.diff import FieldDiff, changes
from approvals.errors import CannotCheckEdit
from approvals.models import Approval, DecisionLink, RejectReason
from approvals.rules import DecisionKind
from core import pii, safe_input

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
    # "Reject and undo" (the second button of the reject form): what the run did is undone too (Approval.decide
    # refuses it, UndoRefused, when the card's kind or run has nothing to undo).
    undo = forms.BooleanField(required=False)


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
            # Personal data stays references: a mask left as shown is its reference again (approvals.personal).
            payload = personal.keep_personal(self.card, payload)
        except pii.SchemaError as exc:
            self.add_error(None, str(exc))
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


MISSING_VERSION = "The card's version is missing: reload the card."
CHOOSE = "Choose approve, edit or reject."


class DecideForm(forms.Form):
    """A decision posted from the card page (approvals.views.decide), parsed in the order its refusals are said: an
    email link's token (`link`: approvals.links.check, whose LinkRefused is raised as it is, with its own status),
    the card's version, the decision, then the decision's own form (`decision_form`: RejectForm, or EditForm,
    whose `preview` decides nothing and shows the edit's diff), with a shadow card's agreement and what was done by
    hand. Its own errors are said on the card, the first one alone (`refusal`); the decision's form shows its own.
    What the decision must fit besides is Approval.decide's (approvals.rules); `decide` takes it."""

    # Field order is the order of the checks (clean_link, then version, then decision) and so of `refusal`.
    link = forms.CharField(required=False, strip=False)
    version = forms.IntegerField(required=False, error_messages={"invalid": MISSING_VERSION})
    decision = forms.ChoiceField(
        choices=DecisionKind.choices, error_messages={"required": CHOOSE, "invalid_choice": CHOOSE}
    )
    comment = forms.CharField(required=False, strip=False)  # an approval's; a rejection's or edit's is their form's
    # A shadow card's: Approval.decide refuses them on any other card, and requires the agreement on these.
    agreement = forms.CharField(required=False, strip=False)
    done_by_hand = forms.CharField(required=False, strip=False)
    preview = forms.CharField(required=False, strip=False)

    def __init__(self, card: Approval, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.card, self.user = card, user
        self.decision_form: RejectForm | EditForm | None = None
        self.via_link: dict | None = None  # {token, decision} of a link that checked out, kept when refused
        self.previewed: list[FieldDiff] | None = None  # an edit's preview: its diff against the proposal

    def clean_link(self) -> DecisionLink | None:
        """From an email's link: it must still be good, for this user, card and decision as posted."""
        token = self.cleaned_data["link"]
        if not token:
            return None
        link = links.check(token, self.user, card_id=self.card.pk, decision=self["decision"].data or "")
        self.via_link = {"token": token, "decision": link.decision}
        return link

    def clean_version(self) -> int:
        if self.cleaned_data["version"] is None:
            raise forms.ValidationError(MISSING_VERSION)
        return self.cleaned_data["version"]

    def clean(self):
        cleaned = super().clean()
        if self.errors:  # the version or the decision: nothing else is read
            return cleaned
        decision = cleaned["decision"]
        if decision == DecisionKind.REJECT:
            self.decision_form = RejectForm(self.data)
        elif decision == DecisionKind.EDIT:
            if (refusal := edits.NOT_EDITED.get(self.card.kind)) is not None:  # a card answered yes or no
                raise forms.ValidationError(f"{refusal[:1].upper()}{refusal[1:]}.")
            self.decision_form = EditForm(self.card, self.data)  # CannotCheckEdit: raised as it is (409)
        valid = self.decision_form is not None and self.decision_form.is_valid()
        if valid and decision == DecisionKind.EDIT and cleaned["preview"]:
            self.previewed = changes(self.card.proposed, self.decision_form.cleaned_data["payload"])
        return cleaned

    def is_valid(self) -> bool:
        """Its own fields, and the decision's form."""
        return super().is_valid() and (self.decision_form is None or self.decision_form.is_valid())

    @property
    def refusal(self) -> str:
        """The first of its own errors, said on the card as InvalidDecision is."""
        return next((str(error) for errors in self.errors.values() for error in errors), "")

    def state(self) -> dict:
        """The card shown again with this post (approvals.views.prepare's `state`): the shadow card's answers, the
        link it came with, the decision's form open with its errors, the edit's preview, and the refusal."""
        state: dict = {}
        if self.card.shadow:
            state["shadow_values"] = self._shadow()
        if self.via_link is not None:
            state["via_link"] = self.via_link
        if isinstance(self.decision_form, RejectForm):
            state.update(reject_form=self.decision_form, opened="reject")
        elif isinstance(self.decision_form, EditForm):
            state.update(edit_form=self.decision_form, opened="edit")
        if self.previewed is not None:
            state["preview"] = self.previewed
        if self.refusal:
            state["error"] = self.refusal
        return state

    def _shadow(self) -> dict:
        return {name: self.cleaned_data.get(name, "") for name in ("agreement", "done_by_hand")}

    def decide(self) -> Approval:
        """Approval.decide with what was posted, or, for a decision carrying an email's link, the same through
        approvals.links (audited `via: email`, the link used in the decision's transaction). Call it on a valid
        form that is no preview; a refusal is raised as Approval.decide raises it (DecisionError)."""
        cleaned, sub = self.cleaned_data, self.decision_form.cleaned_data if self.decision_form else {}
        fields: dict[str, Any] = {"version": cleaned["version"], **self._shadow()}
        if cleaned["decision"] == DecisionKind.APPROVE:
            fields["comment"] = cleaned["comment"]
        elif cleaned["decision"] == DecisionKind.REJECT:
            fields.update(comment=sub["comment"], reason=sub["reason"])
            if sub.get("undo"):
                fields["undo"] = True
        else:
            fields.update(comment=sub.get("comment", ""), payload=sub["payload"])
        link = cleaned["link"]
        if link is None:
            return self.card.decide(self.user, cleaned["decision"], **fields)
        return links.decide_through(link, self.card, self.user, cleaned["decision"], **fields)
