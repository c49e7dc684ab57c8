from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("console", "0010_api_token_tenants"),
    ]

    operations = [
        migrations.AddField(
            model_name="channel",
            name="shadow",
            field=models.BooleanField(
                default=False,
                help_text="Shadow mode (a pilot's first weeks): cards on this channel are marked shadow and its side "
                "effects are recorded, never sent; the reviewer does the action by hand and says whether they agree "
                "with the agent.",
            ),
        ),
    ]
