"""Ops' hand on the circuit breakers (runs.breakers) through the API: hold one open, or close it, with a reason;
audited (`breaker.force_open`, `breaker.force_closed`). The dashboard's form does the same (console.dashboard).

Who may (DESIGN "Roles"), checked on the server for the page and the API alike (`check_may_force`): the ops
group and superusers force breakers; admins see them but may not (403); anyone else gets 404, as for the
dashboard itself.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from django.core.exceptions import PermissionDenied
from django.http import Http404
from ninja import Field, Router, Schema
from ninja.errors import HttpError

from core.api import ERRORS
from core.models import KILL_SWITCH_REASON_MAX, ReasonRequired, Role
from core.safe_input import NOT_BLANK
from runs import breakers

router = Router(tags=["breakers"])


def sees_breakers(user) -> bool:
    return user.is_superuser or user.groups.filter(name__in=[Role.OPS, Role.ADMIN]).exists()


def may_force(user) -> bool:
    return user.is_authenticated and (user.is_superuser or user.groups.filter(name=Role.OPS).exists())


def check_may_force(user, system: str) -> None:
    """Http404 for those who may not see the breakers (or a system without one), PermissionDenied for those who
    may see them but not force them."""
    if not sees_breakers(user) or system not in breakers.known_systems():
        raise Http404("No such circuit breaker.")
    if not may_force(user):
        raise PermissionDenied("Only ops may force a circuit breaker.")


class BreakerIn(Schema):
    state: Literal["open", "closed"] = Field(description="`open`: held open until closed by hand; `closed`.")
    reason: str = Field(
        max_length=KILL_SWITCH_REASON_MAX,
        description="Why, for opening and closing alike: what the next person on call reads. Not blank.",
        json_schema_extra={"pattern": NOT_BLANK},  # runs.breakers.force is the one that refuses
    )


class BreakerOut(Schema):
    system: str
    state: str = Field(description="closed, open, half_open, or forced_open (held open by ops).")
    open_until: datetime | None = Field(description="When the next probe may go; null when closed or forced.")
    calls: int = Field(description="Calls in the sliding window.")
    failures: int = Field(description="Failed calls in the sliding window.")
    held_back: int = Field(description="Calls held back since it last opened.")
    changed_by: str
    changed_at: datetime | None
    changed: bool = Field(default=False, description="False when the breaker was already in that state.")


def _out(system: str, changed: bool = False) -> dict:
    breaker = next(b for b in breakers.states() if b.system == system)
    return {
        "system": system,
        "state": breaker.shown_state,
        "open_until": breaker.open_until,
        "calls": breaker.calls,
        "failures": breaker.failures,
        "held_back": breaker.held_back,
        "changed_by": breaker.changed_by,
        "changed_at": breaker.changed_at if breaker.pk else None,
        "changed": changed,
    }


# The operation ids are those these operations had before they moved here from console.breakers (issue 18): a
# client generated from the OpenAPI document keeps its method names.


@router.get(
    "/breakers",
    response={200: list[BreakerOut], **ERRORS},
    summary="The circuit breakers of the external systems",
    description="For ops and admins.",
    operation_id="console_breakers_api_breakers",
)
def api_breakers(request):
    if not sees_breakers(request.user):
        raise Http404("No such page.")
    return [_out(breaker.system) for breaker in breakers.states()]


@router.post(
    "/breakers/{system}",
    response={200: BreakerOut, **ERRORS},
    summary="Hold a circuit breaker open, or close it",
    description="For the ops group. `open` holds calls to the system back (steps that need it wait) until "
    "someone closes it; `closed` lets calls through again and counts failures from nothing. Idempotent: asking "
    "for the state it is already in changes nothing (`changed: false`). Audited.",
    operation_id="console_breakers_api_force_breaker",
)
def api_force_breaker(request, system: str, body: BreakerIn):
    try:
        check_may_force(request.user, system)
    except PermissionDenied as exc:
        raise HttpError(403, str(exc)) from exc
    try:
        changed = breakers.force(system, open=body.state == "open", by=request.user, reason=body.reason)
    except ReasonRequired as exc:
        raise HttpError(422, str(exc)) from exc
    return _out(system, changed)
