from django.db import migrations

# The audit page lists entries newest first (ORDER BY id DESC LIMIT 51) under its filters, and PostgreSQL
# chooses between walking the primary key backwards until 51 entries match and collecting every match
# through an index and sorting them. The walk is only cheap when the planner's estimate of how many entries
# match is right; these statistics keep it right. Measured by bench/audit_page.py with 1,000,000 entries.
#
# 1. Equality filters are not independent: system components never reject a card, most people never
#    change a channel. Assuming independence, the planner expects "actor_type = system AND action =
#    approval.reject" to match thousands of entries and walks the whole table (~200 ms) to find none.
#    Statistics on the pairs people combine let it see that and use the indexes (a BitmapAnd) instead.
# 2. Full-text search on comments: a word that ANALYZE did not meet in its sample is assumed to be half as
#    frequent as the rarest word it kept; with a small sample of a repetitive vocabulary that guess can be
#    thousands of entries for a word in a hundred, and the walk computes to_tsvector for every entry (~1 s).
#    A larger sample for the index's expression keeps rare words in the statistics.
CREATE = """
CREATE STATISTICS IF NOT EXISTS console_audit_actor_type_action (mcv) ON actor_type, action FROM console_auditentry;
CREATE STATISTICS IF NOT EXISTS console_audit_actor_action (mcv) ON actor, action FROM console_auditentry;
CREATE STATISTICS IF NOT EXISTS console_audit_action_channel (mcv) ON action, channel FROM console_auditentry;
ALTER INDEX console_audit_comment_fts ALTER COLUMN 1 SET STATISTICS 1000;
"""
DROP = """
ALTER INDEX console_audit_comment_fts ALTER COLUMN 1 SET STATISTICS -1;
DROP STATISTICS IF EXISTS console_audit_action_channel;
DROP STATISTICS IF EXISTS console_audit_actor_action;
DROP STATISTICS IF EXISTS console_audit_actor_type_action;
"""


class Migration(migrations.Migration):
    dependencies = [("console", "0006_global_kill_switch")]

    operations = [migrations.RunSQL(CREATE, DROP)]
