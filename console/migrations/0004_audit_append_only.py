from django.db import migrations

APPEND_ONLY = """
CREATE FUNCTION console_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the audit log is append-only: % refused', TG_OP USING ERRCODE = 'insufficient_privilege';
END;
$$;
CREATE TRIGGER console_audit_append_only
    BEFORE UPDATE OR DELETE ON console_auditentry
    FOR EACH ROW EXECUTE FUNCTION console_audit_append_only();
"""

DROP = """
DROP TRIGGER console_audit_append_only ON console_auditentry;
DROP FUNCTION console_audit_append_only();
"""


class Migration(migrations.Migration):
    dependencies = [("console", "0003_auditentry")]

    operations = [migrations.RunSQL(APPEND_ONLY, DROP)]
