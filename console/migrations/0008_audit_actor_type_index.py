from django.db import migrations

# The audit page's "actor type" filter combined with another one (system components never reject a card):
# without an index on actor_type, PostgreSQL reads every entry the other filter matches to check it (~130 ms
# for an action at 1,000,000 entries); with one it intersects the two indexes (a BitmapAnd, ~10 ms). Three
# values deduplicate well: ~7 MB per million entries. Built CONCURRENTLY, like console_audit_comment_fts.
CREATE = "CREATE INDEX CONCURRENTLY IF NOT EXISTS console_audit_actor_type ON console_auditentry (actor_type)"
DROP = "DROP INDEX CONCURRENTLY IF EXISTS console_audit_actor_type"


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [("console", "0007_audit_filter_statistics")]

    operations = [migrations.RunSQL(CREATE, DROP)]
