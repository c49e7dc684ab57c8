# Channel moved from the console app to core (core.0001): the cards' foreign key follows it in the state only, the
# table it points at (console_channel) and the constraint being the same.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0008_shadow_cards"),
        ("core", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.AlterField(
                    model_name="approval",
                    name="channel",
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name="approvals", to="core.channel"
                    ),
                ),
            ],
        )
    ]
