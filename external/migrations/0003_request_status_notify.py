"""A change of an external request's card status announces the request (issue 24, external/waiters.py).

`pg_notify('external_request_status', <request id>)` in the transaction that changes the status of a card that
belongs to an approval request, whatever changes it (a decision from any view, the SLA timer or sweep, a
cancellation, a bulk update): the web processes' listeners hear it when that transaction commits and wake the
request's long-polls. A workflow's card (no request) notifies nothing. The channel's name is
external.waiters.CHANNEL, written out here as a migration must not change with the code.
"""

from django.db import migrations

CREATE = """
CREATE FUNCTION external_request_status_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('external_request_status', request.id::text)
    FROM external_actionrequest AS request
    WHERE request.card_id = NEW.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER external_request_status_notify
AFTER UPDATE OF status ON approvals_approval
FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
EXECUTE FUNCTION external_request_status_notify();
"""

DROP = """
DROP TRIGGER IF EXISTS external_request_status_notify ON approvals_approval;
DROP FUNCTION IF EXISTS external_request_status_notify();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("external", "0002_action_request_api_token"),
        ("approvals", "0010_approval_on_expiry"),
    ]

    operations = [migrations.RunSQL(CREATE, DROP)]
