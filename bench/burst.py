"""Burst behaviour: one run gets 200 steps within one second, the judge takes 200 ms per call.

Through the daemon: `Monitor` (in this process) on a private Mosquitto, the steps published by a
paho client (QoS 1, evenly spread over `--burst-s`), progress read back by a subscriber on
`agents/<run>/progress`. The daemon keeps at most one scoring in flight per run and folds the steps
that arrive meanwhile into the next call (it scores the newest prefix), so the judge is called a
handful of times and the last step's score lands about one judge latency after the burst.

Against: the naive loop, a tracker that awaits `update()` for every step, same judge, same arrival
times (steps queue up in process while it is busy): one call per step, and the last step's score
comes 200 x 200 ms after the first step. Also shown: the in-process hook's `submit()` path
(`AsyncProgressTracker` with its background worker), which coalesces the same way.

    .venv/bin/python bench/burst.py [--steps 200] [--burst-s 1.0] [--latency-s 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from _common import cleanup_on_sigterm, configure_logs, kv_line, load1, mosquitto

from agent_monitor import AsyncProgressTracker
from agent_monitor.testing import FakeJudge

RUN = "burst-1"
TASK = "Drive the robot arm to the red cube and pick it up."


def step_text(i: int) -> str:
    return (
        f"t={i * 0.005:.3f}s action: move_to(x={0.3 + i * 0.001:.3f}, y=0.120, "
        "z=0.050)\nobservation: gripper open"
    )


def slow_judge(latency_s: float) -> FakeJudge:
    """Answers 'K' after a fixed delay; counts calls (BaseJudge.calls)."""
    return FakeJudge(["K"], latency_s=latency_s, concurrency=8, timeout_s=60)


@dataclass
class Result:
    name: str
    calls: int
    last_sent: float
    first_sent: float
    scores: list[tuple[int, int, float]] = field(default_factory=list)  # (step, coalesced, arrival)

    def catchup(self, steps: int) -> float:
        done = [t for step, _c, t in self.scores if step >= steps]
        return min(done) - self.last_sent if done else float("nan")


def publish_burst(port: int, steps: int, burst_s: float, out: dict[str, float]) -> None:
    """Publish the start, then `steps` steps evenly over `burst_s` seconds (runs in a thread)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    c = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id="burst-publisher",
        protocol=MQTTProtocolVersion.MQTTv311,
    )
    c.max_inflight_messages_set(1000)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        c.publish(
            f"agents/{RUN}/start", json.dumps({"task": TASK}).encode(), qos=1
        ).wait_for_publish(10)
        time.sleep(0.3)  # the run is live before its first step
        t0 = time.time()
        out["first"] = t0
        last = None
        for i in range(1, steps + 1):
            ahead = t0 + (i - 1) * burst_s / max(1, steps - 1) - time.time()
            if ahead > 0:
                time.sleep(ahead)
            out["last"] = time.time()
            payload = json.dumps({"index": i, "text": step_text(i), "ts": out["last"]}).encode()
            last = c.publish(f"agents/{RUN}/step", payload, qos=1)
        if last is not None:
            last.wait_for_publish(10)
    finally:
        c.disconnect()
        c.loop_stop()


async def through_monitor(args: argparse.Namespace) -> Result:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    from agent_monitor.daemon import Monitor, MonitorConfig
    from agent_monitor.wire import BrokerSettings

    judge = slow_judge(args.latency_s)
    scores: list[tuple[int, int, float]] = []
    got_last = threading.Event()

    def on_message(_c: Any, _u: Any, msg: Any) -> None:
        t = time.time()
        d = json.loads(msg.payload)
        scores.append((int(d["step"]), int(d.get("coalesced") or 1), t))
        if int(d["step"]) >= args.steps:
            got_last.set()

    with mosquitto() as broker:
        sub = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id="burst-sub",
            protocol=MQTTProtocolVersion.MQTTv311,
        )
        sub.on_message = on_message
        subscribed = threading.Event()
        sub.on_subscribe = lambda *a: subscribed.set()
        sub.connect("127.0.0.1", broker.port)
        sub.loop_start()
        sub.subscribe(f"agents/{RUN}/progress", qos=1)
        try:
            await asyncio.to_thread(subscribed.wait, 10)
            config = MonitorConfig(
                broker=BrokerSettings.from_url(broker.url),
                max_concurrency=8,
                client_id="burst-monitor",
            )
            monitor = Monitor(config, judge=judge)
            sent: dict[str, float] = {}
            async with monitor:
                await asyncio.to_thread(publish_burst, broker.port, args.steps, args.burst_s, sent)
                if not await asyncio.to_thread(got_last.wait, args.steps * args.latency_s + 30):
                    raise TimeoutError("no progress for the last step")
                await asyncio.sleep(0.2)
        finally:
            sub.disconnect()
            sub.loop_stop()
    return Result(
        "monitor (MQTT)",
        judge.calls,
        sent["last"],
        sent["first"],
        sorted(scores, key=lambda s: s[2]),
    )


async def arrivals(
    steps: int, burst_s: float, queue: asyncio.Queue[tuple[int, float]]
) -> tuple[float, float]:
    """Feed steps into `queue` at the burst's times; return (first, last) arrival time."""
    t0 = time.time()
    last = t0
    for i in range(1, steps + 1):
        ahead = t0 + (i - 1) * burst_s / max(1, steps - 1) - time.time()
        if ahead > 0:
            await asyncio.sleep(ahead)
        last = time.time()
        queue.put_nowait((i, last))
    return t0, last


async def naive(args: argparse.Namespace) -> Result:
    """One `await tracker.update(step)` per step, in arrival order."""
    judge = slow_judge(args.latency_s)
    tracker = AsyncProgressTracker(TASK, judge=judge, run_id="naive")
    queue: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
    feeder = asyncio.create_task(arrivals(args.steps, args.burst_s, queue))
    scores: list[tuple[int, int, float]] = []
    for _ in range(args.steps):
        i, _t = await queue.get()
        p = await tracker.update(step_text(i))
        scores.append((p.step, p.coalesced, time.time()))
    first, last = await feeder
    return Result("naive update() per step", judge.calls, last, first, scores)


async def hook_submit(args: argparse.Namespace) -> Result:
    """The in-process hook: `submit()` per step, the tracker's worker coalesces."""
    judge = slow_judge(args.latency_s)
    scores: list[tuple[int, int, float]] = []
    tracker = AsyncProgressTracker(
        TASK,
        judge=judge,
        run_id="submit",
        on_progress=lambda p: scores.append((p.step, p.coalesced, time.time())),
    )
    async with tracker:
        queue: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
        feeder = asyncio.create_task(arrivals(args.steps, args.burst_s, queue))
        for _ in range(args.steps):
            i, _t = await queue.get()
            tracker.submit(step_text(i))
        first, last = await feeder
        await tracker.drain()
    return Result("hook submit()", judge.calls, last, first, scores)


async def main_async(args: argparse.Namespace) -> int:
    configure_logs("warning")
    load0 = load1()
    results = [await through_monitor(args), await hook_submit(args)]
    print(
        f"naive loop: {args.steps} judge calls of {args.latency_s:g} s, "
        f"~{args.steps * args.latency_s:.0f} s ..",
        flush=True,
    )
    results.append(await naive(args))
    mon, sub, nai = results

    print(
        f"\nburst: {args.steps} steps of one run within {args.burst_s:g} s, judge latency "
        f"{args.latency_s * 1000:.0f} ms"
    )
    print("progress messages through the monitor (time from the first step):")
    print(f"{'step':>5} {'covers':>7} {'at s':>6}")
    for step, coalesced, t in mon.scores:
        print(f"{step:>5} {coalesced:>7} {t - mon.first_sent:>6.2f}")
    print()
    print(
        f"{'path':<26} {'judge calls':>11} {'burst s':>8} {'catch-up s':>10} "
        f"{'last score at s':>15}"
    )
    for r in results:
        print(
            f"{r.name:<26} {r.calls:>11} {r.last_sent - r.first_sent:>8.2f} "
            f"{r.catchup(args.steps):>10.2f} "
            f"{r.catchup(args.steps) + r.last_sent - r.first_sent:>15.2f}"
        )
    print(
        "catch-up: from the last step's arrival (publication, for the monitor) to the "
        "score that covers it"
    )
    print(f"machine load (1-min average) at start {load0}, at end {load1()}")
    print(
        kv_line(
            steps=args.steps,
            calls=mon.calls,
            naive_calls=nai.calls,
            catchup_s=mon.catchup(args.steps),
            naive_catchup_s=nai.catchup(args.steps),
            submit_calls=sub.calls,
            submit_catchup_s=sub.catchup(args.steps),
            burst_s=mon.last_sent - mon.first_sent,
            judge_latency_s=args.latency_s,
            path="mqtt",
        )
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=200, help="steps in the burst (default 200)")
    ap.add_argument(
        "--burst-s",
        type=float,
        default=1.0,
        help="the steps are spread evenly over this long (1.0)",
    )
    ap.add_argument(
        "--latency-s", type=float, default=0.2, help="the judge's fixed latency per call (0.2)"
    )
    args = ap.parse_args()
    cleanup_on_sigterm()
    if args.steps < 1 or args.burst_s < 0 or args.latency_s <= 0:
        ap.error("--steps >= 1, --burst-s >= 0 and --latency-s > 0")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
