"""One batch of a peer framework on the workload of bench/throughput_workers.py: runs of five no-op durable steps.

Run by bench/peers.py with the python of its own virtualenv (.bench-peers-venv, bench/peers-requirements.txt), never
imported by the console's code (DBOS and LangGraph are not among its dependencies):

    .bench-peers-venv/bin/python bench/peers_runner.py dbos|dbos-queue|langgraph|langgraph-async \\
        --url postgresql://postgres@127.0.0.1:5432/<a fresh database> --runs 1000 --concurrency 4

Peers, each on the fresh database it is given (bench/peers.py creates and drops it):
* dbos: a `@DBOS.workflow` of five `@DBOS.step`s that return at once, `--runs` of them started with
  `DBOS.start_workflow` (DBOS's in-process background execution), on DBOS's executor of `--concurrency` threads
  (max_executor_threads); each step's output is a row of `dbos.operation_outputs`, written before the next step.
* dbos-queue: the same workflow, `--runs` of them enqueued first in one transaction (`DBOSClient.
  enqueue_in_transaction`, as the console's runs are committed before its worker starts on them), then dequeued by
  this process from a DBOS queue with no worker_concurrency limit (DBOS's default), on the same executor.
* langgraph: a `StateGraph` of five nodes that return at once, compiled with `PostgresSaver` (a psycopg pool of
  `--concurrency` connections), `--runs` threads (thread_id) invoked from `--concurrency` Python threads with
  `durability="sync"`: each step's checkpoint is written before the next step starts.
* langgraph-async: the same with LangGraph's default, `durability="async"` (a step's checkpoint is written while the
  next step runs).
Steps/s: the batch's steps over its span: for the queue, from the first workflow's dequeue to the last one's
completion (from the system database's own timestamps, as the console's figure is read from procrastinate_events);
otherwise the wall clock from the first start or invoke to the last result. Checks that every run finished and
counts what was persisted. Prints one `PEER_JSON {...}` line.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

import psycopg

STEPS = 5


def run_dbos(url: str, runs: int, concurrency: int, queued: bool) -> dict:
    import sqlalchemy as sa
    from dbos import DBOS, DBOSClient

    DBOS(
        config={
            "name": "bench-peers",
            "system_database_url": url,
            "max_executor_threads": concurrency,
            "log_level": "WARNING",
        }
    )

    @DBOS.step()
    def nothing(seq: int) -> dict:
        return {}

    @DBOS.workflow()
    def bench_noop5(run: int) -> int:
        for seq in range(STEPS):
            nothing(seq)
        return run

    if queued:
        DBOS.listen_queues(["bench_peers"])
    DBOS.launch()  # creates DBOS's system schema in the fresh database
    try:
        if not queued:
            t0 = time.perf_counter()
            handles = [DBOS.start_workflow(bench_noop5, i) for i in range(runs)]
            results = [h.get_result() for h in handles]
            seconds = time.perf_counter() - t0
            assert sorted(results) == list(range(runs)), "a workflow returned something else"
        else:
            client = DBOSClient(system_database_url=url)
            engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
            with engine.begin() as conn:
                for i in range(runs):
                    client.enqueue_in_transaction(
                        conn, {"workflow_name": bench_noop5.__qualname__, "queue_name": "bench_peers"}, i
                    )
            client.destroy()
            # The queue's worker thread starts within DBOS's queue check (1 s) and dequeues every poll (its default,
            # 1 s): the span below starts at the first dequeue, as the console's starts at the first job's fetch.
            DBOS.register_queue("bench_peers")
            with psycopg.connect(url, autocommit=True) as conn:
                deadline = time.monotonic() + 900
                while True:
                    done, failed = conn.execute(
                        "SELECT count(*) FILTER (WHERE status = 'SUCCESS'), count(*) FILTER (WHERE status = 'ERROR')"
                        " FROM dbos.workflow_status WHERE queue_name = 'bench_peers'"
                    ).fetchone()
                    if done + failed >= runs:
                        break
                    if time.monotonic() > deadline:
                        raise SystemExit(f"timed out: {done} of {runs} DBOS workflows done")
                    time.sleep(0.1)
                assert failed == 0, f"{failed} DBOS workflows failed"
                first, last = conn.execute(
                    "SELECT min(started_at_epoch_ms), max(completed_at) FROM dbos.workflow_status"
                    " WHERE queue_name = 'bench_peers'"
                ).fetchone()
                seconds = (last - first) / 1000
    finally:
        DBOS.destroy(destroy_registry=True)
    with psycopg.connect(url, autocommit=True) as conn:
        step_rows = conn.execute(
            "SELECT count(*) FROM dbos.operation_outputs WHERE function_name LIKE %s", ["%nothing"]
        ).fetchone()[0]
        succeeded = conn.execute("SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'").fetchone()[0]
    assert succeeded == runs, f"{succeeded} of {runs} DBOS workflows succeeded"
    assert step_rows == runs * STEPS, f"{step_rows} step outputs persisted, {runs * STEPS} expected"
    return {
        "framework": "dbos",
        "version": metadata.version("dbos"),
        "seconds": seconds,
        "persisted": f"{step_rows} step outputs (dbos.operation_outputs)",
    }


def run_langgraph(url: str, runs: int, concurrency: int, durability: str) -> dict:
    from typing import TypedDict

    from langgraph.checkpoint.postgres import PostgresSaver
    from langgraph.graph import END, START, StateGraph
    from psycopg.rows import dict_row
    from psycopg_pool import ConnectionPool

    class State(TypedDict):
        done: int

    def nothing(state: State) -> dict:
        return {"done": state["done"] + 1}

    builder = StateGraph(State)
    previous = START
    for seq in range(STEPS):
        builder.add_node(f"nothing_{seq}", nothing)
        builder.add_edge(previous, f"nothing_{seq}")
        previous = f"nothing_{seq}"
    builder.add_edge(previous, END)

    # The connection settings PostgresSaver's documentation gives for a pool: autocommit, no prepared statements
    # (pipeline mode), dict rows.
    with ConnectionPool(
        url,
        min_size=concurrency,
        max_size=concurrency,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
        open=True,
    ) as pool:
        saver = PostgresSaver(pool)
        saver.setup()
        graph = builder.compile(checkpointer=saver)

        def invoke(i: int) -> int:
            state = graph.invoke({"done": 0}, {"configurable": {"thread_id": f"run-{i}"}}, durability=durability)
            return state["done"]

        with ThreadPoolExecutor(concurrency) as pool_of_threads:
            t0 = time.perf_counter()
            results = list(pool_of_threads.map(invoke, range(runs)))
            seconds = time.perf_counter() - t0
    assert results == [STEPS] * runs, "a graph did not run its five steps"
    with psycopg.connect(url, autocommit=True) as conn:
        checkpoints, threads = conn.execute("SELECT count(*), count(DISTINCT thread_id) FROM checkpoints").fetchone()
        writes = conn.execute("SELECT count(*) FROM checkpoint_writes").fetchone()[0]
    assert threads == runs, f"{threads} threads checkpointed, {runs} expected"
    return {
        "framework": "langgraph",
        "version": metadata.version("langgraph"),
        "checkpoint_postgres": metadata.version("langgraph-checkpoint-postgres"),
        "durability": durability,
        "seconds": seconds,
        "persisted": f"{checkpoints} checkpoints ({checkpoints / runs:g} a run), {writes} checkpoint writes",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=("dbos", "dbos-queue", "langgraph", "langgraph-async"))
    parser.add_argument("--url", required=True, help="a fresh database, postgresql://...")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    if args.peer.startswith("dbos"):
        result = run_dbos(args.url, args.runs, args.concurrency, queued=args.peer == "dbos-queue")
    else:
        durability = "async" if args.peer == "langgraph-async" else "sync"
        result = run_langgraph(args.url, args.runs, args.concurrency, durability)
    steps = args.runs * STEPS
    result.update(
        peer=args.peer,
        runs=args.runs,
        steps=steps,
        concurrency=args.concurrency,
        seconds=round(result["seconds"], 2),
        steps_per_s=round(steps / result["seconds"], 1),
        runs_per_s=round(args.runs / result["seconds"], 1),
    )
    print("PEER_JSON " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
