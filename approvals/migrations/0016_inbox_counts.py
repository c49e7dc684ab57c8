"""The inbox's counts kept by the cards' writes (approvals.models.InboxCount, issue 30).

Triggers on approvals_approval and approvals_decision add, in the transaction of each write, a row of +n/-n per key
(channel, risk, workflow, run_created_by, asked_anyone, asked_users, asked_groups, deciders) for the open cards it
opens, closes or moves; a key's count is the sum of its rows. Statement-level triggers with transition tables: an
INSERT ... SELECT of 100,000 cards adds one row per key, and an UPDATE that moves no open card adds none.

- deciders: the distinct actors of a card's decisions (a person who decided an open card no longer sees it in their
  inbox). A decision's trigger locks its card first (FOR UPDATE, then a new statement, so a new snapshot), as
  Approval.decide does anyway: a card's writes and its decisions' are counted one after the other, never from two
  snapshots that each miss the other.
- TRUNCATE of either table rebuilds the counts from the cards (so does this migration, for the cards already open,
  after locking both tables against writes).
"""

import django.contrib.postgres.fields
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

OPEN = "status IN ('pending', 'escalated')"
KEY = "channel_id, risk, workflow, run_created_by_id, asked_anyone, asked_users, asked_groups"
COUNTED = f"{KEY}, deciders, n"

FORWARD = f"""
LOCK TABLE approvals_approval, approvals_decision IN SHARE ROW EXCLUSIVE MODE;

-- The distinct people who decided card `card`, sorted, leaving out the decisions `left_out`.
CREATE FUNCTION approvals_card_deciders(card bigint, left_out bigint[] DEFAULT '{{}}') RETURNS integer[]
LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg(DISTINCT actor_id ORDER BY actor_id), '{{}}')
    FROM approvals_decision
    WHERE approval_id = card AND actor_id IS NOT NULL AND NOT id = ANY(left_out)
$$;

CREATE FUNCTION approvals_inbox_count_rebuild() RETURNS void LANGUAGE sql AS $$
    DELETE FROM approvals_inboxcount;
    INSERT INTO approvals_inboxcount ({COUNTED})
    SELECT {KEY}, approvals_card_deciders(id), count(*) FROM approvals_approval WHERE {OPEN}
    GROUP BY {KEY}, approvals_card_deciders(id);
$$;

CREATE FUNCTION approvals_inbox_count_cards() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO approvals_inboxcount ({COUNTED})
        SELECT {KEY}, approvals_card_deciders(id), count(*) FROM came WHERE {OPEN}
        GROUP BY {KEY}, approvals_card_deciders(id);
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO approvals_inboxcount ({COUNTED})
        SELECT {KEY}, approvals_card_deciders(id), -count(*) FROM gone WHERE {OPEN}
        GROUP BY {KEY}, approvals_card_deciders(id);
    ELSIF TG_OP = 'UPDATE' THEN
        -- A card's deciders change only with its decisions (their trigger): the same before and after here.
        INSERT INTO approvals_inboxcount ({COUNTED})
        SELECT {KEY}, deciders, sum(n) FROM (
            SELECT {KEY}, approvals_card_deciders(id) AS deciders, -1 AS n FROM gone WHERE {OPEN}
            UNION ALL
            SELECT {KEY}, approvals_card_deciders(id), 1 FROM came WHERE {OPEN}
        ) AS moved
        GROUP BY {KEY}, deciders HAVING sum(n) <> 0;
    ELSE  -- TRUNCATE
        PERFORM approvals_inbox_count_rebuild();
    END IF;
    RETURN NULL;
END
$$;

CREATE FUNCTION approvals_inbox_count_decisions() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM approvals_inbox_count_rebuild();
        RETURN NULL;
    END IF;
    -- Their cards first, then a new statement: it sees whatever changed them before the lock was ours.
    IF TG_OP = 'INSERT' THEN
        PERFORM 1 FROM approvals_approval WHERE id IN (SELECT approval_id FROM came) ORDER BY id FOR UPDATE;
        INSERT INTO approvals_inboxcount ({COUNTED})
        SELECT {KEY}, deciders, sum(n) FROM (
            SELECT {KEY}, approvals_card_deciders(id, (SELECT array_agg(id) FROM came)) AS deciders, -1 AS n
            FROM approvals_approval WHERE id IN (SELECT approval_id FROM came) AND {OPEN}
            UNION ALL
            SELECT {KEY}, approvals_card_deciders(id), 1
            FROM approvals_approval WHERE id IN (SELECT approval_id FROM came) AND {OPEN}
        ) AS moved
        GROUP BY {KEY}, deciders HAVING sum(n) <> 0;
    ELSE  -- DELETE
        PERFORM 1 FROM approvals_approval WHERE id IN (SELECT approval_id FROM gone) ORDER BY id FOR UPDATE;
        INSERT INTO approvals_inboxcount ({COUNTED})
        SELECT {KEY}, deciders, sum(n) FROM (
            SELECT {KEY}, (
                SELECT coalesce(array_agg(DISTINCT actor_id ORDER BY actor_id), '{{}}') FROM (
                    SELECT approval_id, actor_id FROM approvals_decision
                    UNION ALL SELECT approval_id, actor_id FROM gone
                ) AS decided WHERE approval_id = card.id AND actor_id IS NOT NULL
            ) AS deciders, -1 AS n
            FROM approvals_approval AS card WHERE id IN (SELECT approval_id FROM gone) AND {OPEN}
            UNION ALL
            SELECT {KEY}, approvals_card_deciders(id), 1
            FROM approvals_approval WHERE id IN (SELECT approval_id FROM gone) AND {OPEN}
        ) AS moved
        GROUP BY {KEY}, deciders HAVING sum(n) <> 0;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER approvals_inbox_count_insert AFTER INSERT ON approvals_approval
    REFERENCING NEW TABLE AS came FOR EACH STATEMENT EXECUTE FUNCTION approvals_inbox_count_cards();
CREATE TRIGGER approvals_inbox_count_update AFTER UPDATE ON approvals_approval
    REFERENCING OLD TABLE AS gone NEW TABLE AS came FOR EACH STATEMENT EXECUTE FUNCTION approvals_inbox_count_cards();
CREATE TRIGGER approvals_inbox_count_delete AFTER DELETE ON approvals_approval
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION approvals_inbox_count_cards();
CREATE TRIGGER approvals_inbox_count_truncate AFTER TRUNCATE ON approvals_approval
    FOR EACH STATEMENT EXECUTE FUNCTION approvals_inbox_count_cards();
CREATE TRIGGER approvals_inbox_count_decision_insert AFTER INSERT ON approvals_decision
    REFERENCING NEW TABLE AS came FOR EACH STATEMENT EXECUTE FUNCTION approvals_inbox_count_decisions();
CREATE TRIGGER approvals_inbox_count_decision_delete AFTER DELETE ON approvals_decision
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION approvals_inbox_count_decisions();
CREATE TRIGGER approvals_inbox_count_decision_truncate AFTER TRUNCATE ON approvals_decision
    FOR EACH STATEMENT EXECUTE FUNCTION approvals_inbox_count_decisions();

SELECT approvals_inbox_count_rebuild();
"""

BACKWARD = """
DROP TRIGGER approvals_inbox_count_insert ON approvals_approval;
DROP TRIGGER approvals_inbox_count_update ON approvals_approval;
DROP TRIGGER approvals_inbox_count_delete ON approvals_approval;
DROP TRIGGER approvals_inbox_count_truncate ON approvals_approval;
DROP TRIGGER approvals_inbox_count_decision_insert ON approvals_decision;
DROP TRIGGER approvals_inbox_count_decision_delete ON approvals_decision;
DROP TRIGGER approvals_inbox_count_decision_truncate ON approvals_decision;
DROP FUNCTION approvals_inbox_count_decisions();
DROP FUNCTION approvals_inbox_count_cards();
DROP FUNCTION approvals_inbox_count_rebuild();
DROP FUNCTION approvals_card_deciders(bigint, bigint[]);
"""


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0015_approval_trace_parent"),
        ("core", "0004_pii_vault"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="InboxCount",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("risk", models.CharField(max_length=8)),
                ("workflow", models.CharField(max_length=100)),
                ("asked_anyone", models.BooleanField()),
                ("asked_users", django.contrib.postgres.fields.ArrayField(base_field=models.IntegerField())),
                ("asked_groups", django.contrib.postgres.fields.ArrayField(base_field=models.IntegerField())),
                ("deciders", django.contrib.postgres.fields.ArrayField(base_field=models.IntegerField())),
                ("n", models.IntegerField()),
                (
                    "channel",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="core.channel",
                    ),
                ),
                (
                    "run_created_by",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
        ),
        migrations.RunSQL(FORWARD, BACKWARD),
    ]
