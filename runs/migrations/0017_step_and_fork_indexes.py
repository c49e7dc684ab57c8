import django.db.models.deletion
from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # Two indexes fewer to write (docs/PROFILE-engine.md, "Round 3"): runs_step's on run_id alone, which the unique
    # (run_id, seq) covers, at every step; and runs_run's on fork_of_id, NULL for nearly every run, at every update
    # that cannot be HOT (a run's start and end), replaced by one on the forks alone. Only the indexes change:
    # Django's AlterField would drop and re-add each foreign key, which re-validates it with a scan of the whole
    # table under lock. CONCURRENTLY (built and dropped without blocking the checkpoints), outside a transaction.
    atomic = False

    dependencies = [("runs", "0016_run_trace_parent")]

    operations = [
        AddIndexConcurrently(
            model_name="run",
            index=models.Index(condition=models.Q(fork_of__isnull=False), fields=["fork_of"], name="runs_run_fork_of"),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="run",
                    name="fork_of",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="forks",
                        to="runs.run",
                    ),
                ),
                migrations.AlterField(
                    model_name="step",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="steps",
                        to="runs.run",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    'DROP INDEX CONCURRENTLY IF EXISTS "runs_run_fork_of_id_7484d536"',
                    reverse_sql='CREATE INDEX CONCURRENTLY "runs_run_fork_of_id_7484d536" ON "runs_run" ("fork_of_id")',
                ),
                migrations.RunSQL(
                    'DROP INDEX CONCURRENTLY IF EXISTS "runs_step_run_id_2764751d"',
                    reverse_sql='CREATE INDEX CONCURRENTLY "runs_step_run_id_2764751d" ON "runs_step" ("run_id")',
                ),
            ],
        ),
    ]
