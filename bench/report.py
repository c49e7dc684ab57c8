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
one pooled connection each), async views (the approval-request long-poll) through Django's ASGI handler. It was
chosen for the long-poll: a client waiting for a decision holds no thread and, between its looks, no database
connection, where gunicorn or granian would hold one of their threads per waiting client for up to a minute; and
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

**What bounds it now: PostgreSQL's NOTIFY, one commit at a time.** In the py-spy profile above, request threads
spend ~70 % of their wall clock waiting for the run's one statement (the run's INSERT with Procrastinate's defer
of its first job), not computing: Procrastinate's insert trigger on `procrastinate_jobs`
(`procrastinate_notify_queue_job_inserted_v1`) calls `pg_notify` for every job, and PostgreSQL serialises the
commits of transactions that notified (a lock held until the commit is durable, its WAL flush included). Measured
on this machine's PostgreSQL 15 with 16 clients (`bench/notify_probe.py`, 2026-12-02, load average 13-15): 4,300-5,900
commits/s for a plain INSERT, 300-510 with a `pg_notify` in the same transaction. The floor and `/bench/insert`
notify nothing; every accepted run does, so `POST /api/runs` stays under a few hundred per second whatever the web
tier costs ({runs_rps} req/s at 16 connections in this run, at {runs_cpu} ms of web CPU per request against the
floor's {floor_cpu} ms and {floor_rps} req/s, load average {load}, other sessions' tests running). The same queue
bounds the p99: wrk keeps 16 requests in flight (a closed loop), so the mean latency is 16 / throughput, and a p99
under 50 ms needs well over 320 req/s; the floor's own p99 in this run was {floor_p99} ms. So 0.5 of the floor is
out of reach while each run's job is announced by its own NOTIFY. The next levers, none taken here (they change
the job queue's contract, not the web tier): defer the first job without the trigger's NOTIFY and wake workers by
one NOTIFY per batch of accepted runs (a short-lived coalescing notifier), or leave workers to their poll
(WORKER_POLL_INTERVAL, which the resume latency goal rules out); after that, the web tier's own next bound is
Django's per-request cost and the token lookup's round trip (docs/PROFILE-api.md)."""

THROUGHPUT_NOTE = """\
Write transactions are transaction ids consumed (cluster-wide: exact on the private embedded server, other
sessions' writes included on the shared PostgreSQL 15); commits are `pg_stat_database.xact_commit` of the bench's
database (read-only transactions included: the workers' fetches and polls); rows are its inserted + updated +
deleted tuples; WAL bytes are cluster-wide. Every figure is per step and includes the job's own share (fetch,
finish: about 0.4 write transactions per step for a 5-step job, as the baseline shows). The engine's floor with
this shape is 1.8 write transactions per step: one per step (its checkpoint, one statement in autocommit), plus
the run's claim and its finish and the job's fetch and finish, four per run."""


BOUNDS = {
    "throughput": """\
**What bounds it now.** Round trips to PostgreSQL, and CPU on a shared 2-core machine. Each step is one statement in
autocommit (`Run.checkpoint`: a data-modifying CTE whose step row is inserted only from the run's owner- and
cursor-checked UPDATE, returning the stored output and `cancel_requested`), as the baseline's step is one INSERT in
its own transaction, and the last step's checkpoint also ends the run (`Run.checkpoint(finish=True)`: succeeded, or
cancelled if a cancel came during the step, with the tenant's lock in the same statement, then the wake-up's count
of the tenant's waiting runs, a statement of its own in the same query string), so a run has no finish of its own.
What the engine adds per run: the run's advisory lock and unlock (runs/ownership.py, session locks held for the
whole job), the claim (one query string of two statements: the row and tenant locks with the run's step rows, which
the engine replays with no read of its own, then the conditional start), the BEGIN and COMMIT of the claim's and of
the last step's transactions, and Django's connection health check (`SELECT 1`, CONN_HEALTH_CHECKS, the baseline's
jobs have it too): 13 round trips and 6 write commits for a 5-step run against the baseline's 16 and 5 (before issue
11's second round: 17 and 7); write transactions per step 1.6 against 1.8 before it. The profile of the round before
(py-spy on one `manage.py worker`, wall clock: job threads 96 % waiting for PostgreSQL, the checkpoints 52 %, the
finish 19 %, the claim 17 %, the lock and unlock 9 %, the checkpoints read 2 %) lost the separate finish and the
checkpoints read; the checkpoints are now the bulk of it, one per step as in the baseline. With `--gil` the GIL was
held 28-30 % of the time (psycopg's client-side quoting of the checkpoint's parameters ~8 % of that), while the
worker process got ~0.5 of a core: on this machine the figure moves with the load more than with anything in the
engine (300 runs x 1 worker on PostgreSQL 15, alternating with the engine before this round in the same minutes:
0.526, 0.464, 0.416, then 0.399, 0.420 against 0.514, 0.321, 0.445, then 0.342, 0.329; 2 workers 0.463 against
0.332; embedded, 1 worker, 0.323 against 0.250). Not done, and the next levers: the advisory lock and unlock folded
into the claim's and the last step's query strings (2 round trips a run; the lock must stay taken before the claim
reads the run), server-side binding for the checkpoint only (Django's `server_side_binding` is global, and the
claim's and the last checkpoint's two-statement query strings need client-side binding; a raw psycopg cursor on the
same connection would do it).""",
    "resume": """\
**Reading.** Latency is the decision's `Decision.created_at` (written just before its commit) to the gate
step's restart (`Step.started_at`, written by the worker). Back to back (each decision once the worker has taken
the previous run again) is where procrastinate 3.10's stock worker can drop a notification and wait for its 5 s
poll (the baseline's max in earlier runs; not every run hits it); the shipped latch (jobs/worker.py) removes that
tail, at the cost of an extra empty fetch at worst. What is left above the goal is
the wake-up and claim path, on a machine shared with other sessions. Split by procrastinate's `started` event
(the fetch; 100 runs back to back, embedded server, 2026-12-01): p50 ~10 ms from the decision to the worker's
fetch (the decision's commit, NOTIFY, the worker's LISTEN and its fetch) and ~9 ms from the fetch to the step
(the job's thread, the connection's health check, the run's advisory lock, the claim in one query string with its
BEGIN and COMMIT: two round trips fewer than before, the start and the step rows now in the claim's query
string). py-spy on the worker in that run shows its event loop idle 84 % of the time and the job threads' share of
the claim path (lock, health check, claim) under 10 % of their time, most of it in the resumed runs' effects: the
path waits (for PostgreSQL and the scheduler of two cores shared with the bench's own 1 kHz poll of the run's
status), it does not compute. The gate's `decided` lookup (card, then its decisions) runs after `Step.started_at`
and is not in the figure.""",
    "console": """\
**Reading.** Query counts are the same with 10 and 100,010 cards (and with an empty and a full audit log). The
runs list pages by keyset (`before`: the last row's created_at and id, no COUNT) and a reviewer's visibility is a
row-by-row probe of each run's cards (`EXISTS ... OFFSET 0`, newest run first: a page stops after its rows); before,
PostgreSQL hashed every card of the reviewer's channels before the first row (243 ms at 100,000 cards, now 0.35
ms: `bench/inbox.py --explain`). The audit page turns a date range into an id range (`at` grows with `id`), so a
range that ended six months ago no longer walks half the primary key (90 ms -> 0.8 ms for its query). What is left
near 100 ms at p99: the inbox's facet counts (one GROUP BY over every open card the reviewer may see, ~30 ms at
100,000 cards on a quiet machine: the only part that grows with the inbox, `bench/inbox.py --explain` shows an
index-only scan of all of them) and the CSV export of a day, whose ~2,700 rows are what it streams.""",
}


def _fmt(v) -> str:
    return "–" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def _results(sections, bench):
    return [(s, r) for s in sections for r in s["results"] if r.get("bench") == bench]


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
        "Commands: `make bench` (everything, < 15 min on 2 cores), `make bench-smoke` or `BENCH_SMOKE=1 make bench`",
        "(tiny sizes, writes nothing: CI runs it after `make test`), `BENCH_ONLY=enqueue make bench` (a subset:",
        "enqueue, throughput, webhook, resume, console, recovery), `BENCH_SCALE=0.1 make bench` (smaller cards,",
        "audit log and memory runs). Each section names its own script; each script runs alone too.",
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
                f"| enqueue ({db}): `POST /api/runs` >= 0.25 of the HTTP floor's req/s at 16 connections |"
                f" {_fmt(floor_ratio)} | {'yes' if floor_ratio >= 0.25 else 'no'} (aim: 0.5) |"
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
            engine = next(x for x in r["results"] if x["kind"] == "engine" and str(x["workers"]) == str(w))
            plain = next(x for x in r["results"] if x["kind"] == "plain" and str(x["workers"]) == str(w))
            out.append(
                f"| throughput ({r['database']}, {w} worker processes): >= 0.5 of plain Procrastinate's steps/s |"
                f" {engine['steps_per_s']} / {plain['steps_per_s']} = {ratio:.2f} | {'yes' if ratio >= 0.5 else 'no'} |"
            )
            extra = engine["write_xacts_per_step"] - plain["write_xacts_per_step"] + 1
            out.append(
                f"| throughput ({r['database']}, {w} worker processes): 1 write transaction per step |"
                f" {engine['write_xacts_per_step']} per step, baseline {plain['write_xacts_per_step']}"
                f" (engine's own: ~{extra:.2f}) | {'yes' if extra <= 1.05 else 'no'} |"
            )
    for title, resume in _resume(sections):
        met = resume["p50"] < 10 and resume["p99"] < 25 and resume["max"] < 100
        out.append(
            f"| {title}: p50 < 10, p99 < 25, max < 100 ms | p50 {resume['p50']:g}, p99 {resume['p99']:g},"
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
        out += ["```", s["output"].strip(), "```", ""]
        last_of_kind = s is [x for x in sections if x["section"] == s["section"]][-1]
        if last_of_kind and s["section"] in BOUNDS:
            out += [BOUNDS[s["section"]], ""]
    enqueue = _results(sections, "enqueue")
    if enqueue:
        r = enqueue[0][1]
        floor16 = next((x for x in r.get("floor", []) if x["connections"] == 16), None)
        runs16 = next((x for x in r["runs"] if x["connections"] == 16), r["runs"][-1])
        out += [
            "## What bounds the enqueue figure",
            "",
            ENQUEUE_BOUND.format(
                floor_cpu=floor16["server_cpu_ms_per_request"] if floor16 else "?",
                floor_rps=floor16["rps"] if floor16 else "?",
                floor_p99=floor16["p99_ms"] if floor16 else "?",
                runs_cpu=runs16["server_cpu_ms_per_request"],
                runs_rps=runs16["rps"],
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
