from django.db import migrations

# The audit page's full-text search on comments (console/audit.py) uses this exact expression, so that the
# planner can answer it from the index. Built CONCURRENTLY: on a large audit log a plain CREATE INDEX would
# block every decision (each writes an audit entry) for as long as the build takes.
CREATE = """
CREATE INDEX CONCURRENTLY IF NOT EXISTS console_audit_comment_fts ON console_auditentry
    USING gin (to_tsvector('english', coalesce(data->>'comment', '')))
"""
DROP = "DROP INDEX CONCURRENTLY IF EXISTS console_audit_comment_fts"


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [("console", "0004_audit_append_only")]

    operations = [migrations.RunSQL(CREATE, DROP)]
