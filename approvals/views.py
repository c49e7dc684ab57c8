"""The card page: the diff, the rationale, the run's context, the SLA timer, and the decisions.

Who may see and decide a card: approvals.access.card_for, as for the API (404 for those who may not see it, 403
for a decision on a run they started). The decision itself (locking, the rules, audit, resuming the run) is
`Approval.decide`.

An email's Approve or Reject link (approvals.links) lands on `decision_link`: the card page with that choice
pre-selected, whose form posts the link's token along to `decide`, the one place a card is decided from here.

The card's body is the `card` partial of templates/approvals/card.html. Other pages (the inbox) can show it:
`prepare(card, user)` then `{% include "approvals/card.html#card" %}` with `card` in the context, or fetch it with
htmx (`hx-get="/approvals/<id>/"` answers the partial alone).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from urllib.parse import urlparse

from django.contrib import messages
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from django.views.decorators.vary import vary_on_headers
from django_htmx.http import trigger_client_event

from approvals import edits, labels, links, personal, rules
from approvals.access import card_for
from approvals.diff import CLAIMS_UNCHANGED, against_current, changes
from approvals.errors import (
    AlreadyDecided,
    DecisionError,
    InvalidDecision,
    LinkRefused,
    NotAllowed,
    SecondApproverNeeded,
    StaleVersion,
)
from approvals.forms import AwayForm, DecideForm, EditForm, RejectForm
from approvals.models import Approval, Delegation, DelegationRefused, RejectReason
from approvals.rules import Agreement, DecisionKind
from core.access import may_view_pii
from core.views import HtmxHttpRequest
from runs import compensations
from runs.errors import UndoRefused
from runs.models import Receipt

TEMPLATE = "approvals/card.html"
EVENT = "approvals-changed"  # sent after a decision; the inbox's counters listen for it

# --- what the card shows -----------------------------------------------------------------------------------


def sla(card: Approval, now: datetime | None = None) -> dict:
    """The SLA timer as the server sees it (approvals.rules.sla_state: on_time, due_soon, breached, or decided:
    the timer stopped), with what the browser needs to keep it live (static/sla.js): the seconds left and the
    due-soon window's."""
    now = now or timezone.now()
    remaining = card.due_at - now
    return {
        "state": rules.sla_state(card.due_at, card.channel.sla, now, is_open=card.status in Approval.OPEN),
        "remaining_seconds": int(remaining.total_seconds()),
        "remaining": _duration(remaining),
        "soon_seconds": int(rules.due_soon_window(card.channel.sla).total_seconds()),
    }


def _duration(delta: timedelta) -> str:
    seconds = int(abs(delta.total_seconds()))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"
    return f"overdue by {text}" if delta.total_seconds() <= 0 else f"{text} left"


def _citations(citations) -> list[dict]:
    """Citations as {title, url, href}: only http(s) URLs become links; anything else stays text."""
    out = []
    for item in citations if isinstance(citations, list) else []:
        if isinstance(item, dict):
            url, title = str(item.get("url") or ""), str(item.get("title") or item.get("url") or "")
        else:
            url = title = str(item)
        parsed = urlparse(url.strip())
        href = url.strip() if parsed.scheme in ("http", "https") and parsed.netloc else ""
        out.append({"title": title or url, "url": url, "href": href})
    return out


def _amount(card: Approval) -> str:
    """The amount the gate declared for its card's display, if any."""
    if card.amount_minor is None:
        return ""
    return f"{card.amount_minor / 100:,.2f} {card.currency}".strip()


def prepare(card: Approval, user, **state) -> Approval:
    """Everything the card partial shows, set on the card. `state`: edit_form, reject_form, preview, conflict,
    error (a refused decision's form or message, shown in place)."""
    # The one diff of every view (approvals.diff.against_current: Slack and the inbox row show the same), against
    # the card's record of the current state; when that record already holds every value, the page says so.
    shown = against_current(card.current, card.proposed)
    card.diff, card.diff_counts = shown.fields, shown.counts
    card.diff_claim = CLAIMS_UNCHANGED if shown.claims_unchanged else ""
    # What happened when it ran: the receipt of the action at the card's own step (an agent's tool call, an
    # external agent's request), pending while its outcome is unknown.
    card.execution = Receipt.objects.filter(run_id=card.run_id, step_seq=card.step_seq).first()
    if card.execution is not None:
        card.execution.response_text = json.dumps(card.execution.response, indent=2, sort_keys=True, default=str)
    # What runs when a person edited the proposal (Approval.to_execute), shown above it with its diffs and its
    # author, so that the second person of the two-person rule approves the edit they see.
    card.pending_edit = card.last_edit if card.to_execute is not None else None
    if card.pending_edit is not None:
        edit = card.pending_edit
        edit.by = edit.actor.get_username() if edit.actor else "system"
        card.edit_vs_proposed = changes(card.proposed, edit.payload)
        edited = against_current(card.current, edit.payload)
        card.edit_vs_current, card.edit_vs_current_counts = edited.fields, edited.counts
        card.edit_vs_current_claim = CLAIMS_UNCHANGED if edited.claims_unchanged else ""
    card.sla = sla(card)
    card.confidence_pct = None if card.confidence is None else round(card.confidence * 100)
    card.citation_list = _citations(card.citations)
    card.amount = _amount(card)
    card.steps_so_far = [
        (step, json.dumps(step.output, indent=2, ensure_ascii=False, default=str))
        for step in card.run.steps.order_by("seq")
    ]
    reasons = dict(RejectReason.choices)
    card.decision_list = []
    for decision in card.decisions.select_related("actor", "on_behalf_of").order_by("created_at"):
        decision.by = decision.actor.get_username() if decision.actor else "system"
        decision.reason_label = reasons.get(decision.reason, decision.reason)
        decision.edit_diff = changes(card.proposed, decision.payload) if decision.payload else []
        card.decision_list.append(decision)
    card.is_open = card.status in Approval.OPEN
    # Personal data shows masked (console.middleware.PersonalDataMiddleware); a holder of view_pii on the channel
    # may reveal it, one audited reveal at a time (`reveal` below).
    card.may_reveal = may_view_pii(user, card.channel) and bool(personal.refs_of(card))
    card.is_creator = rules.started_the_run(user, card)
    # Two-person rule: approvals (or edits) recorded on a card that is still open, and whether this user gave one.
    # Under the channel's own rule, the quorum of its one stage (the snapshot the card counts by: Approval.rule).
    card.required_approvals = card.rule["stages"][0]["quorum"] if card.on_channel_rule else 1
    card.approvals_given = rules.counted(card.decision_list, DecisionKind.APPROVE) if card.is_open else []
    card.i_approved = any(d.actor_id == user.pk for d in card.approvals_given)
    # Only a card under an admin's policy shows where it stands in it: the channel's own rule is no named policy.
    card.standing = _standing(card, user) if card.admin_policy else None
    card.policy_refusal = card.standing["refusal"] if card.standing and card.is_open else ""
    card.can_decide = card.is_open and not card.is_creator and not card.policy_refusal
    card.labels = labels.for_card(card)
    if not edits.accepts_edits(card):
        card.labels = {**card.labels, "edit": ""}  # no edit offered
    # "Reject and undo": offered beside the rejection on an action or budget card whose run has something to undo.
    card.undo_label = labels.undo_label(card) if card.can_decide and _can_undo(card) else ""
    # Shadow cards: the agreement and the note as last posted (kept across a preview or a refused form).
    card.shadow_values = state.get("shadow_values") or {"agreement": "", "done_by_hand": ""}
    card.agreements = Agreement.choices
    card.edit_form = state.get("edit_form") or EditForm(card)
    card.reject_form = state.get("reject_form") or RejectForm()
    for form in (card.edit_form, card.reject_form):
        form.auto_id = f"card{card.pk}-%s"  # unique ids when a page shows several cards (the inbox)
    card.preview = state.get("preview")
    card.conflict = state.get("conflict", "")
    card.error = state.get("error", "")
    card.opened = state.get("opened", "")  # which decision form to show open after a refusal: edit or reject
    # Opened from an email's decision link: {token, decision}, the choice pre-selected and the token in its form.
    card.via_link = state.get("via_link")
    if card.via_link and card.via_link["decision"] == DecisionKind.REJECT and not card.opened:
        card.opened = "reject"
    return card


def _can_undo(card: Approval) -> bool:
    """Whether the run of `card` has something a rejection could undo (runs.compensations.check_undo, the check
    Approval.decide(undo=True) makes again when it is pressed)."""
    if not labels.undo_label(card):
        return False
    try:
        compensations.check_undo(card.run)
    except UndoRefused:
        return False
    return True


def _standing(card: Approval, user) -> dict:
    """Where a card under an approval policy stands: its stage, who answered (since its last edit), who is still
    asked, the next escalation and when; and whether `user` may decide it now (approvals.rules), in whose name."""
    policy, row = card.policy, card.stage
    stage = rules.stage_of_level(policy, row)
    given = rules.counted(card.decision_list, DecisionKind.APPROVE)  # since the last edit, open or decided
    answered = [
        {
            "by": d.by,
            "on_behalf_of": d.on_behalf_of.get_username() if d.on_behalf_of else "",
            "stage": d.stage_name,
            "decision": d.decision,
        }
        for d in given
        if d.stage is not None
    ]
    here = [d for d in given if d.stage is not None and rules.stage_of_level(policy, d.stage) == stage]
    asked = card.asked_names()
    done = {d.by for d in given} | {a["on_behalf_of"] for a in answered}
    covering = Delegation.covered_by(user)
    refusal = rules.decider_refusal(user, card, covering) if not card.is_creator else ""
    on_behalf = rules.on_behalf_of(user, card, covering)
    following = rules.next_level(policy, row)
    return {
        **card.policy_stage(),
        "given": len(here),
        "quorum": policy["stages"][row]["quorum"],
        "answered": answered,
        "still_users": [name for name in asked["users"] if name not in done],
        "still_groups": asked["groups"],
        "anyone": asked["anyone_on_channel"],
        "next_to": policy["stages"][following]["name"] if following is not None else "",
        "at_end": policy["at_end"],
        "refusal": refusal,
        "on_behalf_of": User.objects.get(pk=on_behalf).get_username() if on_behalf else "",
    }


def _render(request: HtmxHttpRequest, card: Approval, status: int = 200) -> HttpResponse:
    template = TEMPLATE + "#card" if request.htmx else TEMPLATE
    return render(request, template, {"card": card}, status=status)


# --- views -------------------------------------------------------------------------------------------------


@require_GET
@vary_on_headers("HX-Request")
def card(request: HtmxHttpRequest, pk: int):
    card = card_for(request.user, pk)
    return _render(request, prepare(card, request.user))


@require_GET
@never_cache
def decision_link(request: HtmxHttpRequest, token: str):
    """An email's Approve or Reject link. The console's login comes first (LoginRequiredMiddleware sends a visitor
    through the login page and back here); then the link is checked for this user (approvals.links.check: a page
    saying why when it cannot be used), and the card is shown as its own page shows it, to those its page shows it
    to (card_for), with the link's decision pre-selected. Nothing is decided here: a GET never does."""
    try:
        link = links.check(token, request.user)
    except LinkRefused as exc:
        found = links.find(token)
        card_id = found.approval_id if found is not None and found.recipient_id == request.user.pk else None
        context = {"message": str(exc), "status": exc.status, "card_id": card_id}
        return render(request, "approvals/link_refused.html", context, status=exc.status)
    card = card_for(request.user, link.approval_id)
    return _render(request, prepare(card, request.user, via_link={"token": token, "decision": link.decision}))


@require_POST
def decide(request: HtmxHttpRequest, pk: int):
    """A decision from the card's forms (approvals.forms.DecideForm parses and checks what was posted; Approval.decide
    takes it). Refused as posted: the card again with its forms as they were, 422; an edit's preview: the same, 200;
    decided: the card as it now is (an htmx request) or a redirect to it."""
    user = request.user
    card = card_for(user, pk, to_decide=True)
    form = DecideForm(card, user, request.POST)
    try:
        if not form.is_valid() or form.previewed is not None:
            return _render(request, prepare(card, user, **form.state()), status=200 if form.is_valid() else 422)
        form.decide()
    except (AlreadyDecided, StaleVersion) as exc:
        card = card_for(user, pk)
        # A stale card is still open: its link (if any) stays pre-selected for the decision taken again.
        again = {"via_link": form.via_link} if form.via_link is not None and isinstance(exc, StaleVersion) else {}
        return _render(request, prepare(card, user, conflict=_conflict_message(exc), **again), status=409)
    except NotAllowed as exc:
        raise PermissionDenied(str(exc)) from exc
    except SecondApproverNeeded as exc:
        return _render(request, prepare(card, user, conflict=f"Not recorded: {exc}."), status=409)
    except InvalidDecision as exc:  # Approval.decide's own checks: said on the card, its forms kept as posted
        return _render(request, prepare(card, user, **{**form.state(), "error": str(exc)}), status=422)
    except UndoRefused as exc:  # reject and undo with nothing the run can undo: nothing done, the card still open
        state = {**form.state(), "error": f"Not recorded: {exc}."}
        return _render(request, prepare(card_for(user, pk), user, **state), status=409)
    except DecisionError as exc:  # any other refusal: say it in place, with its own status
        return _render(request, prepare(card, user, error=str(exc)), status=exc.status)

    if not request.htmx:
        return redirect("card", pk=pk)
    response = _render(request, prepare(card_for(user, pk), user))
    trigger_client_event(response, EVENT, after="settle")
    if form.via_link is not None:  # the address bar leaves the used link for the card's own page
        response["HX-Replace-Url"] = reverse("card", args=[pk])
    return response


@require_POST
@never_cache
def reveal(request: HtmxHttpRequest, pk: int):
    """The card's personal data in clear, for a holder of `view_pii` on its channel (403 for anyone else: nothing
    shown, nothing audited): each reveal writes one audit entry `pii.view` (approvals.personal.reveal). Answers the
    partial that takes the Reveal button's place (an htmx request), or the same on a page of its own."""
    card = card_for(request.user, pk)
    shown = personal.reveal(card, request.user)
    template = "approvals/reveal.html" + ("#revealed" if request.htmx else "")
    return render(request, template, {"card": card, "revealed": shown})


def _conflict_message(exc: AlreadyDecided | StaleVersion) -> str:
    if isinstance(exc, AlreadyDecided):
        when = timezone.localtime(exc.card.decided_at).strftime("%Y-%m-%d %H:%M:%S %Z") if exc.card.decided_at else ""
        return f"Not recorded: this card was already {exc.card.status} by {exc.by}" + (f" at {when}." if when else ".")
    return "Not recorded: the card changed since you opened it. Here it is again: check it and decide again."


# --- away: delegation ----------------------------------------------------------------------------------------


@require_http_methods(["GET", "POST"])
def away(request: HtmxHttpRequest):
    """ "Away until ..., cover: X" for the person signed in (approvals.models.Delegation: its checks, its audit
    entries). POST `action=set` (cover, until) or `action=clear`."""
    user, status = request.user, 200
    form = AwayForm(user)
    if request.method == "POST":
        if request.POST.get("action") == "clear":
            if Delegation.clear(user):
                messages.success(request, "Your delegation has ended: your cards come to you again.")
            return redirect("away")
        form = AwayForm(user, request.POST)
        if form.is_valid():
            try:
                Delegation.set(user, form.cleaned_data["cover"], form.cleaned_data["until"])
            except DelegationRefused as exc:
                form.add_error(None, f"Not set: {exc}.")
            else:
                messages.success(request, "Delegation set.")
                return redirect("away")
        status = 422
    current = Delegation.objects.select_related("cover").filter(user=user).first()
    return render(
        request,
        "approvals/away.html",
        {"form": form, "current": current, "active": current is not None and current.until > timezone.now()},
        status=status,
    )
