# SandboxCall belongs to the demo app now (demo.models): it leaves runs' state; its table stays (demo's first
# migration takes it over; where the demo is not installed, the table is left unused).

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("runs", "0009_run_attempt_help")]

    operations = [migrations.SeparateDatabaseAndState(state_operations=[migrations.DeleteModel(name="SandboxCall")])]
