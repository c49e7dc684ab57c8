"""Renders docs/BENCHMARKS.md from a `make bench` run (bench/run_all.py hands it the figures)."""

from __future__ import annotations

import re

ENQUEUE_BOUND = """\
**The server (issue 21).** `POST /api/runs` and the one-INSERT `/bench/insert` were measured side by side under
Django's ASGI handler for every view (uvicorn, the server before), gunicorn `gthread` (2 x 8 threads, WSGI),
granian (WSGI, 2 x 8 blocking threads) and the shipped server, each against the bare-ASGI floor in the same run
(`bench/enqueue.py --connections 16 --compare uvicorn-asgi,gunicorn-gthread,granian-wsgi`, 2026-12-02, load
average 5-31 from other sessions' tests, so only figures of one run compare). Before this issue's trims of the
request path, web CPU per `/bench/insert` was 4.4-5.1 ms under Django's ASGI handler against 1.3-1.7 under gunicorn
and 1.1-1.2 under granian, and per `POST /api/runs` 6.0-7.1 against 3.7-3.9 and 3.8-4.5. After them (at commit
e54e56f, load 10-13, 8 s cells), per `/bench/insert`: ASGI 1.19 ms, gunicorn 0.94, granian 0.81, shipped 1.46; per
`POST /api/runs`: 1.89, 1.91, 1.95 and 2.52, at 456, 316, 307 and 301 req/s (p99 86, 280, 279 and 252 ms): for
`POST /api/runs` the server no longer decides the figure (PostgreSQL does, below). The shipped server is uvicorn
serving `console/asgi.py`: every sync view as WSGI in a fixed pool of threads (a2wsgi, WEB_THREADS=8 per process,
one pooled connection each), async views through Django's ASGI handler, and the approval-request long-poll waiting
in the event loop between its looks (console/long_poll.py, issue 24). It was chosen for the long-poll: a client
waiting for a decision holds no thread and no database connection, where gunicorn or granian would hold one of
their threads per waiting client for up to a minute; and
it keeps uvicorn's graceful shutdown, TCP_NODELAY and the body limit enforced while the body arrives. Its price,
measured: the hop from the event loop to a thread and back costs ~0.5 ms of CPU per request more than gunicorn's
or granian's own threads. If the long-poll moves to a push (a webhook, which the API has) or its own small
server, granian WSGI is the cheapest server measured here.

**The API path (issue 21).** Profiled in process (`bench/profile_api.py`: cProfile over 1,000 requests through the
WSGI stack, CPU time; the top entries before and after: [docs/PROFILE-api.md](PROFILE-api.md)): a quarter of the
request was the ORM compiling the run's INSERT on every request (now compiled once per process:
runs.submission.run_insert), one of its three round trips was the pool's health check (now a look at the socket:
console.db_pool), and the middleware a token request does not use is skipped (console.middleware.browser_only):
29 % fewer Python calls per request. What is left, per request: the token lookup and the run's INSERT with its
job (two round trips), ninja's parsing and validation, two JSON log lines (the request's and the run's), Django's
request, URL resolution and response objects.

**Before issue 30: PostgreSQL's NOTIFY, one commit at a time.** Request threads spent ~70 % of their wall clock
waiting for the run's one statement: Procrastinate's insert trigger notified for every job, and PostgreSQL
serialises the commits of transactions that notified (a lock held until the commit is durable, its WAL flush
included; `bench/notify_probe.py`, 16 clients on this machine's PostgreSQL 15: 4,300-5,900 commits/s for a plain
INSERT, 300-510 with a `pg_notify`). So each accepted run paid one pass through that queue.

**Group commit (issue 30).** The runs that one web process receives at the same time are now written in one
statement, one commit (runs/group_commit.py; docs/DESIGN-NOTES.md, HTTP), and the trigger's notification no longer
names the job, so PostgreSQL folds a batch's notifications into one (jobs/migrations/0003): one pass through the
queue and one wake-up per batch. No request is answered before its batch committed (a system test kills the web
process mid-batch: docs/RELIABILITY.md). What it lifts is the database's bound, measured apart from the web tier
by `bench/notify_probe.py --batch 8` (16 clients, PostgreSQL 15, 2026-12-06, load 2.1): 1,024-1,492 rows/s when
each row's commit notifies, 9,706-10,806 rows/s in commits of 8 rows that notify once, against 3,958-4,592 plain
INSERT commits/s. That bound is the database's, shared by every web process of a deployment; the web tier's own
CPU is per process and scales out.

**On this machine the figure is bound by the web tier's CPU, and group commit does not move it.** In this run, at
16 connections: {runs_rps} req/s with group commit against {single_rps} with each run in a commit of its own
(`production-single`, GROUP_COMMIT=0, the same server and database), p99 {runs_p99} ms against {single_p99} ms.
Two web processes and PostgreSQL share 2 cores: {runs_cpu} ms of web CPU per `POST /api/runs` under load against
the floor's {floor_cpu} ms ({floor_rps} req/s, p99 {floor_p99} ms), load average {load}: {ratio} of the floor.
Django's request path alone is below the goal: `POST /bench/insert`, one INSERT and no NOTIFY, no token and no
validation, served {insert_rps} req/s, {insert_ratio} of the floor. So 0.35 of the floor (and a p99 under 50 ms,
which a closed loop of 16 needs well over 320 req/s for) is out of reach on any path through Django's request
handling here. What each layer costs is in [docs/PROFILE-api.md](PROFILE-api.md) (round 3). The lever that would
reach it, a lean path at the ASGI edge that skips that machinery for the agents' hot endpoints, is not taken:
each rule the machinery applies to an API request (request id and log line, outage answer, NUL check, security
headers, axes, personal-data masking, the request's span, the pool's return) would have to be kept a second time
beside the first, and a second door that forgot one is how the external door broke (issue 27). The levers inside
the one door are listed there."""

THROUGHPUT_NOTE = """\
Write transactions are transaction ids consumed (cluster-wide: exact on the private embedded server, other
sessions' writes included on the shared PostgreSQL 15); commits are `pg_stat_database.xact_commit` of the bench's
database (read-only transactions included: the workers' fetches and polls); rows are its inserted + updated +
deleted tuples; WAL bytes are cluster-wide. Every figure is per step and includes the job's own share (fetch,
finish: about 0.4 write transactions per step for a 5-step job, as the baseline shows). The engine's floor with
this shape is 1.8 write transactions per step: one per step (its checkpoint, one statement in autocommit), plus
the run's claim and its finish and the job's fetch and finish, four per run."""


PEERS_NOTE = """\
**Reading (issue 30).** The workload is bench/throughput_workers.py's: runs of five steps that do nothing, each
step's completion persisted before the next starts, on the machine's PostgreSQL 15 over TCP. The peers are installed
by bench/peers.py into a virtualenv of its own from the exact pins of bench/peers-requirements.txt, and each batch
runs on a fresh database (bench/peers_runner.py says how each is driven). `dbos`: `DBOS.start_workflow` for every
run at once, on DBOS's executor of that many threads (its in-process background execution; the start's durable
insert is in the figure); `dbos-queue`: the runs enqueued first in one transaction, then dequeued from a DBOS queue
with no worker limit (DBOS's default) on the same executor, timed from the first dequeue to the last completion, as
the engine's batch is timed from its first job's fetch; `langgraph`: a five-node `StateGraph` compiled with
`PostgresSaver`, every run a thread_id invoked from that many Python threads, with `durability="sync"` (a step's
checkpoint written before the next step); `langgraph-async`: the same with LangGraph's default, `durability="async"`.
The engine and plain Procrastinate run on one production worker process (`manage.py worker`) of the same
concurrency. The rounds alternate (the order reversed every other round); a figure is the median of its rounds, the
spread of the rounds beside it, and each ratio is the engine's median over the peer's."""


BOUNDS = {
    "throughput": """\
**What bounds it now** ([PROFILE-engine.md](PROFILE-engine.md) has the profile: CPU per step of the worker and of
its PostgreSQL backends, PostgreSQL CPU per statement, py-spy). CPU, on 2 cores shared by the worker, PostgreSQL
and the rest of the machine; not round trips (13 for a 5-step run against the baseline's 16) and not lock waits.
Before issue 21 the engine's PostgreSQL backends spent 3.1 ms of CPU a step against the baseline's 0.55, most of
it parsing and planning the checkpoint (a data-modifying CTE: the run's owner-, cursor- and lock-checked UPDATE and
the step's INSERT) at every step, as Django binds parameters client-side: 1.3 ms of PostgreSQL CPU for each
checkpoint, 0.5 ms prepared. The checkpoint of every step but the last is now a server-side prepared statement on
the job's own connection (`runs.sql.prepared_cursor`: same session, same transaction, same lock check): PostgreSQL
CPU per step 1.4 ms. What is left: the worker's Python (1.3-2 ms a step against the baseline's 0.87: the step
input's hash and its second serialisation, parameter adaptation, procrastinate's per-job work), the lock check
(`pg_locks`, 0.1-0.3 ms a step: the ownership guarantee, kept), the claim's unprepared query string once a run
(1.1 ms; prepared as separate statements it would cost the resume path two round trips), and procrastinate's
fetch of a job with a lock (an index walk per fetch). The next levers, in that order, are in the profile.
Round 3 (issue 30, the profile's last section): the lock check asks the lock manager instead of copying `pg_locks`
(a job holds the run's lock twice; the check gives one count back and takes it again), a job's lock and claim are
one pipelined round trip, the last checkpoint is prepared, a new step is a plain INSERT, and two indexes are gone:
the server's CPU per step 1.54 -> 1.12 ms and WAL 1,542 -> 1,396 bytes a step (pg_walinspect, this database
only), against plain's 0.48 ms and 545 bytes. What is left is what a step must write in this schema (the step row
carries the run's input and every earlier output) and procrastinate's four round trips to fetch and finish a job;
the next lever for both is the worker's pool in autocommit.""",
    "resume": """\
**Reading.** Latency is the decision's `Decision.created_at` (written just before its commit) to the gate step's
restart (`Step.started_at`, written by the worker), on the production worker with its defaults (`manage.py
worker`: the notification latch of jobs/worker.py, the 1 s fallback poll, INFO logs), split at the job's
`started` event (the worker's fetch). The baseline is procrastinate 3.10's stock worker loop, which can drop a
notification that arrives during an empty fetch and then waits for its poll (5 s here): the latch removes that
tail. Neither part of the path computes (py-spy: the worker's event loop idle most of the time): decision ->
fetch is the decision's commit, the NOTIFY, the worker's wake-up and its fetch; fetch -> step is the job's
thread, the connection's health check, the run's advisory lock, BEGIN, the claim in one query string and COMMIT
(5 round trips). Each hop waits for a time slice in two processes on 2 cores shared with other sessions' test
suites: on an idle machine the same path was p50 ~18 ms (2026-12-01), under a load average of 8-12 it is
~100 ms. The goal's p99 < 25 ms needs an idle machine or fewer hops: the next levers are the health check folded
into the advisory lock's statement and the lock into the claim's query string (2 round trips fewer), see
[PROFILE-engine.md](PROFILE-engine.md). The gate's `decided` lookup (card, then its decisions) runs after
`Step.started_at` and is not in the figure.""",
    "longpoll": """\
**Reading (issue 24).** Both rows are the same call (`GET /api/approvals` as a reviewer with 10 cards) on the same
server in the same run; the waiting agents' requests are on a channel that reviewer does not see, so only their
waiting differs. While they wait, none of their looks goes through Django (the output counts them: 0), and none
holds a thread or a database connection: a waiting agent costs the server an open socket and an asyncio task
(console/long_poll.py), and a decision wakes it through its web process's one LISTEN session
(external/waiters.py). Before, each waiting agent held a thread and looked at its request 5 times a second: the
issue measured 1.0-2.6 s for this call and 503s for some long-polls with 300 waiting on `make run`; 1,000 would
have asked for 5,000 looks a second. The goal's p99 < 100 ms is not met by the baseline itself on this machine:
wrk's 16 connections are a closed loop (mean latency = 16 / throughput), so p99 < 100 ms needs well over 160 of
these calls a second from 2 cores that other sessions' test suites share (load average in the section's header);
what the agents add is the difference between the two rows, which stays within the run-to-run noise (three runs
on 2026-12-04: +38 %, -13 % and -14 % on p99 with 1,000 waiting, the machine's load moving between 6 and 33).
The decision-to-answer figures are taken while the reviewer decides 16 at a time: each woken agent's look queues
with the decisions for the same WSGI threads.""",
    "console": """\
**Reading.** Query counts are the same with 10 and 100,010 cards (and with an empty and a full audit log). The
inbox runs on the machine's PostgreSQL 15 (the audit page on an embedded server); the requests go through Django's
test client in the bench's own process, which shares the 2 cores with the rest of the machine. The
runs list pages by keyset (`before`: the last row's created_at and id, no COUNT) and a reviewer's visibility is a
row-by-row probe of each run's cards (`EXISTS ... OFFSET 0`, newest run first: a page stops after its rows); before,
PostgreSQL hashed every card of the reviewer's channels before the first row (243 ms at 100,000 cards, now 0.35
ms: `bench/inbox.py --explain`). The audit page turns a date range into an id range (`at` grows with `id`), so a
range that ended six months ago no longer walks half the primary key (90 ms -> 0.8 ms for its query). What is left
near or above 100 ms at p99: the inbox's page at 100,000 cards, and the CSV export of a day, whose ~2,700 rows are
what it streams. The facet counts no longer read every open card (issue 30): the counts by channel, risk and workflow
are rows the cards' own writes keep (`approvals.InboxCount`, added by triggers on the cards and their decisions in
the same transaction, folded every 30 s), and the SLA states, which move with the clock, are read from each
channel's `due_at` range, at most 1,001 cards a state (past that the inbox says `1000+`). The counts partial is
flat (p99 under 100 ms at 100,000 cards); what is left on the page is the SLA query's up to 9,009 index entries and
the page's rows, on 2 cores shared with the bench's own process. The next lever is a lower cap
(`approvals.inbox.SLA_COUNT_CAP`). The card itself stays flat (p99 under 100 ms at 100,000 cards).""",
}


def _fmt(v) -> str:
    return "–" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def _results(sections, bench):
    return [(s, r) for s in sections for r in s["results"] if r.get("bench") == bench]


def _repetitions(sections) -> list[str]:
    """The header's paragraph on repetitions: how far the engine's ratio to plain Procrastinate moved between the
    rounds of this run's sections measured in rounds (tracing, peers)."""
    spreads = []
    for _s, r in _results(sections, "tracing_cost"):
        plain = [x["steps_per_s"] for x in r["results"] if x["variant"] == "plain"]
        off = [x["steps_per_s"] for x in r["results"] if x["variant"] == "off"]
        spreads.append(("tracing", [e / p for e, p in zip(off, plain, strict=True)]))
    for _s, r in _results(sections, "peers"):
        spreads.append(("peers", r["round_ratios"]["plain"]))
    spreads = [(name, ratios) for name, ratios in spreads if len(ratios) > 1]
    if not spreads:
        return []
    moved = "; ".join(
        f"{min(ratios):.2f}-{max(ratios):.2f} over the {len(ratios)} rounds of the {name} section"
        for name, ratios in spreads
    )
    text = (
        "**Repetitions.** On this shared 2-core machine a figure moves between runs minutes apart, ratios to a"
        " same-run baseline included: the engine's steps/s over plain Procrastinate's, measured in alternated"
        f" rounds of this run, went {moved}. So the sections measured in rounds (tracing, peers) give the median of"
        " their rounds with the spread of the rounds beside it; a figure of a section measured once is one sample, and"
        " a difference smaller than that spread is not a finding."
    )
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > 115:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line, ""]


def _resume(sections):
    found = []
    for s in sections:
        if s["section"] == "resume":
            shipped = re.search(
                r"with the latch \(shipped\)\s+n=(\d+)\s+p50\s+([\d.]+) ms\s+p99\s+([\d.]+) ms\s+max\s+([\d.]+)",
                s["output"],
            )
            if shipped:
                values = dict(zip(("n", "p50", "p99", "max"), map(float, shipped.groups()), strict=True))
                found.append((s["title"], values))
    return found


def render(meta: dict, sections: list[dict]) -> str:
    out = [
        "# Benchmarks",
        "",
        "Written by `make bench` (bench/run_all.py); do not edit by hand, run it again. Every figure comes with a",
        "baseline measured in the same run, on the same machine, and is compared as a ratio against it.",
        "",
        f"Run of {meta['date']} at commit {meta['commit']}: {meta['cores']} cores ({meta['cpu']}),",
        f"{meta['memory_gib']} GiB, Python {meta['python']}; the whole run took {meta['seconds']:.0f} s.",
        f"Load average {meta['load_before']} before, {meta['load_after']} after (2 cores, the benchmark's own",
        "servers, workers and load generator included, and whatever else ran on the machine): absolute figures move",
        "with it; the ratios to the same-run baselines are what to compare.",
        *(
            f"\nSections {', '.join(r['only'])} were re-run on {r['date']} at commit {r['commit']}"
            f" (`BENCH_ONLY={','.join(r['only'])} make bench`, load average {r['load_before']} before,"
            f" {r['load_after']} after) and replace those of the full run; each section states its own load."
            for r in meta.get("reruns", [])
        ),
        "",
        *_repetitions(sections),
        "Commands: `make bench` (everything, < 20 min on 2 cores), `make bench-smoke` or `BENCH_SMOKE=1 make bench`",
        "(tiny sizes, writes nothing: CI runs it after `make test`), `BENCH_ONLY=enqueue make bench` (a subset:",
        "enqueue, throughput, tracing, peers, webhook, longpoll, resume, console, recovery), `BENCH_SCALE=0.1 make",
        "bench` (smaller cards, audit log, memory runs and waiting agents). Each section names its own script; each",
        "runs alone too. The peers section (bench/peers.py) installs DBOS and LangGraph into a virtualenv of its own",
        "(.bench-peers-venv) the first time; `make bench-smoke` leaves it out.",
        "",
        "## Goals",
        "",
        "| goal | figure | met |",
        "|---|---|---|",
    ]
    for _s, r in _results(sections, "enqueue"):
        db = r["database"]
        p99, floor_ratio, ratio = r.get("goal_p99_16_ms"), r.get("goal_floor_ratio_16"), r.get("goal_ratio_16")
        if floor_ratio is not None:
            out.append(
                f"| enqueue ({db}): `POST /api/runs` >= 0.35 of the HTTP floor's req/s at 16 connections |"
                f" {_fmt(floor_ratio)} | {'yes' if floor_ratio >= 0.35 else 'no'} |"
            )
        out.append(
            f"| enqueue ({db}): `POST /api/runs` p99 < 50 ms at 16 connections | {_fmt(p99)} ms"
            f" (the floor's: {_fmt(r.get('floor_p99_16_ms'))} ms) | {'yes' if p99 and p99 < 50 else 'no'} |"
        )
        out.append(
            f"| enqueue ({db}): `POST /api/runs` against `/bench/insert` at 16 connections (reported) |"
            f" {_fmt(ratio)} | – |"
        )
    for _s, r in _results(sections, "throughput"):
        for w, ratio in r["ratio_steps_per_s"].items():
            goal = 0.6 if int(w) >= 4 else 0.8  # issue 30's
            engine = next(x for x in r["results"] if x["kind"] == "engine" and str(x["workers"]) == str(w))
            plain = next(x for x in r["results"] if x["kind"] == "plain" and str(x["workers"]) == str(w))
            out.append(
                f"| throughput ({r['database']}, {w} worker processes): >= {goal:g} of plain Procrastinate's steps/s |"
                f" {engine['steps_per_s']} / {plain['steps_per_s']} = {ratio:.2f} |"
                f" {'yes' if ratio >= goal else 'no'} |"
            )
            if engine.get("wal_bytes_per_step") and plain.get("wal_bytes_per_step"):
                wal = engine["wal_bytes_per_step"] / plain["wal_bytes_per_step"]
                out.append(
                    f"| throughput ({r['database']}, {w} worker processes): WAL per step <= 1.5x plain's |"
                    f" {engine['wal_bytes_per_step']} / {plain['wal_bytes_per_step']} = {wal:.2f} |"
                    f" {'yes' if wal <= 1.5 else 'no'} |"
                )
            extra = engine["write_xacts_per_step"] - plain["write_xacts_per_step"] + 1
            out.append(
                f"| throughput ({r['database']}, {w} worker processes): 1 write transaction per step |"
                f" {engine['write_xacts_per_step']} per step, baseline {plain['write_xacts_per_step']}"
                f" (engine's own: ~{extra:.2f}) | {'yes' if extra <= 1.05 else 'no'} |"
            )
    for _s, r in _results(sections, "peers"):
        rounds = r["round_ratios"]
        for peer, ratio in r["engine_vs"].items():
            each = ", ".join(f"{x:.2f}" for x in rounds[peer])
            out.append(
                f"| peers: the engine's steps/s >= {r['goal']:g}x {peer}'s ({r['versions'][peer]}), same workload and"
                " run |"
                f" {r['median_steps_per_s']['engine']} / {r['median_steps_per_s'][peer]} = {ratio:.2f}"
                f" (median of {r['rounds']} rounds; each round: {each}) | {'yes' if ratio >= r['goal'] else 'no'} |"
            )
    for title, resume in _resume(sections):
        met = resume["p99"] < 25 and resume["max"] < 100  # issue 21's goal (p50 is shown, not a goal)
        out.append(
            f"| {title}: p99 < 25, max < 100 ms | p50 {resume['p50']:g}, p99 {resume['p99']:g},"
            f" max {resume['max']:g} ms | {'yes' if met else 'no'} |"
        )
    for s in sections:
        if s["section"] == "console":
            blocks = _tables(s["output"])
            if len(blocks) >= 2:
                small, big = blocks[0], blocks[-1]
                worst = max(big.items(), key=lambda kv: kv[1][1])
                same = all(small[name][2] == big[name][2] for name in big if name in small)
                slow = [name for name, (_, p99, _) in big.items() if p99 >= 100]
                out.append(
                    f"| {s['title']}: p99 < 100 ms, query count independent of size | worst p99 {worst[1][1]:g} ms"
                    f" ({worst[0]}); queries {'the same' if same else 'NOT the same'} at both sizes |"
                    f" {'yes' if not slow and same else 'no: ' + ', '.join(slow)} |"
                )
    for _s, r in _results(sections, "longpoll"):
        waiting, base = r["waiting"], r["baseline"]
        met = waiting["p99_ms"] < 100 and r["long_poll_errors"] == 0
        out.append(
            f"| long-poll: the inbox's `GET /api/approvals` p99 < 100 ms with {r['agents']} agents waiting, and no"
            f" long-poll error | p99 {waiting['p99_ms']:g} ms (nobody waiting, same run: {base['p99_ms']:g} ms),"
            f" {r['long_poll_errors']} errors | {'yes' if met else 'no'} |"
        )
    for _s, r in _results(sections, "recovery"):
        bound = r["sweep_s"] + 1  # docs/DESIGN-NOTES.md: sweep period S + poll P (WORKER_POLL_INTERVAL 1 s)
        out.append(
            f"| recovery after SIGKILL < 45 s (bound: sweep {r['sweep_s']:g} s + poll 1 s = {bound:g} s + a claim) |"
            f" {r['seconds']:g} s | {'yes' if r['seconds'] < 45 else 'no'} |"
        )
    for _s, r in _results(sections, "memory"):
        out.append(
            f"| memory: no RSS growth beyond noise | {r['growth_mib']:+g} MiB from {r['baseline_runs']} to"
            f" {max(int(k) for k in r['rss_mib'])} runs | {'yes' if abs(r['growth_mib']) < 10 else 'no'} |"
        )
    out.append("")
    for s in sections:
        out += [f"## {s['title']}", ""]
        out += [
            f"Command: `{s['command']}` ({s['seconds']:.0f} s, load average {s['load'][0]} -> {s['load'][1]}"
            + ("" if s["ok"] else "; **it failed**, see its output")
            + ")."
        ]
        out += [f"Baseline: {s['baseline']}.", ""]
        if s["section"] == "enqueue":
            for r in s["results"]:
                out += _enqueue_table(r)
        if s["section"] == "throughput":
            out += [THROUGHPUT_NOTE, ""]
        if s["section"] == "peers":
            out += [PEERS_NOTE, ""]
        out += ["```", s["output"].strip(), "```", ""]
        last_of_kind = s is [x for x in sections if x["section"] == s["section"]][-1]
        if last_of_kind and s["section"] in BOUNDS:
            out += [BOUNDS[s["section"]], ""]
    enqueue = _results(sections, "enqueue")
    if enqueue:
        r = enqueue[0][1]
        floor16 = next((x for x in r.get("floor", []) if x["connections"] == 16), None)
        runs16 = next((x for x in r["runs"] if x["connections"] == 16), r["runs"][-1])
        single = (r.get("compared") or {}).get("production-single", {}).get("runs", [])
        single16 = next((x for x in single if x["connections"] == 16), None)
        insert16 = next((x for x in r["baseline"] if x["connections"] == 16), None)
        out += [
            "## What bounds the enqueue figure",
            "",
            ENQUEUE_BOUND.format(
                floor_cpu=floor16["server_cpu_ms_per_request"] if floor16 else "?",
                floor_rps=floor16["rps"] if floor16 else "?",
                floor_p99=floor16["p99_ms"] if floor16 else "?",
                runs_cpu=runs16["server_cpu_ms_per_request"],
                runs_rps=runs16["rps"],
                runs_p99=runs16["p99_ms"],
                single_rps=single16["rps"] if single16 else "?",
                single_p99=single16["p99_ms"] if single16 else "?",
                ratio=f"{runs16['rps'] / floor16['rps']:.2f}" if floor16 else "?",
                insert_rps=insert16["rps"] if insert16 else "?",
                insert_ratio=f"{insert16['rps'] / floor16['rps']:.2f}" if floor16 and insert16 else "?",
                load=r["load_before"],
            ),
            "",
        ]
    return "\n".join(out) + "\n"


def _tables(output: str) -> list[dict[str, tuple[float, float, int]]]:
    """The case tables a console bench prints (a `case ... p50 ms p99 ms queries` header, then rows)."""
    blocks: list[dict] = []
    for line in output.splitlines():
        if line.startswith("case "):
            blocks.append({})
        elif blocks and (m := re.match(r"^(\S.*?)\s{2,}([\d.]+)\s+([\d.]+)\s+(\d+)\b", line)):
            blocks[-1][m.group(1).strip()] = (float(m.group(2)), float(m.group(3)), int(m.group(4)))
    return [b for b in blocks if b]


def _enqueue_table(r: dict) -> list[str]:
    rows = [
        f"{r['database']} (PostgreSQL {r['server_version']}), {r['web_workers']} web processes, "
        f"{r['duration_s']:g} s per cell; production server: {r.get('server', '?')}:",
        "",
        "| case | connections | req/s | p50 ms | p99 ms | max ms | web CPU ms/req | wrk CPU ms/req | non-2xx"
        " | req/s vs floor | req/s vs /bench/insert |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    floors = r.get("floor") or [None] * len(r["runs"])
    for floor, base, runs in zip(floors, r["baseline"], r["runs"], strict=True):
        cases = [("floor: bare ASGI app, one INSERT (bench/floor_app.py)", floor)] if floor else []
        cases += [("POST /bench/insert", base), ("POST /api/runs", runs)]
        for label, x in cases:
            vs_floor = f"{x['rps'] / max(floor['rps'], 0.1):.2f}" if floor and x is not floor else ""
            vs_insert = f"{x['rps'] / max(base['rps'], 0.1):.2f}" if x is runs else ""
            rows.append(
                f"| {label} | {x['connections']} | {x['rps']} | {x['p50_ms']} | {x['p99_ms']} | {x['max_ms']} |"
                f" {x['server_cpu_ms_per_request']} | {x['wrk_cpu_ms_per_request']} | {x['non_2xx']} | {vs_floor}"
                f" | {vs_insert} |"
            )
    compared = r.get("compared") or {}
    if compared:
        rows += [
            "",
            "The same app under other servers, measured in the same run (`--compare`):",
            "",
            "| server | case | connections | req/s | p50 ms | p99 ms | web CPU ms/req | req/s vs floor |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, cells in compared.items():
            for case, label in (("baseline", "POST /bench/insert"), ("runs", "POST /api/runs")):
                for floor, x in zip(floors, cells[case], strict=True):
                    vs_floor = f"{x['rps'] / max(floor['rps'], 0.1):.2f}" if floor else ""
                    rows.append(
                        f"| {name} | {label} | {x['connections']} | {x['rps']} | {x['p50_ms']} | {x['p99_ms']} |"
                        f" {x['server_cpu_ms_per_request']} | {vs_floor} |"
                    )
    return [*rows, ""]
