"""The reviewer inbox at `/`: the open cards of the channels the user may approve, most urgent first.

- Who: users with `approve_channel` on at least one channel (core.access.decidable_channels): `/`
  (console.views.home) shows them this page, and everyone else the home page's empty states. The cards are those
  they may decide (approvals.access.cards_to_decide: never those of runs they started).
- What: cards whose status is pending or escalated, ordered by (due_at, id), 50 per page with a keyset cursor
  (`?after=<due_at>~<id>`), so a later page costs what the first does.
- Filters: channel, risk, workflow and SLA state. The SLA state is computed in SQL from due_at and now
  (approvals.rules.sla_state_q, the rule of approvals.rules.sla_state); each row sends the browser its seconds
  left and its due-soon window (static/sla.js keeps the state live).
- Counts: kept by the cards' writes for what needs no clock (InboxCount: channel, risk, workflow, who may decide),
  read from the cards for the SLA states, capped at SLA_COUNT_CAP (Inbox.facets); each facet counted under the other
  facets' filters, and the total. Two queries, and no more rows than the number of kinds of cards plus the cap per
  SLA count, whatever the number of open cards.
- Live: the rows and the counts are two partials of templates/approvals/inbox.html that poll every 5 s and
  refresh on the `approvals-changed` event.
- Bulk: POST /approvals/bulk decides several cards of one channel with one comment; each card is decided by
  Approval.decide on its own (its own lock, decision row and audit entry).
- What a row shows is what bulk approves (`row_shows`): a row shows a headline and an amount (the gate's display
  hints, paths an external agent chooses). A card is approved from its row (the `a` key, a bulk approval) only
  when every field that approving runs (approvals.diff.Shown.to_show, changed or not) is one of those, shown whole:
  the headline a string of at most ROW_HEADLINE characters on one line, the amount a whole number of minor units
  (hundredths: not of a currency in NOT_HUNDREDTHS, which the row would misprint), the currency a code, each shown
  once. Otherwise the row says how many fields it leaves out, the `a` key opens the
  card, and a bulk approval naming it is refused for that card (409, nothing decided); a bulk rejection, which runs
  nothing, still takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from urllib.parse import urlencode

from django import forms
from django.contrib import messages
from django.db import connection
from django.db.models import BooleanField, Exists, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.expressions import RawSQL
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_POST
from django_htmx.http import trigger_client_event

from approvals.access import cards_to_decide, deciding, visible_cards
from approvals.diff import CLAIMS_UNCHANGED, REMOVED, against_current
from approvals.errors import AlreadyDecided, DecisionError, StaleVersion
from approvals.models import Approval, Decision, InboxCount, RejectReason, latest_edits
from approvals.rules import (
    OPEN_SLA_STATES,
    DecisionKind,
    SlaState,
    due_soon_window,
    sla_ranges,
    sla_state_expression,
    sla_state_q,
    started_the_run,
)
from core.access import decidable_channels
from core.models import Channel
from core.views import HtmxHttpRequest
from runs.gates import Kind

TEMPLATE = "approvals/inbox.html"
EVENT = "approvals-changed"
PER_PAGE = 50

ROW_HEADLINE = 80  # characters of a headline a row shows (templates/approvals/inbox.html truncates it there)
# ISO 4217 currencies whose minor unit is not a hundredth (none, or a thousandth): a row prints an amount in minor
# units as hundredths (12500 as 125.00), which for these is not the amount that runs, so it shows no such amount.
NOT_HUNDREDTHS = frozenset(
    {
        *("BIF", "CLP", "DJF", "GNF", "ISK", "JPY", "KMF", "KRW", "PYG", "RWF", "UGX", "VND", "VUV", "XAF", "XOF"),
        *("XPF", "BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND"),
    }
)

SLA_STATES = [(state.value, state.label) for state in OPEN_SLA_STATES]
REJECT_REASONS = RejectReason.choices
FACETS = ("channel", "risk", "workflow", "sla")


# --- what a row shows ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowShows:
    """What an inbox row shows of what approving runs: the fields its headline, amount and currency show (paths),
    how many it leaves out, and whether the agent says the target already has every value."""

    fields: tuple[str, ...]
    left_out: int
    claims_unchanged: bool

    @property
    def in_full(self) -> bool:
        return self.left_out == 0

    @property
    def claim(self) -> str:
        return CLAIMS_UNCHANGED if self.claims_unchanged else ""


def row_shows(current, runs, headline: str, amount_minor: int | None, currency: str) -> RowShows:
    """Which fields of `runs` (what approving executes) the row's columns show whole, by value and type: the
    columns come from display paths the gate (or an external agent) chose, so a field counts as shown only when
    its exact value is what the row prints, and each column shows one field. A removed field is never shown."""
    shown = against_current(current, runs)
    free = {"headline", "amount", "currency"}
    fields: list[str] = []
    left_out = 0
    for change in shown.to_show:
        value = change.new
        column = None  # a removed field is shown by no column
        if change.op == REMOVED:
            pass
        elif "amount" in free and type(value) is int and value == amount_minor and currency not in NOT_HUNDREDTHS:
            column = "amount"
        elif "currency" in free and isinstance(value, str) and value and value == currency:
            column = "currency"
        elif (
            "headline" in free
            and isinstance(value, str)
            and value
            and value == headline
            and len(value) <= ROW_HEADLINE
            and "\n" not in value
        ):
            column = "headline"
        if column is None:
            left_out += 1
        else:
            free.discard(column)
            fields.append(change.path)
    return RowShows(tuple(fields), left_out, shown.claims_unchanged)


def row_shows_card(card: Approval, runs=None) -> RowShows:
    """row_shows for `card` as it stands: `runs` is what approving it executes (its pending edit, else its
    proposal: Approval.to_execute, when the caller has not read it already)."""
    runs = card.to_execute if runs is None else runs
    return row_shows(card.current, runs, card.headline, card.amount_minor, card.currency)


# --- the inbox ------------------------------------------------------------------------------------------------


def open_cards_for(user, channels: list[Channel]) -> QuerySet[Approval]:
    """The open cards `user` may decide (approvals.access.cards_to_decide, of `channels`: those they may approve),
    without those they answered already (an open card they decided waits for a second person: two-person rule)."""
    return (
        cards_to_decide(user, channels)
        .filter(status__in=Approval.OPEN)
        .exclude(Exists(Decision.objects.filter(approval=OuterRef("pk"), actor=user)))
    )


def parse_cursor(value: str) -> tuple[datetime, int] | None:
    due, _, pk = (value or "").rpartition("~")
    try:
        due_at = parse_datetime(due)
        return (due_at, int(pk)) if due_at is not None and due_at.tzinfo is not None else None
    except ValueError:
        return None


def format_cursor(card: Approval) -> str:
    return f"{card.due_at.isoformat()}~{card.pk}"


@dataclass
class FacetValue:
    value: str
    label: str
    count: Count
    selected: bool
    url: str


@dataclass
class Inbox:
    """The inbox of one user under the filters of one request. Each method is a fixed number of queries."""

    user: object
    channels: list[Channel]
    filters: dict[str, str]
    after: tuple[datetime, int] | None
    now: datetime

    @classmethod
    def from_request(cls, request, channels: list[Channel]) -> Inbox:
        names = {c.name for c in channels}
        valid = {
            "channel": lambda v: v in names,
            "risk": lambda v: v in Approval.Risk.values,
            "workflow": lambda v: 0 < len(v) <= 100,
            "sla": lambda v: v in dict(SLA_STATES),
        }
        filters = {k: request.GET[k] for k in FACETS if request.GET.get(k) and valid[k](request.GET[k])}
        return cls(request.user, channels, filters, parse_cursor(request.GET.get("after", "")), timezone.now())

    def _q(self, facet: str) -> Q:
        if facet == "channel":
            return Q(channel__name=self.filters["channel"])
        if facet == "risk":
            return Q(risk=self.filters["risk"])
        if facet == "workflow":
            return Q(workflow=self.filters["workflow"])
        return sla_state_q(self.filters["sla"], self.channels, self.now)

    @cached_property
    def open_cards(self) -> QuerySet[Approval]:
        """open_cards_for this user: built once (its access rules are the costly part to build), then filtered."""
        return open_cards_for(self.user, self.channels)

    def cards(self) -> QuerySet[Approval]:
        cards = self.open_cards
        for facet in self.filters:
            if facet == "channel":  # by id: the channel is known, no join needed
                channel = next(c for c in self.channels if c.name == self.filters["channel"])
                cards = cards.filter(channel_id=channel.pk)
            else:
                cards = cards.filter(self._q(facet))
        return cards

    def page(self) -> tuple[list[Approval], str | None]:
        """One page of rows (keyset on (due_at, id)) and the cursor of the next page, if any."""
        cards = self.cards()
        if self.after:
            due_at, pk = self.after
            # due_at >= x is the index's range; the OR only sorts out the ties.
            cards = cards.filter(Q(due_at__gte=due_at) & (Q(due_at__gt=due_at) | Q(pk__gt=pk)))
        by_id = {c.pk: c for c in self.channels}
        rows = list(
            cards.select_related("assigned_group")
            .only(
                *("id", "channel_id", "risk", "status", "summary", "due_at", "version"),
                *("workflow", "run_id", "assigned_group__name", "headline", "amount_minor", "currency", "shadow"),
                *("proposed", "current"),
            )
            .annotate(sla_state=sla_state_expression(self.channels, self.now), **pending_edit_columns())
            .order_by("due_at", "id")[: PER_PAGE + 1]
        )
        for card in rows:
            card.channel = by_id[card.channel_id]  # no join: the channels are loaded already
            card.remaining = card.due_at - self.now
            card.remaining_seconds = int(card.remaining.total_seconds())
            card.soon_seconds = int(due_soon_window(card.channel.sla).total_seconds())
            card.amount = _amount(card.amount_minor)
            card.shows = row_shows_card(card, card.edited_payload if card.edited_at is not None else card.proposed)
        more = len(rows) > PER_PAGE
        rows = rows[:PER_PAGE]
        return rows, (format_cursor(rows[-1]) if more else None)

    def facets(self) -> tuple[dict[str, list[FacetValue]], Count, int]:
        """Counts for every value of every facet, each under the other facets' filters; the number of cards
        matching every filter; and the number of open cards in all. Two queries, whatever the number of cards.

        Without a clock (channel, risk, workflow, the total) the counts are the sums the cards' writes keep
        (InboxCount), for the keys this user may decide (approvals.access.deciding, and not decided by them yet).
        An SLA state depends on the time, which no write follows: those counts come from the cards (sla_groups),
        exact while a state has at most SLA_COUNT_CAP of them, else at least what was read ("340+")."""
        names = {c.pk: c.name for c in self.channels}
        kept: dict[tuple[str, str, str], int] = {}
        for g in (
            InboxCount.objects.filter(channel_id__in=names)
            .filter(deciding(self.user))
            .exclude(deciders__contains=[self.user.pk])
            .values("channel_id", "risk", "workflow")
            .annotate(n=Sum("n"))
            .order_by()
        ):
            if g["n"]:
                kept[(names[g["channel_id"]], g["risk"], g["workflow"])] = g["n"]
        by_state, complete = self.sla_groups(kept)

        def count(filters: dict[str, str]) -> Count:
            state, others = _split(filters)
            groups = kept if state is None else by_state[state]
            n = sum(
                n
                for key, n in groups.items()
                if all(dict(zip(KEPT, key, strict=True))[f] == v for f, v in others.items())
            )
            if state is None or all(complete[(state, c)] for c in names.values() if others.get("channel", c) == c):
                return Count(n)
            return Count(min(n, SLA_COUNT_CAP), more=True)

        workflows = {w for _, _, w in kept} | ({self.filters["workflow"]} if "workflow" in self.filters else set())
        values = {
            "channel": [(c.name, c.name) for c in self.channels],
            "risk": list(Approval.Risk.choices),
            "workflow": [(w, w) for w in sorted(workflows)],
            "sla": SLA_STATES,
        }
        facets = {
            facet: [
                FacetValue(
                    value,
                    label,
                    count({**{f: v for f, v in self.filters.items() if f != facet}, facet: value}),
                    self.filters.get(facet) == value,
                    self.url(facet, value),
                )
                for value, label in values[facet]
            ]
            for facet in FACETS
        }
        return facets, count(self.filters), sum(kept.values())

    def sla_groups(self, kept: dict[tuple[str, str, str], int]) -> tuple[dict[str, dict], dict[tuple[str, str], bool]]:
        """The open cards this user may decide in each SLA state, counted by (channel, risk, workflow), and
        whether that is all of them, per (state, channel). One query: each channel's range of due_at for each state
        (rules.sla_ranges: an index range) read up to SLA_COUNT_CAP + 1 cards, so at most three times that per
        channel whatever the number of open cards. On time is the kept count less the others where they are
        complete: the near states are short in a healthy inbox, on time is most of it."""
        ranges = sla_ranges(self.channels, self.now)
        in_range = RawSQL(
            '"approvals_approval"."channel_id" = ranges.channel_id'
            ' AND "approvals_approval"."due_at" > ranges.after AND "approvals_approval"."due_at" < ranges.before',
            (),
            output_field=BooleanField(),
        )
        cards = self.open_cards.filter(in_range).order_by().values("channel_id", "risk", "workflow")
        sql, params = cards[: SLA_COUNT_CAP + 1].query.sql_with_params()
        rows = ", ".join(["(%s::text, %s::bigint, %s::timestamptz, %s::timestamptz)"] * len(ranges))
        names = {c.pk: c.name for c in self.channels}
        by_state: dict[str, dict] = {state: {} for state, _ in SLA_STATES}
        read = {(r.state.value, r.channel.name): 0 for r in ranges}
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT ranges.state, read.channel_id, read.risk, read.workflow, read.n"
                f" FROM (VALUES {rows}) AS ranges (state, channel_id, after, before) CROSS JOIN LATERAL"
                f" (SELECT channel_id, risk, workflow, count(*) AS n FROM ({sql}) AS capped GROUP BY 1, 2, 3) AS read",
                [v for r in ranges for v in (r.state.value, r.channel.pk, r.after, r.before)] + list(params),
            )
            for state, channel_id, risk, workflow, n in cursor:
                by_state[state][(names[channel_id], risk, workflow)] = n
                read[(state, names[channel_id])] += n
        complete = {key: n <= SLA_COUNT_CAP for key, n in read.items()}
        for channel in self.channels:
            near = [(state, channel.name) for state in (SlaState.BREACHED, SlaState.DUE_SOON)]
            if complete[(SlaState.ON_TIME, channel.name)] or not all(complete[key] for key in near):
                continue
            on_time = by_state[SlaState.ON_TIME]
            for key in [key for key in on_time if key[0] == channel.name]:
                del on_time[key]  # what was read of it, replaced by the whole
            for key, n in kept.items():
                if key[0] == channel.name:
                    on_time[key] = max(0, n - sum(by_state[s].get(key, 0) for s, _ in near))
            complete[(SlaState.ON_TIME, channel.name)] = True
        return by_state, complete

    def url(self, facet: str | None = None, value: str | None = None, after: str | None = None) -> str:
        """The inbox's URL with `facet` toggled to `value` (off when it is selected), from the first page."""
        params = dict(self.filters)
        if facet:
            if params.get(facet) == value:
                params.pop(facet)
            else:
                params[facet] = value
        if after:
            params["after"] = after
        return "/?" + urlencode(params) if params else "/"


# --- counts -------------------------------------------------------------------------------------------------------

# At most this many cards of one SLA state on one channel are read for the counts (Inbox.sla_groups): beyond it, the
# counts that include them say "at least" ("1000+").
SLA_COUNT_CAP = 1000
KEPT = ("channel", "risk", "workflow")  # the facets whose counts the cards' writes keep (InboxCount)


@dataclass(frozen=True)
class Count:
    """A count as the inbox shows it: `n`, or at least `n` when `more` (an SLA state past SLA_COUNT_CAP cards)."""

    n: int
    more: bool = False

    def __str__(self) -> str:
        return f"{self.n}+" if self.more else str(self.n)

    def __bool__(self) -> bool:
        return self.n > 0 or self.more


def _split(filters: dict[str, str]) -> tuple[str | None, dict[str, str]]:
    """(the SLA state filtered on or None, the other filters)."""
    others = dict(filters)
    return others.pop("sla", None), others


def pending_edit_columns() -> dict:
    """Who made a card's pending edit and when (null when nobody edited it), as columns of the page's one query.
    The row's headline and amount are what runs already: Approval.decide writes them with the edit."""
    edit = latest_edits().filter(approval=OuterRef("pk"))
    return {
        "edited_at": Subquery(edit.values("created_at")[:1]),
        "edited_by": Subquery(edit.values("actor__username")[:1]),
        # What runs when the card was edited: what the row must show (row_shows).
        "edited_payload": Subquery(edit.values("payload")[:1]),
    }


def _amount(value) -> str | None:
    try:
        cents = int(value)
    except (TypeError, ValueError):
        return None
    return f"{cents / 100:,.2f}"


def approvable_channels(user) -> list[Channel]:
    return list(decidable_channels(user).order_by("name"))


def render_inbox(request: HtmxHttpRequest, channels: list[Channel]):
    """The page, or one of its partials for htmx, over `channels` (approvable_channels of the user, not empty)."""
    box = Inbox.from_request(request, channels)
    template, context = TEMPLATE, {"inbox": box, "reasons": REJECT_REASONS}
    partial = None
    if request.htmx:
        partial = "counts" if request.htmx.target == "inbox-counts" else "rows"
        template += "#" + partial
    if partial != "counts":
        rows, next_cursor = box.page()
        context.update(rows=rows, next_url=box.url(after=next_cursor) if next_cursor else None)
    if partial != "rows":
        context["facets"], context["matching"], context["total"] = box.facets()
    context["first_url"] = box.url() if box.after else None
    context["self_url"] = request.get_full_path()
    return render(request, template, context)


# --- bulk decisions ---------------------------------------------------------------------------------------------


class BulkForm(forms.Form):
    cards = forms.CharField(error_messages={"required": "Select at least one card."})
    decision = forms.ChoiceField(choices=[(DecisionKind.APPROVE, "Approve"), (DecisionKind.REJECT, "Reject")])
    comment = forms.CharField(required=False, max_length=5000)
    reason = forms.ChoiceField(required=False, choices=[("", "—"), *REJECT_REASONS])

    def clean_cards(self) -> dict[int, int | None]:
        """`cards` is a list of `<id>:<version>` (the version the reviewer saw; a changed card is refused)."""
        picked: dict[int, int | None] = {}
        for item in self.data.getlist("cards"):
            pk, _, version = item.partition(":")
            try:
                picked[int(pk)] = int(version) if version else None
            except ValueError:
                raise forms.ValidationError(f"Not a card: {item!r}.") from None
        if not picked:
            raise forms.ValidationError("Select at least one card.")
        if len(picked) > PER_PAGE:
            raise forms.ValidationError(f"At most {PER_PAGE} cards at once.")
        return picked

    def clean(self):
        data = super().clean()
        if data.get("decision") == DecisionKind.REJECT:
            if not (data.get("comment") or "").strip():
                self.add_error("comment", "A rejection needs a comment saying why.")
            if not data.get("reason"):
                self.add_error("reason", "Pick the reason for the rejection.")
        return data


@dataclass
class BulkResult:
    pk: int
    status: int  # as HTTP: 200 decided, 403 forbidden (own run), 404 not found, 409 already decided or changed
    detail: str
    pending_edit: bool = False  # not approved: it has a pending edit, which is approved on the card itself
    not_shown: bool = False  # not approved: its row cannot show everything that runs (row_shows)


def decide_cards(user, picked: dict[int, int | None], decision: str, comment: str, reason: str) -> list[BulkResult]:
    """Decide each picked card on its own (Approval.decide: lock, decision, audit entry, run re-queued).

    Raises MixedChannels when the cards the user may see belong to more than one channel: a bulk decision is one
    judgement about one kind of action. Cards they may not see are reported as not found. A card with a pending
    edit (two-person rule) is not approved here: what runs is the edit, which the inbox row does not show in
    full, so it is approved on the card, where the edit and its diffs are shown. Nor is a card whose row cannot
    show every field that runs (row_shows): what a person approves is what they were shown."""
    cards = {
        card.pk: card
        for card in visible_cards(user)
        .filter(pk__in=picked)
        .select_related("run", "channel")
        .prefetch_related("decisions__actor")
    }
    if len({card.channel_id for card in cards.values()}) > 1:
        raise MixedChannels("Select cards of one channel only.")
    results = []
    for pk, version in picked.items():
        card = cards.get(pk)
        if card is None:
            results.append(BulkResult(pk, 404, "not found"))
        elif started_the_run(user, card):
            results.append(BulkResult(pk, 403, "you started this run: someone else must decide it"))
        elif decision == DecisionKind.APPROVE and card.status in Approval.OPEN and (edit := card.last_edit) is not None:
            by = edit.actor.get_username() if edit.actor else "system"
            results.append(BulkResult(pk, 409, f"has a pending edit by {by}: open the card to approve it", True))
        elif decision == DecisionKind.REJECT and card.kind == Kind.UNDO_FAILED and card.status in Approval.OPEN:
            # Rejecting a failed undo's card says "a person undid it by hand": that is for the person who did it to
            # say on the card, with what they did, never a bulk comment.
            results.append(BulkResult(pk, 409, "a failed undo is marked done by hand on its card: open it"))
        elif (
            decision == DecisionKind.APPROVE
            and card.status in Approval.OPEN
            and not (shows := row_shows_card(card)).in_full
        ):
            fields = "field" if shows.left_out == 1 else "fields"
            detail = f"its row cannot show everything that runs ({shows.left_out} {fields} not shown): open the card"
            results.append(BulkResult(pk, 409, detail + " to approve it", not_shown=True))
        else:
            try:
                # Without a version from the page, the one looked at here: a card edited since is refused.
                card.decide(
                    user,
                    decision,
                    comment=comment,
                    reason=reason if decision == DecisionKind.REJECT else "",
                    version=version if version is not None else card.version,
                )
            except (AlreadyDecided, StaleVersion) as exc:
                results.append(BulkResult(pk, 409, str(exc)))
            except DecisionError as exc:
                results.append(BulkResult(pk, exc.status, str(exc)))
            else:
                results.append(BulkResult(pk, 200, f"{decision}d"))
    return results


class MixedChannels(ValueError):
    pass


@require_POST
def bulk(request: HtmxHttpRequest):
    form = BulkForm(request.POST)
    results, error, status = [], None, 200
    if not form.is_valid():
        status = 422 if set(form.errors) - {"cards"} else 400
    else:
        data = form.cleaned_data
        try:
            results = decide_cards(request.user, data["cards"], data["decision"], data["comment"], data["reason"])
        except MixedChannels as exc:
            error, status = str(exc), 400
    decided = sum(r.status == 200 for r in results)
    pending_edits = sum(r.pending_edit for r in results)
    not_shown = sum(r.not_shown for r in results)
    if not request.htmx:
        if status == 200:
            if pending_edits:
                messages.warning(request, _pending_edits_text(pending_edits))
            if not_shown:
                messages.warning(request, _not_shown_text(not_shown))
            return redirect("home")
        return HttpResponse(error or form.errors.as_text(), status=status, content_type="text/plain")
    context = {
        "form": form,
        "results": results,
        "error": error,
        "decided": decided,
        "pending_edits": _pending_edits_text(pending_edits) if pending_edits else "",
        "not_shown": _not_shown_text(not_shown) if not_shown else "",
        "reasons": REJECT_REASONS,
    }
    response = render(request, TEMPLATE + "#bulk-result", context, status=status)
    if decided:
        trigger_client_event(response, EVENT, after="settle")
    return response


def _pending_edits_text(n: int) -> str:
    if n == 1:
        return "1 card has a pending edit: open it to approve it."
    return f"{n} cards have a pending edit: open each to approve it."


def _not_shown_text(n: int) -> str:
    if n == 1:
        return (
            "1 card cannot be approved from the inbox: its row cannot show everything that runs. Open it to approve it."
        )
    return (
        f"{n} cards cannot be approved from the inbox: their rows cannot show everything that runs. Open each to"
        " approve it."
    )
