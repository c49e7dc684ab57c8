# Channel, GlobalKillSwitch, ApiToken and AuditEntry belong to the core app now (core.0001, which also renames
# their content types, so permissions keep working): they leave the console app's state; their tables stay.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("console", "0011_channel_shadow"),
        ("core", "0001_initial"),
        ("approvals", "0009_channel_moves_to_core"),  # no foreign key points at console.Channel any more
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.DeleteModel(name="ApiToken"),
                migrations.DeleteModel(name="AuditEntry"),
                migrations.DeleteModel(name="Channel"),
                migrations.DeleteModel(name="GlobalKillSwitch"),
            ],
        )
    ]
