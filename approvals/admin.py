"""Notifications in Django admin: one that kept failing stays visible here with its last error, and can be sent
again. The Approve and Reject links their emails carried (approvals.links), read-only: who got which, until when,
and whether it was used. Approval policies and their stages, edited here, each change audited; delegations,
read-only."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils.html import format_html
from procrastinate.contrib.django import app

from approvals import rules
from approvals.models import ApprovalPolicy, DecisionLink, Delegation, Notification, PolicyStage
from core.admin import AuditedDeletion, ReadOnly
from core.models import AuditEntry


@admin.register(Notification)
class NotificationAdmin(admin.ModelAdmin):
    list_display = ["created_at", "event", "backend", "card", "group", "status", "attempts", "short_error", "sent_at"]
    list_filter = ["status", "backend", "event"]
    search_fields = ["last_error", "approval__id"]
    date_hierarchy = "created_at"
    list_select_related = ["group"]
    readonly_fields = [
        "approval",
        "event",
        "backend",
        "group",
        "payload",
        "status",
        "attempts",
        "last_error",
        "created_at",
        "sent_at",
    ]
    actions = ["send_again"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="card", ordering="approval_id")
    def card(self, obj: Notification):
        return format_html('<a href="/approvals/{}/">card {}</a>', obj.approval_id, obj.approval_id)

    @admin.display(description="last error")
    def short_error(self, obj: Notification) -> str:
        return obj.last_error[:120]

    @admin.action(description="Send the selected failed notifications again")
    def send_again(self, request, queryset) -> None:
        count = 0
        with transaction.atomic():
            for notification in (
                queryset.select_related(None).select_for_update(of=("self",)).filter(status=Notification.Status.FAILED)
            ):
                Notification.objects.filter(pk=notification.pk).update(status=Notification.Status.PENDING, attempts=0)
                # By its name, as the SLA timer defers it (approvals.sla): tasks are deferred by name.
                app.configure_task("approvals.tasks.send_notification", allow_unknown=False).defer(
                    notification_id=notification.pk
                )
                count += 1
        self.message_user(request, f"{count} notification(s) queued again.", messages.SUCCESS)


@admin.register(DecisionLink)
class DecisionLinkAdmin(ReadOnly, admin.ModelAdmin):
    """Read-only: a link is made by the email backend and used by a decision, never edited by hand (the token
    itself is never shown: it is the id signed, and would let its recipient's session decide)."""

    list_display = ["created_at", "card", "recipient", "decision", "expires_at", "emailed_at", "used_at"]
    list_filter = ["decision"]
    search_fields = ["recipient__username", "approval__id"]
    date_hierarchy = "created_at"
    list_select_related = ["recipient"]
    fields = ["approval", "notification", "recipient", "decision", "expires_at", "created_at", "emailed_at", "used_at"]
    readonly_fields = fields

    @admin.display(description="card", ordering="approval_id")
    def card(self, obj: DecisionLink):
        return format_html('<a href="/approvals/{}/">card {}</a>', obj.approval_id, obj.approval_id)


# --- approval policies ------------------------------------------------------------------------------------------


class PolicyStageFormSet(forms.BaseInlineFormSet):
    """A policy's stages, checked together (approvals.rules.stage_errors, policy_errors): at least one, the first
    one approving, each naming someone, no quorum above the people it names. A refused form saves nothing."""

    def clean(self) -> None:
        super().clean()
        purposes = []
        for form in sorted(self.forms, key=lambda f: f.cleaned_data.get("position") or 0):
            data = getattr(form, "cleaned_data", None)
            if not data or data.get("DELETE"):
                continue
            users = {u.pk for u in data.get("users") or []}
            for group in data.get("groups") or []:
                users |= set(group.user_set.filter(is_active=True).values_list("pk", flat=True))
            for error in rules.stage_errors(
                anyone=bool(data.get("channel_approvers")), quorum=data.get("quorum"), people=len(users)
            ):
                form.add_error(None, f"Stage '{data.get('name', '')}': {error}.")
            purposes.append(data.get("purpose"))
        for error in rules.policy_errors(purposes):
            raise ValidationError(error[0].upper() + error[1:] + ".")


class PolicyStageInline(admin.TabularInline):
    model = PolicyStage
    formset = PolicyStageFormSet
    extra = 1
    fields = ["position", "name", "purpose", "quorum", "sla", "channel_approvers", "groups", "users"]
    filter_horizontal = ["groups", "users"]


def policy_state(policy: ApprovalPolicy) -> dict:
    """A policy and its stages as stored, for its audit entries (people and groups by name)."""
    return {
        "name": policy.name,
        "channel": policy.channel.name,
        "applies_to": policy.applies_to,
        "at_end": policy.at_end,
        "version": policy.version,
        "stages": [
            {
                "position": stage.position,
                "name": stage.name,
                "purpose": stage.purpose,
                "quorum": stage.quorum,
                "sla": stage.sla.total_seconds() if stage.sla else None,
                "channel_approvers": stage.channel_approvers,
                "groups": sorted(g.name for g in stage.groups.all()),
                "users": sorted(u.username for u in stage.users.all()),
            }
            for stage in policy.stages.order_by("position", "pk")
        ],
    }


@admin.register(ApprovalPolicy)
class ApprovalPolicyAdmin(AuditedDeletion, admin.ModelAdmin):
    """Approval policies (approvals.models.ApprovalPolicy). Every save and delete is audited with the policy as it
    was and as it is; a save raises its version. Open cards keep the policy they were opened under."""

    list_display = ["name", "channel", "applies_to", "at_end", "version"]
    list_filter = ["channel"]
    inlines = [PolicyStageInline]

    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        # One transaction for the policy, its stages and the audit entry (Django admin's own is per view too).
        with transaction.atomic():
            if object_id:
                locked = ApprovalPolicy.objects.select_for_update().filter(pk=object_id).first()
                request._policy_before = policy_state(locked) if locked else None
            return super().changeform_view(request, object_id, form_url, extra_context)

    def save_model(self, request, obj, form, change):
        if change:
            obj.version = ApprovalPolicy.objects.get(pk=obj.pk).version + 1
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        policy = form.instance
        AuditEntry.record(
            "policy.change" if change else "policy.create",
            actor=request.user,
            target=f"policy:{policy.name}",
            channel=policy.channel.name,
            data={
                "before": getattr(request, "_policy_before", None) if change else None,
                "after": policy_state(policy),
            },
        )

    def _record_deletion(self, request, policy: ApprovalPolicy) -> None:
        AuditEntry.record(
            "policy.delete",
            actor=request.user,
            target=f"policy:{policy.name}",
            channel=policy.channel.name,
            data={"before": policy_state(policy), "after": None},
        )


@admin.register(Delegation)
class DelegationAdmin(ReadOnly, admin.ModelAdmin):
    """Who covers for whom (read-only here: each person sets their own in the console, audited)."""

    list_display = ["user", "cover", "until"]
    readonly_fields = ["user", "cover", "until", "created_at"]
