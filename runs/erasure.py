"""Erasing a data subject (docs/personal-data.md): `manage.py erase_subject`, and the PiiSubject admin's action.

One transaction: the subject's data key is destroyed (core.pii.erase_key: every value sealed under it, wherever its
reference was copied, can no longer be opened: crypto-shredding), each of their runs still in flight is cancelled
with the reason (Run.cancel: a parked or queued run ends now and its cards close; a running one stops between
steps, and no effect of it starts any more), and one `pii.erase` audit entry says what was done. The audit chain
still verifies: it hashes references, never the values.

A subject's runs: those holding a value of theirs (PiiValue.run_id), and those whose input names them (the
workflow's input schema's `x-pii-subject`), which may not have sealed anything yet. A run being undone is left to
its undo (a cancel does not stop compensations); the entry lists it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog
from django.db import transaction

from core import pii
from core.models import AuditEntry, PiiSubject
from runs import personal
from runs import workflow as workflows
from runs.errors import TransitionRefused
from runs.models import Run

log = structlog.get_logger("runs.erasure")


class UnknownSubject(LookupError):
    """The vault never held personal data of that subject, and no run names them."""


@dataclass
class Erasure:
    """What erasing a subject did."""

    subject: str
    values: int = 0
    already: bool = False  # erased before: the key was gone already
    cancelled: list[str] = field(default_factory=list)  # run ids
    left: list[str] = field(default_factory=list)  # runs in flight a cancel does not stop (being undone)

    def describe(self) -> str:
        parts = [
            f"subject {self.subject!r}: "
            + ("already erased" if self.already else "key destroyed")
            + f", {self.values} personal value(s) unreadable"
        ]
        parts.append(
            f"{len(self.cancelled)} run(s) in flight cancelled"
            + (f": {', '.join(self.cancelled)}" if self.cancelled else "")
        )
        if self.left:
            parts.append(f"{len(self.left)} run(s) being undone left to their undo: {', '.join(self.left)}")
        return "; ".join(parts)


def reason_for(subject: str, reason: str = "") -> str:
    return f"the personal data of subject {subject} was erased" + (f": {reason}" if reason else "")


def runs_of(subject: str, value_runs: set) -> list[Run]:
    """The subject's runs not finished: those holding a value of theirs, and those whose input names them."""
    ids = set(value_runs)
    for definition in workflows.every_version():
        path = personal.subject_path(definition.input_json_schema())
        if path:
            named = Run.objects.filter(workflow=definition.name, workflow_version=definition.version)
            ids.update(named.filter(**{f"input__{path.replace('.', '__')}": subject}).values_list("id", flat=True))
    return list(Run.objects.filter(id__in=ids).exclude(status__in=Run.FINISHED).order_by("created_at"))


def erase_subject(subject: str, *, by, reason: str = "") -> Erasure:
    """Erase `subject` (module doc), in one transaction; UnknownSubject (nothing done) for a subject neither the
    vault nor any run knows. Erasing again is harmless: nothing new is destroyed; runs in flight are cancelled."""
    subject = str(subject).strip()
    if not subject:
        raise UnknownSubject("name the subject to erase")
    by_name = by if isinstance(by, str) else by.get_username()
    with transaction.atomic():
        already = PiiSubject.objects.filter(subject=subject, erased_at__isnull=False).exists()
        row, values, value_runs = pii.erase_key(subject, by=by_name)
        in_flight = runs_of(subject, value_runs)
        if row is None and not in_flight:
            raise UnknownSubject(f"no personal data of subject {subject!r} is held, and no run in flight names them")
        done = Erasure(subject, values=values, already=already)
        why = reason_for(subject, reason)
        for run in in_flight:
            try:
                run.cancel(by=by, reason=why)
            except TransitionRefused:
                done.left.append(str(run.id))
            else:
                done.cancelled.append(str(run.id))
        AuditEntry.record(
            "pii.erase",
            actor=by,
            target=f"pii-subject:{subject}",
            data={
                "subject": subject,
                "values": values,
                "reason": reason,
                "already_erased": done.already,
                "cancelled_runs": done.cancelled,
                "runs_left_to_their_undo": done.left,
            },
        )
    log.info("subject erased", subject=subject, values=values, cancelled=len(done.cancelled), left=len(done.left))
    return done
