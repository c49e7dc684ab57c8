# Channel, GlobalKillSwitch, ApiToken and AuditEntry move down from the console app (which made their tables,
# console.0001-0011) to this one. A move of state only: the tables keep their names (Meta.db_table), and with them
# their rows, constraints, indexes and the audit log's triggers (console.0004, 0009). console.0012 drops the models
# from the console app's state, after approvals.0009 points the cards' channel at core.Channel.
#
# Permissions live on content types: `approve_channel` and `operate_channel` (auth_permission rows) and every
# object permission granted on a channel (guardian's rows) point at the content type (console, channel). Renaming
# those content types to app_label `core`, here, keeps every id, so every grant now reads as
# `core.approve_channel` without a row of auth or guardian being touched. It runs in this migration, before the
# post_migrate signal at the end of `manage.py migrate` creates the content types and permissions of the core
# app that are missing: they are not missing then, so no duplicate is made.

import datetime

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import IntegrityError, migrations, models, transaction

import core.models

MOVED = ["channel", "globalkillswitch", "apitoken", "auditentry"]


def _repoint(model, duplicate, kept) -> None:
    """Every row of the project state that refers to `duplicate` (a content type or a permission: admin's log,
    guardian's object permissions, users' and groups' permissions) refers to `kept` instead; a row that would
    then repeat one already there (the same grant twice) is deleted."""
    for relation in model._meta.related_objects:
        if relation.many_to_many:
            through = relation.through
            (field,) = [f for f in through._meta.concrete_fields if f.is_relation and f.related_model is model]
            referrer = through
        else:
            referrer, field = relation.related_model, relation.field
        for pk in referrer._base_manager.filter(**{field.attname: duplicate.pk}).values_list("pk", flat=True):
            try:
                with transaction.atomic():
                    referrer._base_manager.filter(pk=pk).update(**{field.attname: kept.pk})
            except IntegrityError:
                referrer._base_manager.filter(pk=pk).delete()


def _move_content_types(apps, source: str, target: str) -> None:
    """Rename the moved models' content types from app_label `source` to `target`, keeping their ids. Where the
    `target` one exists already (post_migrate made it while the database was migrated back: `migrate core zero`
    with this code), what refers to it, and its permissions, are merged into the `source` one first."""
    ContentType = apps.get_model("contenttypes", "ContentType")
    Permission = apps.get_model("auth", "Permission")
    for name in MOVED:
        moving = ContentType.objects.filter(app_label=source, model=name).first()
        if moving is None:
            continue  # a fresh database (post_migrate makes the content types later), or moved already
        duplicate = ContentType.objects.filter(app_label=target, model=name).first()
        if duplicate is not None:
            for permission in Permission.objects.filter(content_type=duplicate):
                kept = Permission.objects.filter(content_type=moving, codename=permission.codename).first()
                if kept is None:
                    permission.content_type = moving
                    permission.save(update_fields=["content_type"])
                else:
                    _repoint(Permission, permission, kept)
                    permission.delete()
            _repoint(ContentType, duplicate, moving)
            duplicate.delete()
        moving.app_label = target
        moving.save(update_fields=["app_label"])


def forwards(apps, schema_editor):
    _move_content_types(apps, "console", "core")


def backwards(apps, schema_editor):
    _move_content_types(apps, "core", "console")


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("console", "0011_channel_shadow"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("auth", "0012_alter_user_first_name_max_length"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name="ApiToken",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("digest", models.CharField(max_length=64, unique=True)),
                        (
                            "prefix",
                            models.CharField(
                                help_text="The token's first characters, to tell tokens apart.", max_length=8
                            ),
                        ),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        ("last_used_at", models.DateTimeField(blank=True, null=True)),
                        ("revoked_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "tenants",
                            models.JSONField(
                                default=core.models._default_tenants,
                                help_text="The tenants (a list) this token may start runs for; '*' means any.",
                            ),
                        ),
                        (
                            "user",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="api_tokens",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={"db_table": "console_apitoken"},
                ),
                migrations.CreateModel(
                    name="AuditEntry",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("at", models.DateTimeField()),
                        (
                            "actor_type",
                            models.CharField(
                                choices=[("human", "Human"), ("agent", "Agent"), ("system", "System")], max_length=8
                            ),
                        ),
                        (
                            "actor",
                            models.CharField(
                                help_text="Username, or the name of the system component.", max_length=150
                            ),
                        ),
                        ("action", models.CharField(max_length=64)),
                        ("target", models.CharField(blank=True, max_length=200)),
                        ("run_id", models.UUIDField(blank=True, null=True)),
                        ("approval_id", models.BigIntegerField(blank=True, null=True)),
                        ("channel", models.CharField(blank=True, max_length=64)),
                        ("data", models.JSONField(blank=True, default=dict)),
                        ("trace_id", models.CharField(blank=True, max_length=32)),
                        ("prev_hash", models.CharField(max_length=64)),
                        ("hash", models.CharField(max_length=64, unique=True)),
                        (
                            "hash_scheme",
                            models.CharField(
                                choices=[("sha256", "SHA-256"), ("hmac-sha256", "HMAC-SHA256")],
                                db_default="sha256",
                                default="sha256",
                                max_length=16,
                            ),
                        ),
                        (
                            "hmac_key_id",
                            models.CharField(
                                blank=True,
                                db_default="",
                                default="",
                                help_text="audit_key_id() of the key that signed it.",
                                max_length=16,
                            ),
                        ),
                    ],
                    options={
                        "db_table": "console_auditentry",
                        "ordering": ["-id"],
                        "indexes": [
                            models.Index(fields=["-at"], name="console_audit_at"),
                            models.Index(fields=["actor", "-at"], name="console_audit_actor_at"),
                            models.Index(fields=["action", "-at"], name="console_audit_action_at"),
                            models.Index(fields=["channel", "-at"], name="console_audit_channel_at"),
                            models.Index(fields=["run_id"], name="console_audit_run"),
                        ],
                        "constraints": [
                            models.CheckConstraint(
                                condition=models.Q(("actor_type__in", ["human", "agent", "system"])),
                                name="console_auditentry_actor_type_valid",
                            ),
                            models.CheckConstraint(
                                condition=models.Q(
                                    models.Q(("hash_scheme", "sha256"), ("hmac_key_id", "")),
                                    models.Q(
                                        ("hash_scheme", "hmac-sha256"), models.Q(("hmac_key_id", ""), _negated=True)
                                    ),
                                    _connector="OR",
                                ),
                                name="console_auditentry_hash_scheme_valid",
                            ),
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="Channel",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("name", models.SlugField(max_length=64, unique=True)),
                        ("description", models.CharField(blank=True, max_length=200)),
                        (
                            "sla",
                            models.DurationField(
                                default=datetime.timedelta(seconds=3600),
                                help_text="How long a card may wait for a decision.",
                            ),
                        ),
                        (
                            "escalation_policy",
                            models.CharField(
                                choices=[("escalate", "Escalate"), ("safe_default", "Safe Default")],
                                default="escalate",
                                max_length=16,
                            ),
                        ),
                        ("required_approvals", models.PositiveSmallIntegerField(default=1)),
                        (
                            "shadow",
                            models.BooleanField(
                                default=False,
                                help_text="Shadow mode (a pilot's first weeks): cards on this channel are marked shadow "
                                "and its side effects are recorded, never sent; the reviewer does the action by hand "
                                "and says whether they agree with the agent.",
                            ),
                        ),
                        ("kill_switch_engaged", models.BooleanField(default=False)),
                        ("kill_switch_reason", models.TextField(blank=True)),
                        ("kill_switch_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "escalation_group",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="escalation_channels",
                                to="auth.group",
                            ),
                        ),
                        (
                            "kill_switch_by",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={
                        "db_table": "console_channel",
                        "ordering": ["name"],
                        "permissions": [
                            ("approve_channel", "Can see and decide the approval cards of this channel"),
                            ("operate_channel", "Can engage and release this channel's kill switch"),
                        ],
                        "constraints": [
                            models.CheckConstraint(
                                condition=models.Q(("required_approvals__in", [1, 2])),
                                name="console_channel_required_approvals_1_or_2",
                            ),
                            models.CheckConstraint(
                                condition=models.Q(("escalation_policy__in", ["escalate", "safe_default"])),
                                name="console_channel_escalation_policy_valid",
                            ),
                            models.CheckConstraint(
                                condition=models.Q(
                                    ("kill_switch_engaged", False), ("kill_switch_at__isnull", False), _connector="OR"
                                ),
                                name="console_channel_engaged_has_time",
                            ),
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="GlobalKillSwitch",
                    fields=[
                        (
                            "id",
                            models.PositiveSmallIntegerField(
                                default=1, editable=False, primary_key=True, serialize=False
                            ),
                        ),
                        ("kill_switch_engaged", models.BooleanField(default=False)),
                        ("kill_switch_reason", models.TextField(blank=True)),
                        ("kill_switch_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "kill_switch_by",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={
                        "verbose_name": "global kill switch",
                        "db_table": "console_globalkillswitch",
                        "constraints": [
                            models.CheckConstraint(
                                condition=models.Q(("id", 1)), name="console_globalkillswitch_single_row"
                            ),
                            models.CheckConstraint(
                                condition=models.Q(
                                    ("kill_switch_engaged", False), ("kill_switch_at__isnull", False), _connector="OR"
                                ),
                                name="console_globalkillswitch_engaged_has_time",
                            ),
                        ],
                    },
                ),
            ],
        ),
        migrations.RunPython(forwards, backwards),
    ]
