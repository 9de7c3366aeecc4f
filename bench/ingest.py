"""Ingest of a burst on a stock Mosquitto: 10,000 starts, then 10,000 steps, published as fast as
one paho client can.

The broker is started with nothing beyond a listener (and, as root, the user to run as): its stock
limits, `max_inflight_messages 20` and `max_queued_messages 1000` per client, are what a deployment
that did not tune its broker has. Mosquitto drops what a subscriber's session cannot hold after the
publisher got its PUBACK, so a monitor that falls behind loses events silently at the broker.

The monitor (`Monitor` in this process, a SQLite journal in a temporary directory, logs as `serve`
writes them, to /dev/null) follows the runs with an instant judge (`FakeJudge`), so what is measured
is ingest: receive, decode, decide, journal (group commits), apply, acknowledge. `--publishers`
processes (default 2) publish (paho, MQTT 3.1.1, QoS 1, 1,000 in flight each), each a share of the
runs, its starts first and then one step per run: one Python publisher tops out at 2.4-6k messages/s
on a loaded 2-core machine, so with one the bench measures the publisher, not the monitor (the
publishers' rate is printed beside the monitor's; when they are close, the publishers bound it).

Figures: `lost` = events published and not applied (10,000 - live runs, plus 10,000 - steps in the
runs' order, read from the monitor's run state at the end; with `--max-runs` below `--runs`, the
starts not accepted, since steps for evicted runs are refused by design); `events_per_s` = 20,000 /
(first publication -> last event accepted); the publisher's own rate; the broker's drop counter as
the monitor exported it (`agent_monitor_broker_dropped_messages`, read after the broker's next
`$SYS` update, a whole 10 s interval after the last event); the journal's commits and records per
commit. The same bench runs against an agent-monitor without group commits (a baseline checkout
first on PYTHONPATH, run from outside the worktree): then each record is a commit and the drop gauge
is n/a.

With `--cluster`, the monitor is one replica of a cluster (`serve --cluster`) on a private Redis:
every event goes into its run's shared inbox before it is acknowledged, and the run's owner (this
replica) reads it back, decides and journals it in Redis; `commits` then counts the owner's journal
scripts. That is one replica's ingest capacity (docs/cluster.md's capacity table).

    .venv/bin/python bench/ingest.py [--runs 10000] [--step-chars 200] [--mqtt-protocol auto]
    [--cluster] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _common import cleanup_on_sigterm, configure_logs, kv_line, load1, mosquitto

PREFIX = "agents"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = (
    "Make the failing test pass in the repository: find the bug in the parser, fix it, "
    "and run the test suite."
)


def run_id(i: int) -> str:
    return f"ingest-{i:05d}"


def publisher(
    port: int, conn: Connection, runs: int, step_chars: int, index: int = 0, count: int = 1
) -> None:
    """On command, publish its share of the runs' starts, then one step each, flat out; report
    when each was sent."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    c = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"ingest-publisher-{index}",
        protocol=MQTTProtocolVersion.MQTTv311,
    )
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port, keepalive=60)
    c.loop_start()
    try:
        conn.recv()
        start = json.dumps({"task": TASK}).encode()
        text = ("x" * step_chars)[:step_chars]
        t0 = time.time()
        mine = range(index, runs, count)
        infos = [c.publish(f"{PREFIX}/{run_id(r)}/start", start, qos=1) for r in mine]
        t1 = time.time()
        infos += [
            c.publish(
                f"{PREFIX}/{run_id(r)}/step", json.dumps({"index": 1, "text": text}).encode(), qos=1
            )
            for r in mine
        ]
        for info in infos:
            info.wait_for_publish(120)
        conn.send(("ok", t0, t1, time.time()))
        conn.recv()
    finally:
        c.disconnect()
        c.loop_stop()


class Counter:
    """A sink counting accepted events, with the time of the last one."""

    def __init__(self) -> None:
        from agent_monitor.daemon import Accepted

        self.events = (Accepted,)
        self.accepted = 0
        self.starts = 0
        self.last = 0.0

    def __call__(self, event: Any) -> None:
        self.accepted += 1
        self.starts += event.kind == "start"
        self.last = time.time()


async def answer(conn: Connection, wait_s: float) -> Any:
    deadline = time.monotonic() + wait_s
    while not await asyncio.to_thread(conn.poll, 0.2):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from the publisher within {wait_s}s")
    return conn.recv()


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from agent_monitor.daemon import Monitor, MonitorConfig, RunLimits, SqliteStore
    from agent_monitor.testing import FakeJudge
    from agent_monitor.wire import BrokerSettings

    load_start = load1()
    total = 2 * args.runs
    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(mosquitto())
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ingest-"))
        store: Any = None
        commits = [0, 0]
        cluster: dict[str, Any] = {}
        if args.cluster:
            from agent_monitor.daemon import ClusterSettings

            sys.path.insert(0, REPO)  # the private Redis is the tests' own
            from tests.redis_server import redis_server

            redis = stack.enter_context(redis_server(Path(tmp) / "redis"))
            cluster["cluster"] = ClusterSettings(url=redis.url, name="bench", replica_id="r1")
        else:
            store = SqliteStore(Path(tmp) / "runs.db")
        # Counted per commit. Run against an agent-monitor without group commits (a baseline
        # checkout on PYTHONPATH), each `journal` is one commit.
        if store is None:
            pass
        elif hasattr(SqliteStore, "journal_batch"):
            batch = SqliteStore.journal_batch

            async def counted(self: SqliteStore, records: Any) -> None:
                commits[0] += 1
                commits[1] += len(records)
                await batch(self, records)

            store.journal_batch = counted.__get__(store)  # type: ignore[method-assign]
        else:
            one = SqliteStore.journal

            async def counted_one(self: SqliteStore, record: Any) -> None:
                commits[0] += 1
                commits[1] += 1
                await one(self, record)

            store.journal = counted_one.__get__(store)  # type: ignore[method-assign]
        config = MonitorConfig(
            broker=BrokerSettings.from_url(broker.url),
            protocol=args.mqtt_protocol,
            client_id="ingest-monitor",
            max_concurrency=8,
            limits=RunLimits(max_runs=args.max_runs),
            **cluster,
        )
        counter = Counter()
        judge = FakeJudge(["K"], concurrency=8, record=False)
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(args.publishers)]
        procs = [
            ctx.Process(
                target=publisher,
                args=(broker.port, child, args.runs, args.step_chars, i, args.publishers),
                daemon=True,
            )
            for i, (_, child) in enumerate(pipes)
        ]
        for proc in procs:
            proc.start()
        try:
            mon = Monitor(config, judge=judge, store=store, sinks=[counter])
            # the replica's own store (the shared journal in Redis), counted per commit
            if args.cluster:
                journal = mon.store.journal_batch  # type: ignore[attr-defined]

                async def counted_cluster(records: Any) -> None:
                    commits[0] += 1
                    commits[1] += len(records)
                    await journal(records)

                mon.store.journal_batch = counted_cluster  # type: ignore[attr-defined]
            async with mon:
                profiler = None
                if args.profile:
                    import cProfile

                    profiler = cProfile.Profile()
                    profiler.enable()
                cpu0 = time.process_time()
                for parent, _ in pipes:
                    parent.send(("go",))
                sent = [await answer(parent, 300) for parent, _ in pipes]
                t0 = min(x[1] for x in sent)
                t_starts = max(x[2] for x in sent)
                t_sent = max(x[3] for x in sent)
                # Until every event is in, or nothing more arrives for 5 s (what the broker dropped
                # never will).
                seen, quiet = -1, time.monotonic()
                while counter.accepted < total and time.monotonic() - quiet < 5:
                    await asyncio.sleep(0.05)
                    if counter.accepted != seen:
                        seen, quiet = counter.accepted, time.monotonic()
                cpu = time.process_time() - cpu0
                if profiler is not None:
                    profiler.disable()
                    profiler.dump_stats(args.profile)
                if args.max_runs >= args.runs:
                    runs_live = len(mon.book.live)
                    steps = sum(s.steps for s in mon.book.live.values())
                    lost = (args.runs - runs_live) + (args.runs - steps)
                else:
                    # Evictions: most runs are gone, and steps for evicted runs are refused
                    # (run_ended) by design; what must all arrive is the starts.
                    lost = args.runs - counter.starts
                # The broker's drop counter arrives with its next $SYS update (every 10 s by
                # default).
                gauge = getattr(mon.metrics, "broker_dropped", None)
                dropped: float | str = "n/a"  # a baseline without the gauge
                if gauge is not None:
                    # One whole interval after the last event: an update during the burst may be
                    # short of the end.
                    await asyncio.sleep(11)
                    dropped = gauge._value.get()
                await asyncio.wait_for(mon.drain(), 120)
                for parent, _ in pipes:
                    parent.send(("stop",))
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            if store is not None:
                await store.aclose()
    elapsed = counter.last - t0
    return {
        "runs": args.runs,
        "events": total,
        "lost": lost,
        "events_per_s": round(counter.accepted / elapsed) if elapsed > 0 else 0,
        "published_per_s": round(total / (t_sent - t0)),
        "publishers": args.publishers,
        "starts_published_per_s": round(args.runs / (t_starts - t0)),
        "ingest_s": elapsed,
        "monitor_cpu_ms_per_event": 1000 * cpu / max(1, counter.accepted),
        "broker_dropped": dropped if isinstance(dropped, str) else int(dropped),
        "commits": commits[0],
        "records_per_commit": commits[1] / max(1, commits[0]),
        "step_chars": args.step_chars,
        "max_runs": args.max_runs,
        "mqtt": args.mqtt_protocol,
        "broker": "stock",
        "store": "cluster (redis)" if args.cluster else "sqlite",
        "gc_threshold": args.gc_threshold,
        "load_start": load_start,
        "load_end": load1(),
    }


def tune_collector(threshold: int | None) -> int:
    """Tune the garbage collector as `agent-monitor serve --gc-threshold` does (the bench is
    serve's process)."""
    try:
        from agent_monitor.daemon import DEFAULT_GC_THRESHOLD, tune_gc
    except ImportError:  # a baseline checkout from before serve tuned the collector: Python's own
        return gc.get_threshold()[0]
    tune_gc(DEFAULT_GC_THRESHOLD if threshold is None else threshold)
    return gc.get_threshold()[0]


def main() -> int:
    cleanup_on_sigterm()
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=10_000, help="runs: one start and one step each")
    ap.add_argument("--step-chars", type=int, default=200, help="characters of each step's text")
    ap.add_argument("--mqtt-protocol", default="auto", choices=["auto", "5", "3.1.1"])
    ap.add_argument(
        "--max-runs",
        type=int,
        default=10_000,
        help="the monitor's --max-runs (below --runs: evictions)",
    )
    ap.add_argument(
        "--gc-threshold",
        type=int,
        default=None,
        help="the cyclic collector's first-generation threshold, as serve --gc-threshold "
        "(default: serve's; 0: Python's)",
    )
    ap.add_argument(
        "--publishers",
        type=int,
        default=2,
        help="publisher processes, each a share of the runs (2)",
    )
    ap.add_argument(
        "--cluster", action="store_true", help="one replica of a cluster on a private Redis"
    )
    ap.add_argument(
        "--profile", help="write a cProfile of the monitor's process during ingest to this file"
    )
    args = ap.parse_args()
    args.gc_threshold = tune_collector(args.gc_threshold)
    with open(os.devnull, "w") as devnull:
        configure_logs("info", devnull)
        with contextlib.suppress(KeyboardInterrupt):
            out = asyncio.run(bench(args))
            for k, v in out.items():
                print(f"{k}: {v}", file=sys.stderr)
            print(kv_line(**out))
            # figures are for reading; only a lost event fails the bench
            return 1 if out["lost"] else 0
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
