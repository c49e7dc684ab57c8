-- The runs app's SQL: each statement under a `-- name --` line, then `--` lines saying what it is for
-- (procrastinate's own procrastinate/sql/queries.sql is the model). runs/sql/__init__.py reads them once, as
-- `queries[name]`, filling in:
--   {held}            the condition that this session holds the run's lock (run_lock_held below);
--   {take}            the run's lock, taken if nobody else holds it (take_run_lock below: true when taken);
--   {name.leaving}    the condition on a run's status that the transition `name` of runs.transitions
--                     (TRANSITIONS) may leave: "= 'running'", "IN ('waiting_human', 'paused')";
--   {name.target}     its target status, quoted;
-- and, in checkpoint, the last step's extras (checkpoint_finish). Doubled braces ({{columns}}) are left for the
-- caller to fill in. Parameters are psycopg's: %(name)s, or %s.

-- run_lock_held --
-- A condition (SQL) true only in the session that holds the lock of the run {hi}/{lo} (runs.ownership), asked of
-- PostgreSQL's lock manager itself: a holder takes the lock twice (take_run_lock), so that giving one back
-- (pg_advisory_unlock: true only in the session that holds it) leaves it held, and taking it again restores the
-- count. Both are bookkeeping on the session's own count of a lock it holds (no shared lock table is touched, no
-- other session can come in between); in a session that does not hold it, the unlock says false (and the server's
-- log a warning) and nothing is taken. Net nothing, however many times a statement evaluates it. It reads the lock,
-- not the run: what PostgreSQL releases with the session. (pg_locks says the same, but copies the whole cluster's
-- lock table at every call: 0.15-0.45 ms of the server's CPU, half of a step's checkpoint; docs/PROFILE-engine.md.)
CASE WHEN pg_advisory_unlock({hi}, {lo}) THEN pg_try_advisory_lock({hi}, {lo}) ELSE false END

-- take_run_lock --
-- The run's session lock, taken twice (run_lock_held says why) if nobody else holds it: the second is this
-- session's own count of a lock it holds, which cannot fail. False when another session holds it.
CASE WHEN pg_try_advisory_lock({hi}, {lo}) THEN pg_try_advisory_lock({hi}, {lo}) ELSE false END

-- try_lock_run --
-- runs.ownership.hold: take the run's session lock if nobody holds it.
SELECT {take}

-- unlock_run --
-- runs.ownership: let it go, both counts (false, and a warning in the server's log, when this session no longer
-- holds it).
SELECT CASE WHEN pg_advisory_unlock(%(lock_hi)s, %(lock_lo)s) THEN pg_advisory_unlock(%(lock_hi)s, %(lock_lo)s) ELSE false END

-- lock_tenant --
-- A tenant's transaction lock, which serialises the claims of its runs with the wake-ups of those waiting for a
-- slot (Run.free_slots, Run.wake_waiting_for_slot).
SELECT pg_advisory_xact_lock(hashtext(%s))

-- claim --
-- Run.claim: the run's row locked FOR UPDATE, then its tenant's transaction lock (the order of Run._swap's
-- wake-up), and whether this session holds the run's lock. MATERIALIZED: the row is locked in the CTE before the
-- outer query takes the tenant's lock. {{columns}}: the run's columns, in the order of its model's fields.
WITH r AS MATERIALIZED (SELECT {{columns}} FROM runs_run WHERE id = %(id)s FOR UPDATE) SELECT r.*, pg_advisory_xact_lock(hashtext('tenant:' || r.tenant)), {held} FROM r

-- claim_take --
-- Run.take, a job's first statement: the run's lock (take_run_lock) and, only when it was taken, what claim does
-- (the run's row locked FOR UPDATE, then its tenant's transaction lock). One row: whether the lock was taken, then
-- the run's columns and the tenant's lock (NULLs when it was not taken, or there is no such run). {{columns}}: as
-- in claim.
WITH l AS MATERIALIZED (SELECT {take} AS taken), r AS MATERIALIZED (SELECT {{columns}} FROM runs_run WHERE id = %(id)s AND (SELECT taken FROM l) FOR UPDATE) SELECT l.taken, r.*, pg_advisory_xact_lock(hashtext('tenant:' || r.tenant)) FROM l LEFT JOIN r ON true

-- start --
-- Run.claim's start of a queued run: the CAS, under the tenant's lock (taken by the statement before), only when
-- the tenant has a free slot and no older run of it waits for one (oldest first, as Run.waiting_for_slot orders
-- them). Not when a cancel was requested (the claim ends the run cancelled instead), unless it is to be undone. The tenant, priority and age
-- are the row's own, which the claim holds locked. Only from the session that holds the run's lock (Run.take sends
-- it whether claim_take took the lock or not).
UPDATE runs_run r SET status = {start.target}, owner = %(owner)s, waiting_for_slot_since = NULL, updated_at = %(now)s
WHERE r.id = %(id)s AND r.status {start.leaving} AND (NOT r.cancel_requested OR r.undo_reason <> '') AND {held}
    AND (SELECT count(*) FROM runs_run WHERE tenant = r.tenant AND status = 'running') < %(max)s
    AND NOT EXISTS (
        SELECT 1 FROM runs_run w
        WHERE w.tenant = r.tenant AND w.status = 'queued' AND w.waiting_for_slot_since IS NOT NULL
            AND w.id <> r.id
            AND (w.priority > r.priority OR (w.priority = r.priority AND w.created_at < r.created_at))
    )

-- start_then_steps --
-- Run.take's second statement: start, then step_rows, in one statement (both need a snapshot taken after
-- claim_take's locks, which this statement's is). The number of runs started (0 or 1), then the step rows.
WITH started AS ({start} RETURNING r.id) SELECT (SELECT count(*) FROM started), ({step_rows})

-- step_rows --
-- Run.claim's read of the run's step rows ([name, seq, status, output, input_hash] by seq: what the engine
-- replays), a statement of its own after the row lock, so that its snapshot includes every checkpoint committed
-- before the claim got the row (the row lock's wait re-reads the run's row, not the statement's other reads).
SELECT json_agg(json_build_array(s.name, s.seq, s.status, s.output, s.input_hash) ORDER BY s.seq)
FROM runs_step s WHERE s.run_id = %(id)s

-- steps_of_run --
-- runs.engine: the step rows of a run this job did not claim with Run.claim (which reads them itself).
SELECT name, seq, status, output, input_hash FROM runs_step WHERE run_id = %s ORDER BY seq

-- owned --
-- Run.owned: the owner's row lock, from the session that holds the run's lock.
SELECT cancel_requested, undo_reason FROM runs_run WHERE id = %(id)s AND owner = %(owner)s AND {held}
FOR NO KEY UPDATE

-- finish --
-- Run.finish: the owner's CAS (succeed or stop, which leave the same states), then, once the row is updated,
-- the tenant's lock, as Run._swap orders them.
WITH done AS (
    UPDATE runs_run
    SET status = %(status)s, owner = '', result = %(result)s::jsonb, finished_at = %(now)s, updated_at = %(now)s
    WHERE id = %(id)s AND status {succeed.leaving} AND owner = %(owner)s AND {held}
    RETURNING tenant
)
SELECT pg_advisory_xact_lock(hashtext('tenant:' || tenant)) FROM done

-- wake --
-- Run.wake_waiting_for_slot: the oldest runs waiting for a slot of the tenant, one per free slot.
SELECT id, priority FROM runs_run
WHERE tenant = %(tenant)s AND status = 'queued' AND waiting_for_slot_since IS NOT NULL
ORDER BY priority DESC, created_at
LIMIT GREATEST(%(max)s - (SELECT count(*) FROM runs_run WHERE tenant = %(tenant)s AND status = 'running'), 0)

-- checkpoint --
-- Run.checkpoint's one statement. The step's row comes from the run's UPDATE (no row: nothing is inserted), and
-- a row an earlier attempt left (failed, unknown, waiting) is updated as it was by the engine's upsert, its
-- tokens and cost added to (every attempt's; the run's totals were counted as the model answered: ModelUsage).
-- {finish} and {lock}: nothing, or (queries["checkpoint_finish"]) checkpoint_ends_run and its lock. {upsert}:
-- checkpoint_upsert, or (queries["checkpoint_new"], queries["checkpoint_finish_new"]) nothing, for a step no
-- earlier attempt left a row of: a plain INSERT, whose WAL is its row's (an INSERT ... ON CONFLICT writes a
-- speculative insertion and its confirmation); a row there after all is a unique violation, nothing written.
WITH moved AS (
    UPDATE runs_run
    SET "cursor" = %(next)s, attempt = 0, error = '', updated_at = %(now)s{finish}
    WHERE id = %(run)s AND status {checkpoint.leaving} AND owner = %(owner)s AND "cursor" = %(seq)s AND {held}
    RETURNING id, cancel_requested, tenant, undo_reason
), step AS (
    INSERT INTO runs_step AS s (
        run_id, seq, name, kind, input, input_hash, output, status, attempt, error,
        tokens_in, tokens_out, cost, latency_ms, prompt_version, tools_version, tape, started_at, ended_at
    )
    SELECT moved.id, %(seq)s::integer, %(name)s::varchar, %(kind)s::varchar, %(input)s::jsonb,
        %(input_hash)s::varchar, %(output)s::jsonb, 'done', %(attempt)s::integer, '', %(tokens_in)s::integer,
        %(tokens_out)s::integer, %(cost)s::numeric, %(latency_ms)s::double precision, %(prompt_version)s::varchar,
        %(tools_version)s::varchar, %(tape)s::jsonb, %(started_at)s::timestamptz, %(now)s::timestamptz
    FROM moved{upsert}
    RETURNING s.output
)
SELECT moved.cancel_requested, step.output, moved.undo_reason{lock} FROM moved, step

-- checkpoint_upsert --
-- The checkpoint's completion of the row an earlier attempt left (checkpoint's {upsert}).

    ON CONFLICT (run_id, seq) DO UPDATE SET
        status = EXCLUDED.status, attempt = EXCLUDED.attempt, error = EXCLUDED.error, output = EXCLUDED.output,
        tokens_in = s.tokens_in + EXCLUDED.tokens_in, tokens_out = s.tokens_out + EXCLUDED.tokens_out,
        cost = s.cost + EXCLUDED.cost,
        latency_ms = EXCLUDED.latency_ms, prompt_version = EXCLUDED.prompt_version,
        tools_version = EXCLUDED.tools_version, tape = EXCLUDED.tape, started_at = EXCLUDED.started_at, ended_at = EXCLUDED.ended_at

-- checkpoint_ends_run --
-- The last step's checkpoint also ends the run (Run.checkpoint(finish=True)): succeeded with its result, or
-- cancelled when a cancel was committed while the step ran (what the engine's next turn would have done), the
-- owner cleared (checkpoint's {finish}); but a cancel and undo leaves it running, its owner's to undo.
status = CASE WHEN cancel_requested AND undo_reason <> '' THEN {checkpoint.target} WHEN cancel_requested THEN {stop.target} ELSE {succeed.target} END,
        owner = CASE WHEN cancel_requested AND undo_reason <> '' THEN owner ELSE '' END,
        result = CASE WHEN cancel_requested AND undo_reason <> '' THEN result WHEN cancel_requested THEN %(cancelled)s::jsonb ELSE %(result)s::jsonb END,
        finished_at = CASE WHEN cancel_requested AND undo_reason <> '' THEN NULL ELSE %(now)s::timestamptz END

-- checkpoint_ends_run_lock --
-- Then, once the row is updated, its tenant's transaction lock, the order of Run.finish (checkpoint's {lock}).
pg_advisory_xact_lock(hashtext('tenant:' || moved.tenant))

-- record_usage --
-- ModelUsage.record's one statement: the call's row, and the run's totals, which every attempt counts toward.
WITH spent AS (
    INSERT INTO runs_modelusage (run_id, tenant, step, at, tokens_in, tokens_out, cost)
    VALUES (%(run)s, %(tenant)s, %(step)s, %(at)s, %(tokens_in)s, %(tokens_out)s, %(cost)s)
    RETURNING run_id
)
UPDATE runs_run r
SET tokens_in = r.tokens_in + %(tokens_in)s, tokens_out = r.tokens_out + %(tokens_out)s, cost = r.cost + %(cost)s
FROM spent WHERE r.id = spent.run_id
RETURNING r.tokens_in, r.tokens_out, r.cost

-- note_throttled --
-- runs.ratelimit: who is throttled, for the dashboard: one row per tenant, upserted in one statement.
INSERT INTO runs_tenantthrottle (tenant, waiting_until, used, "limit", waits, last_wait_at)
VALUES (%s, %s, %s, %s, 1, %s)
ON CONFLICT (tenant) DO UPDATE SET
    waiting_until = GREATEST(EXCLUDED.waiting_until, runs_tenantthrottle.waiting_until),
    used = EXCLUDED.used, "limit" = EXCLUDED."limit", last_wait_at = EXCLUDED.last_wait_at,
    waits = runs_tenantthrottle.waits + 1

-- insert_run_with_first_job --
-- runs.submission: the run's INSERT ({{insert}}, as Django's compiler writes it, returning its primary key
-- {{pk}}) and the defer of its first job by procrastinate's own stored procedure, in one statement; the job's
-- row, positionally: queue, task, priority, lock, queueing lock, arguments, scheduled_at.
WITH inserted AS ({{insert}} RETURNING {{pk}}) SELECT unnest(procrastinate_defer_jobs_v1(ARRAY[ROW(%s, %s, %s, %s, %s, %s::jsonb, NULL)::procrastinate_job_to_defer_v1])) FROM inserted

-- insert_runs_with_first_jobs --
-- runs.group_commit: many requests' runs and the first job of each run inserted, in one statement (one commit, one
-- wake-up: jobs/migrations/0003). {{insert}} is Django's INSERT of the runs with one VALUES row each; a run whose
-- idempotency key another run holds (committed, or earlier in this batch) is skipped by ON CONFLICT and gets no
-- job, and its request is settled as runs.submission.submit settles a duplicate. The jobs' rows come as arrays in
-- the runs' order: run id, queue, task, priority, lock, queueing lock, arguments (JSON text). Answers (run id, job
-- id) for each run inserted. The statement names itself (pg_stat_activity shows a statement's first kilobyte).
/* runs.group_commit */ WITH inserted AS ({{insert}} ON CONFLICT DO NOTHING RETURNING {{pk}}),
wanted AS (
    SELECT j.run_id, j.queue, j.task, j.priority, j.lock, j.queueing_lock, j.args, row_number() OVER (ORDER BY j.n) AS i
    FROM unnest(%s::uuid[], %s::text[], %s::text[], %s::int[], %s::text[], %s::text[], %s::text[])
        WITH ORDINALITY AS j(run_id, queue, task, priority, lock, queueing_lock, args, n)
    WHERE j.run_id IN (SELECT {{pk}} FROM inserted)
),
deferred AS (
    SELECT procrastinate_defer_jobs_v1(ARRAY(
        SELECT ROW(queue, task, priority, lock, queueing_lock, args::jsonb, NULL)::procrastinate_job_to_defer_v1
        FROM wanted ORDER BY i
    )) AS ids
)
SELECT w.run_id, d.job_id FROM wanted w JOIN unnest((SELECT ids FROM deferred)) WITH ORDINALITY AS d(job_id, i) USING (i)

-- ownerless_running --
-- runs.recovery: running runs whose lock no session holds (runs.ownership: the two-key form on the first 64 bits
-- of the id, which pg_locks shows unsigned as classid and objid), oldest first, a batch after (created_at, id).
SELECT r.id, r.owner, r.created_at FROM runs_run r
WHERE (r.status = 'running' OR (r.status = 'compensating' AND r.workflow <> 'external'))
    AND (r.created_at, r.id) > (%(after_at)s, %(after_id)s)
    AND NOT EXISTS (
        SELECT 1 FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
            AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
            AND l.classid::bigint = ('x' || lpad(substr(replace(r.id::text, '-', ''), 1, 8), 16, '0'))::bit(64)::bigint
            AND l.objid::bigint = ('x' || lpad(substr(replace(r.id::text, '-', ''), 9, 8), 16, '0'))::bit(64)::bigint
    )
ORDER BY r.created_at, r.id
LIMIT %(limit)s

-- finish_dead_job --
-- runs.recovery: an ownerless run's dead job (at most one: procrastinate's unique index on the lock of `doing`
-- jobs), finished by procrastinate's own procedure as a worker finishes a job (status, attempts, abort flag), in
-- the sweep's transaction. Guarded by its status: the stalled-job sweep may have requeued or finished it
-- meanwhile, and the procedure would finish a `todo` job too; so the row is locked first (a row another
-- transaction changed is read again), and is still `doing` when the procedure runs. Aborted, not failed: its
-- worker's session ended, the job did not fail.
WITH dead AS MATERIALIZED ( SELECT id FROM procrastinate_jobs WHERE lock = %s AND status = 'doing' FOR NO KEY UPDATE) SELECT procrastinate_finish_job_v1(id, 'aborted', false) FROM dead
