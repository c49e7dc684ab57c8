"""The inbox lists open cards by (due_at, id): a partial index on exactly those rows reads a page in order, and
later pages by keyset, without sorting the open cards. Raw SQL, so the models' state (and makemigrations) is
unchanged: the index serves one page's query, not a model invariant."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0002_sla_escalation_notifications"),
    ]

    operations = [
        migrations.RunSQL(
            "CREATE INDEX IF NOT EXISTS approvals_approval_open_due ON approvals_approval (due_at, id)"
            " WHERE status IN ('pending', 'escalated')",
            "DROP INDEX IF EXISTS approvals_approval_open_due",
        ),
    ]
