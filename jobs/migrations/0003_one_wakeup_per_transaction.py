"""The job-insert notification, ours (issue 30): one wake-up per transaction, not one per job.

procrastinate's trigger function `procrastinate_notify_queue_job_inserted_v1` sends, for every job inserted, a
notification whose payload names the job (`{"type": "job_inserted", "job_id": N}`): N jobs in one transaction are
N distinct notifications. Its workers read only the payload's `type` (procrastinate.worker.Worker.
_handle_notification: it sets the new-job event; jobs/worker.py's latch does the same), so this body sends the
same payload without the id, and PostgreSQL folds identical notifications of one transaction into one: a group
commit of many runs (runs/group_commit.py) wakes each listener once. The trigger is procrastinate's, unchanged;
jobs/internals.py checks at a worker's start that this body is still the one installed (a later procrastinate
migration could put its own back). Reversed, procrastinate's own body returns.
"""

from django.db import migrations

OURS = """
CREATE OR REPLACE FUNCTION procrastinate_notify_queue_job_inserted_v1()
    RETURNS trigger
    LANGUAGE plpgsql
AS $$
BEGIN
    -- console: one wake-up per transaction (jobs/migrations/0003_one_wakeup_per_transaction.py)
    PERFORM pg_notify('procrastinate_queue_v1#' || NEW.queue_name, '{"type" : "job_inserted"}');
    PERFORM pg_notify('procrastinate_any_queue_v1', '{"type" : "job_inserted"}');
    RETURN NEW;
END;
$$;
"""

PROCRASTINATES = """
CREATE OR REPLACE FUNCTION procrastinate_notify_queue_job_inserted_v1()
    RETURNS trigger
    LANGUAGE plpgsql
AS $$
DECLARE
    payload TEXT;
BEGIN
    SELECT json_build_object('type', 'job_inserted', 'job_id', NEW.id)::text INTO payload;
    PERFORM pg_notify('procrastinate_queue_v1#' || NEW.queue_name, payload);
    PERFORM pg_notify('procrastinate_any_queue_v1', payload);
    RETURN NEW;
END;
$$;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0002_deadletter_resolution_choices"),
        ("procrastinate", "0041_post_retry_failed_job"),
    ]

    operations = [migrations.RunSQL(OURS, PROCRASTINATES)]
