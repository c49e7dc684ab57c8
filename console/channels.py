"""Kill switches: the channels page (engage or release, with a reason, in one click) and the API for automation.

Who may do what (core.access), for the page and the API alike: a channel's switch is flipped by users with
`operate_channel` on that channel, the global switch by ops; ops and admins see every channel (read-only where
they may not act); anyone else sees only the channels they operate, and gets 404 when that is none.
The state changes themselves (locking, audit, resuming runs) live on the models: Channel.engage_kill_switch,
Channel.release_kill_switch, and the same two methods on GlobalKillSwitch.
"""

from __future__ import annotations

from datetime import datetime

import structlog
from django import forms
from django.db.models import Count
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST
from django.views.decorators.vary import vary_on_headers
from django_htmx.http import trigger_client_event
from ninja import Field, Router, Schema
from ninja.errors import HttpError

from core.access import channel_for, global_switch_for, operable_channels, operates, visible_channels
from core.api import ERRORS
from core.models import GLOBAL_SWITCH, KILL_SWITCH_REASON_MAX, Channel, GlobalKillSwitch, ReasonRequired
from core.safe_input import NOT_BLANK
from core.views import HtmxHttpRequest
from runs.models import Run

log = structlog.get_logger("console.channels")

router = Router(tags=["channels"])

TEMPLATE = "console/channels.html"
EVENT = "kill-switch-changed"  # htmx event sent after a switch changes; the page summary listens for it


# --- the page ----------------------------------------------------------------------------------------------


class KillSwitchForm(forms.Form):
    action = forms.ChoiceField(choices=[("engage", "Engage"), ("release", "Release")])
    reason = forms.CharField(
        max_length=KILL_SWITCH_REASON_MAX,
        error_messages={"required": "Give a reason: it is what the next person on call will read."},
    )


def _set(switch: Channel | GlobalKillSwitch, engaged: bool, user, reason: str) -> bool:
    """Engage or release (a Channel and the GlobalKillSwitch share the two methods). True when it changed."""
    changed = switch.engage_kill_switch(user, reason) if engaged else switch.release_kill_switch(user, reason)
    if changed:
        log.warning(
            "kill switch " + ("engaged" if engaged else "released"),
            switch=getattr(switch, "name", "global"),
            by=user.get_username(),
            reason=reason,
        )
    return changed


def _paused_counts() -> dict[str, int]:
    rows = (
        Run.objects.filter(status=Run.Status.PAUSED)
        .exclude(paused_switch="")
        .values_list("paused_switch")
        .annotate(n=Count("pk"))
    )
    return dict(rows)


def _page_context(user) -> dict:
    counts = _paused_counts()
    operable = set(operable_channels(user).values_list("pk", flat=True))
    channels = list(visible_channels(user).select_related("kill_switch_by"))
    for channel in channels:
        channel.can_operate = channel.pk in operable
        channel.paused_runs = counts.get(channel.name, 0)
    switch = GlobalKillSwitch.load()
    switch.can_operate = operates(user)
    switch.paused_runs = counts.get(GLOBAL_SWITCH, 0)
    return {
        "channels": channels,
        "global_switch": switch,
        "engaged_count": sum(channel.kill_switch_engaged for channel in channels),
        "paused_total": sum(counts.values()),
    }


@require_GET
@vary_on_headers("HX-Request", "HX-Target")
def channel_list(request: HtmxHttpRequest):
    context = _page_context(request.user)
    template = TEMPLATE
    if request.htmx and request.htmx.target == "switch-summary":
        template += "#summary"
    return render(request, template, context)


def _flip_from_form(request: HtmxHttpRequest, switch: Channel | GlobalKillSwitch) -> HttpResponse:
    """The POST of one switch's form: flip, then answer with its re-rendered partial (htmx) or the page."""
    form = KillSwitchForm(request.POST)
    changed = False
    if form.is_valid():
        try:
            changed = _set(switch, form.cleaned_data["action"] == "engage", request.user, form.cleaned_data["reason"])
        except ReasonRequired as exc:
            form.add_error("reason", str(exc))
    status = 422 if form.errors else 200
    if request.htmx:
        switch.can_operate, switch.paused_runs = True, Run.paused_by(switch.switch_key).count()
        switch.form = form if form.errors else None
        # A 422 is swapped in all the same (the page's hx-on handler), to show the error in place.
        response = render(request, f"{TEMPLATE}#row", {"switch": switch}, status=status)
        if changed:
            trigger_client_event(response, EVENT, after="settle")
        return response
    if not form.errors:
        return redirect("channels")
    context = _page_context(request.user)  # without JavaScript: the whole page, the error in its row
    for shown in [context["global_switch"], *context["channels"]]:
        if type(shown) is type(switch) and shown.pk == switch.pk:
            shown.form = form
    return render(request, TEMPLATE, context, status=status)


@require_POST
def channel_kill_switch(request: HtmxHttpRequest, name: str):
    return _flip_from_form(request, channel_for(request.user, name, to_operate=True))


@require_POST
def global_kill_switch(request: HtmxHttpRequest):
    return _flip_from_form(request, global_switch_for(request.user, to_operate=True))


# --- the API -----------------------------------------------------------------------------------------------


class KillSwitchIn(Schema):
    # Strict, as the document says (a boolean): `0.0` or "false" is a 422, never taken for a release.
    engaged: bool = Field(strict=True)
    reason: str = Field(
        max_length=KILL_SWITCH_REASON_MAX,
        description="Why, for engaging and releasing alike: what the next person on call reads. Not blank.",
        json_schema_extra={"pattern": NOT_BLANK},  # the model's check (ReasonRequired) is the one that refuses
    )


class KillSwitchOut(Schema):
    channel: str | None = Field(description="The channel's name; null for the global switch.")
    engaged: bool
    reason: str = Field(description="The reason given for the last change (engage or release).")
    by: str | None
    at: datetime | None
    runs_paused: int = Field(description="Runs waiting for this switch's release.")
    changed: bool = Field(description="False when the switch was already in the requested state.")


def _api_set(request, switch: Channel | GlobalKillSwitch, body: KillSwitchIn) -> dict:
    try:
        changed = _set(switch, body.engaged, request.user, body.reason)
    except ReasonRequired as exc:
        raise HttpError(422, str(exc)) from exc
    return {
        "channel": getattr(switch, "name", None),
        "engaged": switch.kill_switch_engaged,
        "reason": switch.kill_switch_reason,
        "by": switch.kill_switch_by.get_username() if switch.kill_switch_by else None,
        "at": switch.kill_switch_at,
        "runs_paused": Run.paused_by(switch.switch_key).count(),
        "changed": changed,
    }


@router.post(
    "/channels/{name}/kill-switch",
    response={200: KillSwitchOut, **ERRORS},
    summary="Engage or release a channel's kill switch",
    description="Needs `operate_channel` on the channel. Idempotent: asking for the state the switch is "
    "already in changes nothing (`changed: false`). Releasing resumes the runs the switch paused.",
)
def api_channel_kill_switch(request, name: str, body: KillSwitchIn):
    return _api_set(request, channel_for(request.user, name, to_operate=True), body)


@router.post(
    "/kill-switch",
    response={200: KillSwitchOut, **ERRORS},
    summary="Engage or release the global kill switch (every channel)",
    description="For the ops group. Idempotent like the channel's. Releasing resumes the runs the global "
    "switch paused; each channel's own switch still applies.",
)
def api_global_kill_switch(request, body: KillSwitchIn):
    return _api_set(request, global_switch_for(request.user, to_operate=True), body)
