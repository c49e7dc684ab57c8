# The demo's fake systems' calls, moved here from the runs app: the table stays where runs' first migration made it.

import django.core.serializers.json
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [("runs", "0010_sandboxcall_moves_to_demo")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="SandboxCall",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("system", models.CharField(max_length=16)),
                        ("operation", models.CharField(max_length=64)),
                        ("idempotency_key", models.CharField(blank=True, max_length=300)),
                        ("run_id", models.UUIDField(blank=True, null=True)),
                        (
                            "payload",
                            models.JSONField(default=dict, encoder=django.core.serializers.json.DjangoJSONEncoder),
                        ),
                        (
                            "applied",
                            models.BooleanField(
                                default=True, help_text="False: received but refused (an injected fault)."
                            ),
                        ),
                        ("external_id", models.CharField(blank=True, max_length=64)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        "db_table": "runs_sandboxcall",
                        "indexes": [
                            models.Index(fields=["system", "idempotency_key"], name="runs_sandbox_system_key"),
                            models.Index(fields=["run_id", "system", "operation"], name="runs_sandbox_run_op"),
                        ],
                    },
                )
            ],
            database_operations=[],
        )
    ]
