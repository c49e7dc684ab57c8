"""The audit log console page and its CSV export, for admins.

Newest first, paginated by keyset on the id (`?before=<id>` for older entries, `?after=<id>` for newer ones):
a page costs the same few queries whether the log holds a thousand entries or a million, and nothing counts
the whole table. Filters are plain GET parameters, so every view of the log is a URL (pushed by htmx, and
working without JavaScript), and the CSV export takes the same parameters.
"""

from __future__ import annotations

import csv
import json
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta

from asgiref.sync import sync_to_async
from django import forms
from django.core.exceptions import PermissionDenied
from django.core.handlers.asgi import ASGIRequest
from django.db import connection, transaction
from django.db.models import BooleanField, QuerySet, Subquery
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce
from django.http import HttpResponseBadRequest, StreamingHttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.http import require_GET, require_POST
from django.views.decorators.vary import vary_on_headers
from django_htmx.http import push_url

from console import audit_bundle
from core.access import may_read_audit
from core.models import ActorType, AuditEntry, Channel
from core.views import HtmxHttpRequest

PAGE_SIZE = 50
EXPORT_CHUNK = 2000

# Verbatim the expression of the GIN index console_audit_comment_fts (migration 0005): PostgreSQL uses an
# expression index only for the same expression.
COMMENT_DOCUMENT = "to_tsvector('english', coalesce(\"console_auditentry\".\"data\"->>'comment', ''))"

CSV_COLUMNS = AuditEntry.COLUMNS


def _require_admin(request) -> None:
    """Only admins read the audit log (core.access.may_read_audit). Any other logged-in user gets 403: the page
    is no secret (its URL is in the design), reading it is an action they may not take. Anonymous visitors never
    get here: the login middleware sends them to the login page."""
    if not may_read_audit(request.user):
        raise PermissionDenied("The audit log is for admins.")


def known_actions() -> list[str]:
    """The distinct actions in the log, by a skip scan of the (action, at) index: one index probe per action
    instead of a pass over every entry."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH RECURSIVE actions(action) AS (
                (SELECT action FROM console_auditentry ORDER BY action LIMIT 1)
                UNION ALL
                SELECT (SELECT e.action FROM console_auditentry e WHERE e.action > actions.action
                        ORDER BY e.action LIMIT 1)
                FROM actions WHERE actions.action IS NOT NULL
            )
            SELECT action FROM actions WHERE action IS NOT NULL
            """
        )
        return [action for (action,) in cursor.fetchall()]


def _start_of(day: date) -> datetime:
    return timezone.make_aware(datetime.combine(day, time.min))


class AuditFilter(forms.Form):
    actor = forms.CharField(
        required=False, max_length=150, widget=forms.TextInput(attrs={"placeholder": "username or component"})
    )
    actor_type = forms.ChoiceField(required=False, label="Actor type", choices=[("", "any"), *ActorType.choices])
    action = forms.ChoiceField(required=False)
    channel = forms.CharField(required=False, max_length=64, widget=forms.TextInput(attrs={"list": "audit-channels"}))
    run = forms.UUIDField(required=False, label="Run id")
    date_from = forms.DateField(required=False, label="From", widget=forms.DateInput(attrs={"type": "date"}))
    date_to = forms.DateField(required=False, label="To", widget=forms.DateInput(attrs={"type": "date"}))
    q = forms.CharField(
        required=False,
        max_length=200,
        label="Comment",
        widget=forms.TextInput(attrs={"type": "search", "placeholder": "words in comments"}),
    )
    # Keyset cursors: not filters, so the form does not show them and a change of filter starts over.
    before = forms.IntegerField(required=False, min_value=1, widget=forms.HiddenInput)
    after = forms.IntegerField(required=False, min_value=0, widget=forms.HiddenInput)

    def __init__(self, data, *, actions: Iterable[str]):
        super().__init__(data)
        self.fields["action"].choices = [("", "any"), *((action, action) for action in actions)]

    def clean(self):
        cleaned = super().clean()
        start, end = cleaned.get("date_from"), cleaned.get("date_to")
        if start and end and start > end:
            self.add_error("date_to", "The end of the range is before its start.")
        return cleaned

    def entries(self) -> QuerySet[AuditEntry]:
        """The entries that match the (valid) filters, in no particular order."""
        data = self.cleaned_data
        entries = AuditEntry.objects.all()
        for field in ("actor", "actor_type", "action", "channel"):
            if data[field]:
                entries = entries.filter(**{field: data[field]})
        if data["run"]:
            entries = entries.filter(run_id=data["run"])
        # A date range is also an id range, since `at` grows with `id` (stamped under the chain's lock): each end
        # is one probe of the `at` index, and the page then walks the primary key from the range's newest entry
        # instead of from the log's (half the table for a range that ended six months ago).
        if data["date_from"]:
            start = _start_of(data["date_from"])
            entries = entries.filter(at__gte=start, id__gt=_last_id_before(start))
        if data["date_to"]:
            end = _start_of(data["date_to"] + timedelta(days=1))
            entries = entries.filter(at__lt=end, id__lte=_last_id_before(end))
        if data["q"]:
            matches = f"{COMMENT_DOCUMENT} @@ websearch_to_tsquery('english', %s)"
            entries = entries.filter(RawSQL(matches, [data["q"]], output_field=BooleanField()))
        return entries


def _last_id_before(moment: datetime) -> Coalesce:
    """The id of the newest entry stamped before `moment` (0 when there is none), as a subquery."""
    newest = AuditEntry.objects.filter(at__lt=moment).order_by("-at", "-id").values("id")[:1]
    return Coalesce(Subquery(newest), 0)


@dataclass
class Page:
    entries: list[AuditEntry]
    older: int | None = None  # the cursor of the next page down (?before=), if there are older entries
    newer: int | None = None  # the cursor of the next page up (?after=), if there are newer entries


def keyset_page(entries: QuerySet[AuditEntry], *, before=None, after=None, size: int = PAGE_SIZE) -> Page:
    """One page of `entries`, newest first, in one query: `size + 1` rows tell whether there is more."""
    if after is not None:
        rows = list(entries.filter(id__gt=after).order_by("id")[: size + 1])
        more_newer = len(rows) > size
        rows = rows[:size][::-1]
        # The entry at the cursor matched the filters when its page was shown: it is still there (append-only).
        return Page(rows, older=rows[-1].id if rows else None, newer=rows[0].id if more_newer else None)
    if before is not None:
        entries = entries.filter(id__lt=before)
    rows = list(entries.order_by("-id")[: size + 1])
    more_older = len(rows) > size
    rows = rows[:size]
    return Page(
        rows,
        older=rows[-1].id if more_older else None,
        newer=rows[0].id if before is not None and rows else None,
    )


def _summary(data: dict) -> list[tuple[str, str]]:
    """Short `key: value` pairs of an entry's data, besides its comment (shown on its own)."""
    pairs = []
    for key, value in data.items():
        if key == "comment" or value in ("", None, [], {}):
            continue
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
        pairs.append((key, text if len(text) <= 80 else text[:79] + "…"))
    return pairs


def _decorate(entries: list[AuditEntry]) -> None:
    """Links to the run and card pages, and a short summary of each entry's data."""
    for entry in entries:
        entry.run_url = reverse("run", args=[entry.run_id]) if entry.run_id else ""
        entry.card_url = reverse("card", args=[entry.approval_id]) if entry.approval_id else ""
        entry.summary = _summary(entry.data if isinstance(entry.data, dict) else {"data": entry.data})
        entry.data_json = json.dumps(entry.data, indent=2, ensure_ascii=False, sort_keys=True)


def _query(params: dict, **changes) -> str:
    """`?a=1&b=2` of the non-empty `params` with `changes` applied (None removes a key)."""
    merged = {key: value for key, value in {**params, **changes}.items() if value not in (None, "")}
    return "?" + urlencode(merged) if merged else ""


def _evidence_period(form: AuditFilter) -> dict:
    """The evidence export's default period: the filter's dates, else this month up to today."""
    today = timezone.localdate()
    dates = form.cleaned_data if form.is_valid() else {}
    last = dates.get("date_to") or today
    return {"from": dates.get("date_from") or min(last, today).replace(day=1), "to": last}


@require_GET
@vary_on_headers("HX-Request")
def audit_log(request: HtmxHttpRequest):
    _require_admin(request)
    form = AuditFilter(request.GET, actions=known_actions())
    if form.is_valid():
        page = keyset_page(form.entries(), before=form.cleaned_data["before"], after=form.cleaned_data["after"])
    else:
        page = Page([])
    _decorate(page.entries)
    filters = {key: value for key, value in request.GET.items() if key not in ("before", "after") and value}
    context = {
        "form": form,
        "page": page,
        "filtered": bool(filters),
        "newest_url": request.path + _query(filters),
        "older_url": request.path + _query(filters, before=page.older) if page.older else "",
        "newer_url": request.path + _query(filters, after=page.newer) if page.newer else "",
        "export_url": reverse("audit_export") + _query(filters),
        "evidence": _evidence_period(form),
        "channels": Channel.objects.values_list("name", flat=True),  # only the full page's datalist reads it
    }
    template = "console/audit.html"
    if request.htmx and not request.htmx.history_restore_request:
        template += "#results"
    response = render(request, template, context)
    if request.htmx:
        # The form sends every field, empty or not; the address bar gets the short form of the same view.
        push_url(response, request.path + _query(request.GET.dict()))
    return response


class _Echo:
    """A file for csv.writer that hands each line back instead of storing it."""

    def write(self, value: str) -> str:
        return value


def _text_cell(value: str) -> str:
    # A spreadsheet runs a cell that starts like a formula; a quote makes it text (OWASP "CSV injection").
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def _csv_row(row: tuple) -> list:
    """A CSV line's cells from a row of CSV_COLUMNS (values, not model instances: an export is thousands of them)."""
    id_, at, actor_type, actor, action, target, run_id, approval_id, channel, data, trace_id, *chain = row
    return [
        id_,
        at.isoformat(),
        actor_type,
        _text_cell(actor),
        _text_cell(action),
        _text_cell(target),
        run_id or "",
        approval_id if approval_id is not None else "",
        _text_cell(channel),
        json.dumps(data, ensure_ascii=False, sort_keys=True, separators=(",", ":")),
        _text_cell(trace_id),
        *chain,  # prev_hash, hash, hash_scheme, hmac_key_id
    ]


def _chunks(entries: QuerySet[AuditEntry]) -> Iterator[list[tuple]]:
    """The entries newest first, as rows of CSV_COLUMNS, a chunk per query, by keyset: no long-lived cursor or
    transaction, and entries appended during the export (all newer than its first chunk) are not half-included."""
    before = None
    while True:
        page = entries if before is None else entries.filter(id__lt=before)
        rows = list(page.order_by("-id").values_list(*CSV_COLUMNS)[:EXPORT_CHUNK])
        if rows:
            yield rows
        if len(rows) < EXPORT_CHUNK:
            return
        before = rows[-1][0]


def _csv_lines(entries: QuerySet[AuditEntry]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(CSV_COLUMNS)
    for chunk in _chunks(entries):
        yield "".join(writer.writerow(_csv_row(row)) for row in chunk)  # a piece per chunk, not per line


async def _csv_lines_async(entries: QuerySet[AuditEntry]) -> AsyncIterator[str]:
    # Under ASGI (uvicorn in production) Django would read a synchronous iterator to the end, into memory,
    # before sending a byte; fetch each chunk in the request's thread (its database connection) instead.
    writer = csv.writer(_Echo())
    yield writer.writerow(CSV_COLUMNS)
    chunks = _chunks(entries)
    while (chunk := await sync_to_async(next)(chunks, None)) is not None:
        yield "".join(writer.writerow(_csv_row(row)) for row in chunk)


def audited_csv_export(form: AuditFilter, by) -> QuerySet[AuditEntry]:
    """The entries a CSV export of `form`'s (valid) filters lists, cut at the log's head, and its `audit.export`
    entry (who, which filters), written after that head: who took a copy of the log is in the log, as for the
    evidence bundle (console.audit_bundle.begin), and the export does not list its own entry."""
    head = AuditEntry.objects.order_by("-id").values_list("id", flat=True).first() or 0
    filters = {
        name: str(value)
        for name, value in form.cleaned_data.items()
        if name not in ("before", "after") and value not in (None, "")
    }
    with transaction.atomic():
        AuditEntry.record(
            "audit.export",
            actor=by,
            target="audit:csv",
            data={"format": "csv", "via": "console", "filters": filters, "database_head": head},
        )
    return form.entries().filter(id__lte=head)


@require_GET
def audit_export(request):
    """The entries of the current filters as CSV, every column including the hash chain, newest first. Audited
    (audited_csv_export) before a byte is sent."""
    _require_admin(request)
    form = AuditFilter(request.GET, actions=known_actions())
    if not form.is_valid():
        return HttpResponseBadRequest(form.errors.as_text(), content_type="text/plain; charset=utf-8")
    entries = audited_csv_export(form, request.user)
    lines = _csv_lines_async(entries) if isinstance(request, ASGIRequest) else _csv_lines(entries)
    response = StreamingHttpResponse(lines, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="audit-{timezone.now():%Y%m%d-%H%M%S}.csv"'
    return response


async def _in_request_thread(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    # As for the CSV: under ASGI each piece is made in the request's thread (its database connection), not read
    # to the end into memory first.
    while (chunk := await sync_to_async(next)(chunks, None)) is not None:
        yield chunk


@require_POST
def audit_evidence(request):
    """The audit evidence of a period for an auditor (console.audit_bundle), streamed as a zip: the period's
    entries, one record per decision, the head hashes, a manifest and the offline verifier. Audited as
    audit.export (who, which period) before a byte is sent. A POST: it writes that entry."""
    _require_admin(request)
    try:
        period = audit_bundle.Period.parse(request.POST.get("from"), request.POST.get("to"), names=("From", "To"))
        export = audit_bundle.begin(period, by=request.user, via="console")
    except audit_bundle.ExportRefused as exc:
        return HttpResponseBadRequest(str(exc), content_type="text/plain; charset=utf-8")
    chunks = audit_bundle.zip_stream(export)
    response = StreamingHttpResponse(
        _in_request_thread(chunks) if isinstance(request, ASGIRequest) else chunks, content_type="application/zip"
    )
    response["Content-Disposition"] = f'attachment; filename="{period.name}.zip"'
    return response
