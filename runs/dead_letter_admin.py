"""The dead-letter queue in Django admin: list, detail, filters, and the actions "requeue" and "resolve".

Registered by the runs app (runs.admin imports this module), though `jobs.DeadLetter` is the jobs app's model:
its actions are what a letter means for its run (`runs.dead_letters`), and jobs sits below runs, never importing
it. Procrastinate's own job admin is registered by `procrastinate.contrib.django` (Django admin: "Procrastinate")."""

from __future__ import annotations

import json
from datetime import timedelta

from django.contrib import admin, messages
from django.contrib.admin import ActionLocation
from django.core.serializers.json import DjangoJSONEncoder
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, Resolver404, resolve, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.timesince import timesince

from core import tracing
from jobs.models import DeadLetter
from runs import dead_letters
from runs.access import may_requeue_dead_letters, may_resolve_dead_letters
from runs.dead_letters import DeadLetterError

BOTH = [ActionLocation.CHANGE_LIST, ActionLocation.CHANGE_FORM]


class AgeFilter(admin.SimpleListFilter):
    title = "age"
    parameter_name = "age"
    WINDOWS = {"hour": timedelta(hours=1), "day": timedelta(days=1), "week": timedelta(weeks=1)}

    def lookups(self, request, model_admin):
        return [("hour", "Last hour"), ("day", "Last day"), ("week", "Last week"), ("older", "Older than a week")]

    def queryset(self, request, queryset):
        now = timezone.now()
        if self.value() in self.WINDOWS:
            return queryset.filter(created_at__gte=now - self.WINDOWS[self.value()])
        if self.value() == "older":
            return queryset.filter(created_at__lt=now - self.WINDOWS["week"])
        return queryset


class StateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return [("open", "Open"), ("requeued", "Requeued"), ("resolved", "Resolved with a note")]

    def queryset(self, request, queryset):
        if self.value() == "open":
            return queryset.filter(resolved_at__isnull=True)
        if self.value() in ("requeued", "resolved"):
            return queryset.filter(resolution=self.value())
        return queryset


def _pre(value: str):
    return format_html('<pre class="dlq-pre" style="white-space: pre-wrap; margin: 0">{}</pre>', value)


@admin.register(DeadLetter)
class DeadLetterAdmin(admin.ModelAdmin):
    list_display = ["age", "state", "workflow", "step", "error_class", "short_error", "attempts"]
    list_display_links = ["age"]
    list_filter = ["workflow", "step", "error_class", AgeFilter, StateFilter]
    search_fields = ["=run_id", "=trace_id", "error"]
    list_per_page = 50
    fieldsets = [
        (None, {"fields": ["state", "run_links", "workflow", "step", "attempts", "created_at"]}),
        ("Error", {"fields": ["error_class", "last_error", "full_traceback"]}),
        ("Input", {"fields": ["pretty_input"]}),
        ("Tracing", {"fields": ["trace_link", "job_link"]}),
        ("Resolution", {"fields": ["resolution", "resolved_by", "resolved_at", "note"]}),
    ]
    readonly_fields = [field for _, options in fieldsets for field in options["fields"]]
    actions = ["requeue", "resolve"]

    # Who sees the queue and who acts on it: DESIGN's roles, not model permissions (runs.access).
    def has_module_permission(self, request):
        return may_requeue_dead_letters(request.user)

    def has_view_permission(self, request, obj=None):
        return may_requeue_dead_letters(request.user)

    def has_add_permission(self, request):
        return False  # only the engine writes dead letters

    def has_change_permission(self, request, obj=None):
        return False  # a letter changes through the actions, which are audited

    def has_delete_permission(self, request, obj=None):
        return False

    def has_requeue_permission(self, request):
        return may_requeue_dead_letters(request.user)

    def has_resolve_permission(self, request):
        return may_resolve_dead_letters(request.user)

    @admin.display(description="error", ordering="error")
    def short_error(self, letter: DeadLetter) -> str:
        return letter.error if len(letter.error) <= 80 else letter.error[:79] + "…"

    @admin.display(description="age", ordering="created_at")
    def age(self, letter: DeadLetter) -> str:
        return timesince(letter.created_at)

    @admin.display(description="state", ordering="resolved_at")
    def state(self, letter: DeadLetter) -> str:
        return letter.resolution or "open"

    @admin.display(description="last error")
    def last_error(self, letter: DeadLetter):
        return _pre(letter.error)

    @admin.display(description="traceback")
    def full_traceback(self, letter: DeadLetter):
        return _pre(letter.traceback)

    @admin.display(description="input")
    def pretty_input(self, letter: DeadLetter):
        return _pre(json.dumps(letter.input, indent=2, sort_keys=True, cls=DjangoJSONEncoder))

    @admin.display(description="trace id")
    def trace_link(self, letter: DeadLetter):
        """The run's trace id, linked to the trace (TRACE_URL_TEMPLATE) when a tracing UI is configured."""
        url = tracing.trace_url(letter.trace_id)
        if not url:
            return letter.trace_id
        return format_html('<a href="{}" rel="noopener noreferrer"><code>{}</code></a>', url, letter.trace_id)

    @admin.display(description="run")
    def run_links(self, letter: DeadLetter):
        links = []
        page = f"/runs/{letter.run_id}/"
        try:
            resolve(page)
            links.append((page, "run page"))
        except Resolver404:
            pass  # no console run page in this deployment
        links.append((reverse("admin:runs_run_change", args=[letter.run_id]), "run in admin"))
        return format_html(
            "<code>{}</code> · {} · API: <code>GET /api/runs/{}</code>",
            letter.run_id,
            format_html_join(" · ", '<a href="{}">{}</a>', links),
            letter.run_id,
        )

    @admin.display(description="procrastinate job")
    def job_link(self, letter: DeadLetter):
        if letter.job_id is None:
            return "-"
        try:
            url = reverse("admin:procrastinate_procrastinatejob_change", args=[letter.job_id])
        except NoReverseMatch:
            return letter.job_id
        return format_html('<a href="{}">{}</a>', url, letter.job_id)

    @admin.action(
        description="Requeue the run from its last checkpoint (fresh attempts)", permissions=["requeue"], location=BOTH
    )
    def requeue(self, request, queryset):
        done = 0
        for letter in queryset:
            try:
                dead_letters.requeue(letter, request.user)
                done += 1
            except DeadLetterError as exc:
                self.message_user(request, str(exc), messages.WARNING)
        if done:
            self.message_user(request, f"{done} run(s) queued again from their last checkpoint.", messages.SUCCESS)

    @admin.action(description="Resolve with a note (no retry)", permissions=["resolve"], location=BOTH)
    def resolve(self, request, queryset):
        """An intermediate page asks for the note; its form posts back to this action with `apply`."""
        letters = list(queryset)
        error = ""
        if "apply" in request.POST:
            note = request.POST.get("note", "").strip()
            if not note:
                error = "A note is required: say what was done about these failures."
            else:
                done = 0
                for letter in letters:
                    try:
                        dead_letters.resolve(letter, request.user, note)
                        done += 1
                    except DeadLetterError as exc:
                        self.message_user(request, str(exc), messages.WARNING)
                if done:
                    self.message_user(request, f"{done} dead letter(s) resolved.", messages.SUCCESS)
                return None
        # Carry the action's own fields (which action, which letters, from which page) through the form.
        carried = [
            (key, value)
            for key in request.POST
            if key not in ("csrfmiddlewaretoken", "note", "apply")
            for value in request.POST.getlist(key)
        ]
        return TemplateResponse(
            request,
            "admin/jobs/deadletter/resolve.html",
            {
                **self.admin_site.each_context(request),
                "title": "Resolve dead letters",
                "opts": self.opts,
                "letters": letters,
                "carried": carried,
                "error": error,
                "note": request.POST.get("note", ""),
            },
        )
