"""Ops' hand on the circuit breakers (runs.breakers) through the API: hold one open, or close it, with a reason;
audited (`breaker.force_open`, `breaker.force_closed`). The dashboard's form does the same (console.dashboard).

Who may (runs.access, for the page and the API alike: `check_may_force_breaker`): ops force breakers; admins see
them but may not (403); anyone else gets 404, as for the dashboard itself.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from ninja import Field, Router, Schema
from ninja.errors import HttpError

from core.access import NotVisible
from core.api import ERRORS
from core.models import KILL_SWITCH_REASON_MAX, ReasonRequired
from core.safe_input import NOT_BLANK
from runs import breakers
from runs.access import check_may_force_breaker, may_see_breakers

router = Router(tags=["breakers"])


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
    if not may_see_breakers(request.user):
        raise NotVisible("No such page.")
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
    check_may_force_breaker(request.user, system)
    try:
        changed = breakers.force(system, open=body.state == "open", by=request.user, reason=body.reason)
    except ReasonRequired as exc:
        raise HttpError(422, str(exc)) from exc
    return _out(system, changed)
