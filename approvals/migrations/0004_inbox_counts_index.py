"""The inbox's counts group every open card the user may decide by channel, risk, workflow and SLA state. A
covering partial index on the open cards lets that read only the index (an index-only scan) instead of the
cards' rows, whose JSON proposals make them wide. Raw SQL like 0003: the models' state is unchanged."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0003_inbox_open_due_index"),
    ]

    operations = [
        migrations.RunSQL(
            "CREATE INDEX IF NOT EXISTS approvals_approval_open_facets ON approvals_approval"
            " (channel_id, risk, due_at) INCLUDE (run_id, id) WHERE status IN ('pending', 'escalated')",
            "DROP INDEX IF EXISTS approvals_approval_open_facets",
        ),
    ]
