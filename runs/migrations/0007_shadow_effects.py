import django.core.serializers.json
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0006_webhook_delivery"),
    ]

    operations = [
        migrations.CreateModel(
            name="ShadowEffect",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("step_seq", models.PositiveIntegerField()),
                ("step", models.CharField(max_length=100)),
                ("channel", models.CharField(max_length=64)),
                ("key", models.CharField(help_text="The effect's receipt key.", max_length=300, unique=True)),
                (
                    "preview",
                    models.JSONField(
                        blank=True,
                        encoder=django.core.serializers.json.DjangoJSONEncoder,
                        help_text="The call's arguments, as the step described them.",
                        null=True,
                    ),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                (
                    "run",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="shadow_effects", to="runs.run"
                    ),
                ),
            ],
            options={
                "ordering": ["-created_at"],
                "indexes": [models.Index(fields=["run", "step_seq"], name="runs_shadoweffect_run_step")],
            },
        ),
    ]
