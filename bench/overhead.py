"""Monitor overhead: 1,000 concurrent runs through a real Mosquitto, with a judge that answers
instantly.

The daemon (`Monitor`, in this process, logging JSON lines at info level as `agent-monitor serve`
does, to /dev/null) follows 1,000 runs on a private Mosquitto. Steps are published from a separate
process (paho, QoS 1), progress is read by a third process subscribed to `agents/+/progress`, so
neither the publisher's nor the subscriber's CPU counts against the monitor (on 2 cores they still
compete with it for the machine). The judge answers at once, holds nothing, and so the measured time
and memory are the monitor's: decode, ordering, prompt building, scoring, policy, publishing.

Phases, on the same 1,000 runs (each phase waits until every step so far is scored):
  1. starts: 1,000 `start` events.
  2. paced at `--low-rate` (500 steps/s overall, round-robin over the runs), `--paced-steps` per
     run;
  3. paced at `--rate` (2,000 steps/s, the target), `--paced-steps` more per run: step-to-progress
     latency p50/p99 at each load. A step's latency runs from its publication to the arrival of the
     first progress that covers it (a progress covers its step and any folded into it).
  4. flood: `--flood-steps` more per run as fast as the publisher sends them: the steps/s the daemon
     sustains = flood steps / (first flood publication -> last progress), and the monitor's CPU per
     step.
  5. memory: VmRSS with every run live and scored (after gc) minus VmRSS before the starts, per run.
  6. ends: every run ends; RSS again.

The judge, `--judges` (default `http,sdk,fake`: one after the other in this process, each on a
broker of its own): `http` is the real `OpenAIJudge` (its default lean transport) over HTTP to a
scripted OpenAI-compatible server in a process of its own that answers at once (what a user runs:
the judge client's request build, HTTP and reply parsing are the monitor's CPU); `sdk` the same
judge through the `openai` SDK (the path before the lean transport: the baseline); `fake` is an
in-process `FakeJudge` that never renders a prompt or makes a call, the floor of the monitor's own
path. Steps/s counts steps covered by a progress message (coalesced scorings cover several);
scorings/s counts judge calls; the monitor's and the broker's CPU per step are both read from /proc
in the same phase.

    .venv/bin/python bench/overhead.py [--runs 1000] [--rate 2000] [--judges http,fake]
    [--mqtt-protocol 3.1.1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _common import (
    cleanup_on_sigterm,
    configure_logs,
    kv_line,
    load1,
    mosquitto,
    percentile,
    proc_status_kb,
    scripted_judge,
)

PREFIX = "agents"
TASK = (
    "Make the failing test pass in the repository: find the bug in the parser, fix it, "
    "and run the test suite."
)
FILLER = (
    "$ python -m pytest -q tests/test_parser.py\n"
    "F.F...                                                                   [100%]\n"
    "FAILED tests/test_parser.py::test_nested - AssertionError: expected 3 tokens, got 2\n"
)


def run_id(i: int) -> str:
    return f"bench-{i:05d}"


def step_text(run: int, index: int, chars: int) -> str:
    head = f"step {index} of {run_id(run)}\n"
    body = (FILLER * (chars // len(FILLER) + 1))[: max(0, chars - len(head))]
    return head + body


# -- the publisher process
# --------------------------------------------------------------------------------


def publisher(port: int, conn: Connection, runs: int, step_chars: int) -> None:
    """Publish starts, steps (paced or flat out) and ends on command; keep each step's send time
    until asked."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    c = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id="bench-publisher",
        protocol=MQTTProtocolVersion.MQTTv311,
    )
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port, keepalive=60)
    c.loop_start()
    sends: list[tuple[int, int, float]] = []
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] in ("starts", "ends"):
                kind, payload = (
                    ("start", json.dumps({"task": TASK})) if cmd[0] == "starts" else ("end", "{}")
                )
                infos = [
                    c.publish(f"{PREFIX}/{run_id(r)}/{kind}", payload.encode(), qos=1)
                    for r in range(runs)
                ]
                for info in infos:
                    info.wait_for_publish(30)
                conn.send(("ok",))
            elif cmd[0] == "sends":
                conn.send(("ok", sends))
            elif cmd[0] == "steps":
                _, first, count, rate = cmd
                last = None
                t0 = time.time()
                k = 0
                for index in range(first, first + count):
                    for r in range(runs):
                        if rate:
                            ahead = t0 + k / rate - time.time()
                            if ahead > 0.002:
                                time.sleep(ahead)
                        text = step_text(r, index, step_chars)
                        ts = time.time()
                        payload = json.dumps({"index": index, "text": text, "ts": ts}).encode()
                        last = c.publish(f"{PREFIX}/{run_id(r)}/step", payload, qos=1)
                        sends.append((r, index, ts))
                        k += 1
                sent_at = time.time()
                if last is not None:
                    last.wait_for_publish(60)
                conn.send(("ok", k, t0, sent_at))
    finally:
        c.disconnect()
        c.loop_stop()


# -- the subscriber process
# -------------------------------------------------------------------------------


def subscriber(port: int, conn: Connection) -> None:
    """Record (run, step, coalesced, arrival) for every progress message; hand them over on
    command."""
    import threading

    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    records: list[tuple[str, int, int, float]] = []
    lock = threading.Lock()
    subscribed = threading.Event()

    def on_message(_c: Any, _u: Any, msg: Any) -> None:
        t = time.time()
        d = json.loads(msg.payload)
        with lock:
            records.append(
                (msg.topic.split("/")[1], int(d["step"]), int(d.get("coalesced") or 1), t)
            )

    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    # MQTT 5 with a large Receive Maximum, as the monitor connects: a stock Mosquitto sends a 3.1.1
    # client at most 20 unacknowledged QoS 1 messages at a time (max_inflight_messages), which caps
    # what this reader sees of the monitor's progress (about 700 messages/s here) below what the
    # monitor publishes.
    c = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id="bench-subscriber",
        protocol=MQTTProtocolVersion.MQTTv5,
    )
    c.on_message = on_message
    c.on_subscribe = lambda *a: subscribed.set()
    c.on_connect = lambda cl, *a: cl.subscribe(f"{PREFIX}/+/progress", qos=1)
    props = Properties(PacketTypes.CONNECT)
    props.ReceiveMaximum = 65535
    c.connect("127.0.0.1", port, keepalive=60, properties=props)
    c.loop_start()
    subscribed.wait(10)
    conn.send(("ready",))
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "count":
                with lock:
                    conn.send(("ok", len(records)))
            elif cmd[0] == "collect":
                with lock:
                    out, records[:] = list(records), []
                conn.send(("ok", out))
    finally:
        c.disconnect()
        c.loop_stop()


# -- the monitor side
# -------------------------------------------------------------------------------------


def make_judge(
    render: bool, url: str | None = None, concurrency: int = 8, transport: str = "lean"
) -> Any:
    """An instant judge answering 'K': `OpenAIJudge` to the scripted server at `url`, else an
    in-process FakeJudge.

    With `render`, the FakeJudge renders each prompt's text as OpenAIJudge does before sending.
    """
    from agent_monitor.testing import FakeJudge

    if url is not None:
        from agent_monitor import OpenAIJudge

        return OpenAIJudge(url, model="scripted", concurrency=concurrency, transport=transport)  # type: ignore[arg-type]
    if render:
        return FakeJudge(lambda p: "K" if p.text() else "A", concurrency=8, record=False)
    return FakeJudge(["K"], concurrency=8, record=False)


async def ask(conn: Connection, *cmd: Any, wait_s: float = 600.0) -> Any:
    conn.send(cmd)
    return await answer(conn, wait_s, cmd[0])


async def answer(conn: Connection, wait_s: float, what: str) -> Any:
    """The next message from a child process."""
    deadline = time.monotonic() + wait_s
    # Short polls: a cancelled benchmark must not leave a worker thread blocked on the pipe for
    # minutes.
    while not await asyncio.to_thread(conn.poll, 0.2):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer to {what!r} within {wait_s}s")
    return conn.recv()


def scored(monitor: Any, run_id: str) -> int:
    """Steps of a live run covered by its newest score (0 before its first)."""
    t = monitor.tracker(run_id)
    return t.latest.step if t is not None and t.latest is not None else 0


async def wait_scored(monitor: Any, steps: int, wait_s: float) -> float:
    """Wait until every live run has `steps` steps scored and the outbox is empty; return when
    that was seen."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if (
            all(scored(monitor, rid) >= steps for rid in list(monitor.book.live))
            and len(monitor.outbox) == 0
        ):
            return time.time()
        await asyncio.sleep(0.05)
    behind = sum(1 for rid in list(monitor.book.live) if scored(monitor, rid) < steps)
    raise TimeoutError(f"{behind} runs not scored up to step {steps} within {wait_s}s")


def latencies(
    sends: list[tuple[int, int, float]], arrivals: list[tuple[str, int, int, float]]
) -> tuple[list[float], int]:
    """Per step: arrival of the first progress covering it minus its send time; and how many
    steps no progress covered."""
    by_run: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for rid, step, _coalesced, t in arrivals:
        by_run[rid].append((step, t))
    for v in by_run.values():
        v.sort(key=lambda x: x[1])
    out: list[float] = []
    missing = 0
    for r, index, ts in sends:
        covering = [t for step, t in by_run.get(run_id(r), ()) if step >= index]
        if covering:
            out.append(covering[0] - ts)
        else:
            missing += 1
    return out, missing


@dataclass
class Phase:
    name: str
    rate: float  # 0: as fast as the publisher can
    first: int  # step indices first .. first + count - 1 of every run
    count: int
    cpu_s: float = 0.0
    broker_cpu_s: float = 0.0
    calls: int = 0
    published_per_s: float = 0.0
    sends: list[tuple[int, int, float]] = field(default_factory=list)
    arrivals: list[tuple[str, int, int, float]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.sends)

    def lat(self) -> tuple[list[float], int]:
        return latencies(self.sends, self.arrivals)

    def scored_per_s(self) -> float:
        """Steps of the phase / (first publication -> last progress covering one of its steps)."""
        if not self.sends or not self.arrivals:
            return math.nan
        return len(self.sends) / (
            max(t for *_x, t in self.arrivals) - min(t for *_x, t in self.sends)
        )


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench(
    args: argparse.Namespace, judge_url: str | None = None, transport: str = "lean"
) -> dict[str, Any]:
    from agent_monitor.daemon import Monitor, MonitorConfig, RunLimits
    from agent_monitor.wire import BrokerSettings

    configure_logs(args.log_level, args.log_sink)
    ctx = mp.get_context("spawn")
    n = args.paced_steps
    phases = [
        Phase(f"{args.low_rate:g}/s", args.low_rate, 1, n),
        Phase(f"{args.rate:g}/s", args.rate, n + 1, n),
        Phase("flood", 0, 2 * n + 1, args.flood_steps),
    ]
    total = 2 * n + args.flood_steps
    load0 = load1()
    with mosquitto() as broker:
        pub_conn, pub_child = ctx.Pipe()
        sub_conn, sub_child = ctx.Pipe()
        pub = ctx.Process(
            target=publisher, args=(broker.port, pub_child, args.runs, args.step_chars), daemon=True
        )
        sub = ctx.Process(target=subscriber, args=(broker.port, sub_child), daemon=True)
        sub.start()
        pub.start()
        judge = make_judge(args.render, judge_url, args.max_concurrency, transport)
        limits = RunLimits(max_runs=max(10_000, 2 * args.runs), idle_timeout_s=3600)
        config = MonitorConfig(
            broker=BrokerSettings.from_url(broker.url),
            max_concurrency=args.max_concurrency,
            limits=limits,
            client_id="bench-monitor",
            protocol=args.mqtt_protocol,
        )
        monitor = Monitor(config, judge=judge)
        profiler = None
        try:
            assert (await answer(sub_conn, 30, "ready"))[0] == "ready"
            async with monitor:
                await asyncio.sleep(0.5)
                gc.collect()
                rss0 = proc_status_kb("VmRSS")

                t = time.time()
                await ask(pub_conn, "starts")
                while len(monitor.book.live) < args.runs:  # noqa: ASYNC110 - polling the daemon's own state
                    await asyncio.sleep(0.01)
                starts_s = time.time() - t

                for ph in phases:
                    if ph.rate == 0 and args.profile:
                        from pyinstrument import Profiler

                        profiler = Profiler(interval=0.001, async_mode="disabled")
                        profiler.start()
                    cpu0, bcpu0, calls0 = (
                        time.process_time(),
                        cpu_seconds(broker.process.pid),
                        judge.calls,
                    )
                    _, k, t0, sent_at = await ask(pub_conn, "steps", ph.first, ph.count, ph.rate)
                    await wait_scored(monitor, ph.first + ph.count - 1, 600)
                    ph.cpu_s = time.process_time() - cpu0
                    ph.broker_cpu_s = cpu_seconds(broker.process.pid) - bcpu0
                    ph.calls = judge.calls - calls0
                    ph.published_per_s = k / max(1e-9, sent_at - t0)
                    if profiler is not None:
                        profiler.stop()
                    await asyncio.sleep(0.3)

                # Memory with every run live and scored; nothing of the measurements is in this
                # process yet.
                gc.collect()
                rss1 = proc_status_kb("VmRSS")
                hwm = proc_status_kb("VmHWM")
                live = len(monitor.book.live)
                trackers = [
                    t for rid in monitor.book.live if (t := monitor.tracker(rid)) is not None
                ]
                steps_held = sum(len(t.steps) for t in trackers)
                curve_len = sum(len(t.curve) for t in trackers)
                del trackers
                dropped = monitor.outbox.dropped

                await ask(pub_conn, "ends")
                deadline = time.monotonic() + 60
                while monitor.book.live and time.monotonic() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                gc.collect()
                rss2 = proc_status_kb("VmRSS")
                await asyncio.sleep(0.3)
                sends = (await ask(pub_conn, "sends"))[1]
                arrivals = (await ask(sub_conn, "collect"))[1]
        finally:
            for conn in (pub_conn, sub_conn):
                with contextlib.suppress(OSError):
                    conn.send(("stop",))
            for p in (pub, sub):
                p.join(10)
                if p.is_alive():
                    p.terminate()
                    p.join(5)

    for ph in phases:
        last = ph.first + ph.count - 1
        ph.sends = [x for x in sends if ph.first <= x[1] <= last]
        ph.arrivals = [x for x in arrivals if x[1] >= ph.first and x[1] - x[2] + 1 <= last]

    def ms(v: float) -> str:
        return f"{1000 * v:7.1f}"

    kind = (
        f"OpenAIJudge ({transport}) over HTTP to a scripted server"
        if judge_url
        else "in-process FakeJudge"
    )
    print(
        f"\nmonitor overhead ({kind}): {args.runs} runs, instant judge, private Mosquitto, "
        f"MQTT {args.mqtt_protocol}, "
        f"max_concurrency {args.max_concurrency}, {args.step_chars}-character steps"
    )
    print(
        f"{'phase':<8} {'steps':>6} {'published/s':>11} {'scored/s':>8} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'max ms':>7} "
        f"{'calls':>6} {'missed':>6} {'monitor CPU ms/step':>19} {'broker CPU ms/step':>18} "
        f"{'ms/scoring':>10}"
    )
    for ph in phases:
        lat, missing = ph.lat()
        print(
            f"{ph.name:<8} {ph.steps:>6} {ph.published_per_s:>11.0f} "
            f"{ph.scored_per_s():>8.0f} {ms(percentile(lat, 50))} "
            f"{ms(percentile(lat, 99))} {ms(max(lat, default=math.nan))} {ph.calls:>6} "
            f"{missing:>6} "
            f"{1000 * ph.cpu_s / max(1, ph.steps):>19.3f} "
            f"{1000 * ph.broker_cpu_s / max(1, ph.steps):>18.3f} "
            f"{1000 * ph.cpu_s / max(1, ph.calls):>10.3f}"
        )
    low, high, flood = phases
    coalesced = [c for _r, _s, c, _t in flood.arrivals]
    per_run_kb = (rss1 - rss0) / args.runs
    peak_per_run_kb = (hwm - rss0) / args.runs
    cpu_ms = 1000 * flood.cpu_s / max(1, flood.steps)
    # The headline is per scoring: a flood coalesces several steps into one, so CPU per step
    # flatters the monitor.
    per_scoring = 1000 * flood.cpu_s / max(1, flood.calls)
    broker_per_scoring = 1000 * flood.broker_cpu_s / max(1, flood.calls)
    ratio = f"{per_scoring / broker_per_scoring:.0f}x" if broker_per_scoring > 0 else "n/a"
    print(
        f"\nflood: {flood.steps} steps, {flood.calls} scorings, {len(flood.arrivals)} "
        "progress messages (mean "
        f"coalesced {statistics.fmean(coalesced) if coalesced else 0:.2f}), outbox dropped "
        f"{dropped}; the monitor used "
        f"{per_scoring:.3f} ms of CPU per scoring ({ratio} the broker's "
        f"{broker_per_scoring:.3f} ms per scoring), "
        f"i.e. at most ~{1000 / per_scoring:.0f} scorings/s on one core of its own; per step "
        "(coalescing folds "
        f"steps, so this flatters it) {cpu_ms:.3f} ms"
    )
    print(
        f"starts: {args.runs} runs live {starts_s:.2f} s after the first start was published; "
        f"machine load (1-min average) at start {load0}, at end {load1()}"
    )
    print(
        f"memory: VmRSS {rss0 / 1024:.1f} MB before the starts, {rss1 / 1024:.1f} MB with "
        f"{live} runs x {total} steps "
        f"({steps_held} steps, {curve_len} results kept), {rss2 / 1024:.1f} MB after every "
        "run ended; peak "
        f"{hwm / 1024:.1f} MB. Per live run: {per_run_kb:.1f} KB settled, "
        f"{peak_per_run_kb:.1f} KB at the peak "
        f"({total * args.step_chars / 1024:.1f} KB of it is step text)"
    )
    if profiler is not None:
        text = "\n".join(
            [
                "== call tree, share of the flood phase's wall time",
                profiler.output_text(time="percent_of_total"),
                "== functions by self time (flat)",
                profiler.output_text(flat=True, flat_time="self", time="percent_of_total"),
                "== functions by total time (flat)",
                profiler.output_text(flat=True, flat_time="total", time="percent_of_total"),
            ]
        )
        await asyncio.to_thread(Path(args.profile).write_text, text)
        print(
            f"profile of the flood phase written to {args.profile} (the figures above are "
            "with the profiler on)"
        )
    high_lat, high_missing = high.lat()
    low_lat, low_missing = low.lat()
    flood_lat, flood_missing = flood.lat()
    flood_s = (
        max(t for *_x, t in flood.arrivals) - min(t for *_x, t in flood.sends)
        if flood.arrivals
        else math.nan
    )
    figures: dict[str, Any] = {
        "steps_per_s": flood.scored_per_s(),
        "scorings_per_s": flood.calls / flood_s,
        "cpu_ms_per_step": cpu_ms,
        "cpu_ms_per_scoring": 1000 * flood.cpu_s / max(1, flood.calls),
        "broker_cpu_ms_per_step": 1000 * flood.broker_cpu_s / max(1, flood.steps),
        "p99_ms": 1000 * percentile(high_lat, 99),
        "missed": high_missing + low_missing + flood_missing,
    }
    figures["monitor_over_broker"] = figures["cpu_ms_per_step"] / max(
        1e-9, figures["broker_cpu_ms_per_step"]
    )
    print(
        kv_line(
            judge=("http" if transport == "lean" else "sdk") if judge_url else "fake",
            runs=args.runs,
            steps_per_s=round(flood.scored_per_s()),
            scorings_per_s=round(figures["scorings_per_s"]),
            cpu_ms_per_scoring=figures["cpu_ms_per_scoring"],
            monitor_over_broker=figures["monitor_over_broker"],
            p50_ms=1000 * percentile(high_lat, 50),
            p99_ms=1000 * percentile(high_lat, 99),
            rss_per_run_kb=per_run_kb,
            peak_rss_per_run_kb=peak_per_run_kb,
            rate=args.rate,
            low_rate=args.low_rate,
            low_rate_p50_ms=1000 * percentile(low_lat, 50),
            low_rate_p99_ms=1000 * percentile(low_lat, 99),
            flood_published_per_s=round(flood.published_per_s),
            flood_p99_ms=1000 * percentile(flood_lat, 99),
            cpu_ms_per_step=cpu_ms,
            steps_per_run=total,
            step_chars=args.step_chars,
            mqtt=args.mqtt_protocol,
            judge_calls=judge.calls,
            missed=high_missing + low_missing + flood_missing,
            outbox_dropped=dropped,
            gc_threshold=args.gc_threshold,
        )
    )
    return figures


async def bench_all(args: argparse.Namespace) -> int:
    """Each judge of `--judges` in turn, then the figures side by side; non-zero only when a step
    was missed."""
    results: dict[str, dict[str, Any]] = {}
    print(f"load average at start: {load1()}")
    for kind in args.judges:
        if kind in ("http", "sdk"):
            with scripted_judge(0.0) as server:
                results[kind] = await bench(args, server.url, "lean" if kind == "http" else "sdk")
        else:
            results[kind] = await bench(args)
    print(
        f"\n{'judge':<6} {'steps/s':>8} {'scorings/s':>10} {'CPU ms/step':>11} "
        f"{'CPU ms/scoring':>14} "
        f"{'broker ms/step':>14} {'monitor/broker':>14} {'p99 ms':>7}"
    )
    for kind, f in results.items():
        print(
            f"{kind:<6} {f['steps_per_s']:>8.0f} {f['scorings_per_s']:>10.0f} "
            f"{f['cpu_ms_per_step']:>11.3f} "
            f"{f['cpu_ms_per_scoring']:>14.3f} {f['broker_cpu_ms_per_step']:>14.3f} "
            f"{f['monitor_over_broker']:>13.1f}x "
            f"{f['p99_ms']:>7.1f}"
        )
    print(f"load average at end: {load1()}")
    return 1 if any(f["missed"] for f in results.values()) else 0


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
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=1000, help="concurrent runs (default 1000)")
    ap.add_argument(
        "--paced-steps", type=int, default=6, help="steps per run in each paced phase (default 6)"
    )
    ap.add_argument(
        "--low-rate", type=float, default=500, help="first paced phase: steps/s over all runs (500)"
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=2000,
        help="second paced phase: steps/s (default 2000, the target)",
    )
    ap.add_argument(
        "--flood-steps", type=int, default=8, help="steps per run in the flood phase (default 8)"
    )
    ap.add_argument(
        "--step-chars", type=int, default=1000, help="characters of text per step (default 1000)"
    )
    ap.add_argument(
        "--max-concurrency", type=int, default=8, help="the monitor's scorers (default 8)"
    )
    ap.add_argument(
        "--mqtt-protocol",
        choices=["auto", "5", "3.1.1"],
        default="auto",
        help="the monitor's MQTT (default auto: v5)",
    )
    ap.add_argument(
        "--judges",
        type=lambda v: [j.strip() for j in v.split(",") if j.strip()],
        default=["http", "sdk", "fake"],
        help="judges in turn: http (OpenAIJudge, lean transport, to a scripted server), sdk "
        "(the same through the "
        "openai SDK: the path before the lean one), fake (in-process); default http,sdk,fake",
    )
    ap.add_argument(
        "--render",
        action="store_true",
        help="the fake judge renders prompt.text() as OpenAIJudge would",
    )
    ap.add_argument(
        "--log-level", default="info", help="the monitor's log level (default info, as serve)"
    )
    ap.add_argument(
        "--log-file",
        default=os.devnull,
        help="where the monitor's JSON log lines go (default devnull)",
    )
    ap.add_argument(
        "--gc-threshold",
        type=int,
        default=None,
        help="the cyclic collector's first-generation threshold, as serve --gc-threshold "
        "(default: serve's; 0: Python's)",
    )
    ap.add_argument(
        "--profile", metavar="FILE", help="profile the flood phase with pyinstrument, text to FILE"
    )
    args = ap.parse_args()
    args.gc_threshold = tune_collector(args.gc_threshold)
    cleanup_on_sigterm()
    if min(args.runs, args.paced_steps, args.flood_steps) < 1 or min(args.rate, args.low_rate) <= 0:
        ap.error("--runs, --paced-steps, --flood-steps, --rate and --low-rate must be positive")
    if not args.judges or set(args.judges) - {"http", "sdk", "fake"}:
        ap.error("--judges takes http, sdk and fake, comma-separated")
    with open(args.log_file, "a") as args.log_sink:
        return asyncio.run(bench_all(args))


if __name__ == "__main__":
    sys.exit(main())
