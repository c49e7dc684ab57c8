from django.contrib import admin
from guardian.admin import GuardedModelAdmin

from console.models import ApiToken, Channel


@admin.register(Channel)
class ChannelAdmin(GuardedModelAdmin):
    """Object permissions (approve_channel, operate_channel) are assigned from each channel's
    "Object permissions" page."""

    list_display = ["name", "required_approvals", "sla", "escalation_policy", "kill_switch_engaged"]
    readonly_fields = ["kill_switch_engaged", "kill_switch_reason", "kill_switch_by", "kill_switch_at"]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["prefix", "user", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["user", "digest", "prefix", "created_at", "last_used_at"]
    fields = ["user", "prefix", "digest", "created_at", "last_used_at", "revoked_at"]

    def has_add_permission(self, request):
        return False  # tokens are issued by `manage.py create_api_token`, which shows the secret once
