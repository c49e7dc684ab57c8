from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # Built CONCURRENTLY: a plain CREATE INDEX would block every run's checkpoint for as long as it scans the
    # runs table, and CONCURRENTLY cannot run inside a transaction.
    atomic = False

    dependencies = [("runs", "0002_run_paused_switch")]

    operations = [
        AddIndexConcurrently(
            model_name="run",
            index=models.Index(
                condition=models.Q(status="paused"), fields=["paused_switch"], name="runs_run_paused_switch"
            ),
        ),
    ]
