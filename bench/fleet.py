"""A robot fleet on one monitor: N robots publishing 10 Hz steps, each with a 320x240 JPEG, one
vision judge.

The fleet: `--robots` runs (default 100), each publishing one step per tick at `--hz` (default 10)
for `--seconds` (default 20), the step's text an action and a state, with one 320x240 JPEG camera
frame (a moving dot over a textured table, quality 75, about 9 KB; each robot cycles through 20
pre-encoded frames, so the publishers measure publishing, not JPEG encoding). `--publishers`
processes (default 4) publish on a fixed schedule (paho, MQTT 3.1.1, QoS 1), through a private
Mosquitto with stock limits, to a `Monitor` in this process (SQLite run store in a temporary
directory, the default frame budget) whose judge is a scripted vision judge (`FakeJudge`) with a
fixed latency (`--latency`, default 0.25 s) and `--concurrency` calls at once (default 32): steps
that arrive during a call coalesce into the next one.

Figures (the monitor's own clock):
- `updates_per_robot_s`: scored progress messages per robot per second (mean; `min_robot`: the
  slowest robot);
- `gap_p99_s` / `gap_max_s`: the longest wait between two progress messages of one robot (the claim:
  every robot is scored at least once a second);
- `step_to_progress_p50_s` / `_p99_s`: from a step's arrival at the monitor to the progress that
  first covers it;
- `lost`: steps published and never accepted (journaled) by the monitor, plus steps published and
  not covered by the run's last score (`accepted` and `scored up to` are printed beside it);
- `rss_per_robot_kb`: the monitor process's RSS after the fleet, less before it, per robot;
  `rss_second_half_kb`: what the second half of the publishing added, per robot (RSS also holds the
  allocator's free lists and any backlog of unscored messages); `frames_held_per_robot` /
  `frame_kb_held_per_robot`: the frames whose pixels a run still holds at the end (its anchors and
  newest frames: the rest are dropped once scored past);
- `cpu_ms_per_step`: the monitor process's CPU time (all its threads) per step; `cpu_ms_per_frame`:
  the same less the baseline's, per frame;
- `loop_lag_p99_ms`: how late a 50 ms timer on the monitor's event loop fired (frames decoded in
  worker threads keep it small);
- the 1-minute load average at start and end: the machine is shared.

The baseline runs the same fleet in the same process first, with text-only steps (no frame), so the
difference is what the frames cost.

    .venv/bin/python bench/fleet.py [--robots 100] [--hz 10] [--seconds 20] [--latency 0.25]
    [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import itertools
import json
import multiprocessing as mp
import os
import random
import tempfile
import time
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
)

PREFIX = "agents"
TASK = "Pick up the red block from the table and place it in the blue bin."


def run_id(i: int, tag: str) -> str:
    return f"fleet-{tag}-{i:03d}"


def frames(seed: int, n: int = 20) -> list[str]:
    """`n` 320x240 JPEGs (base64, quality 75) of a gripper-like dot moving over a textured table:
    about 9 KB each."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = random.Random(seed)
    # A table with some texture (sensor noise, blurred), lit from one side: a camera frame's size,
    # not noise's.
    noise = Image.frombytes("L", (320, 240), bytes(rng.randrange(256) for _ in range(320 * 240)))
    texture = noise.filter(ImageFilter.GaussianBlur(1.2))
    light = Image.linear_gradient("L").resize((320, 240)).rotate(90)
    table = Image.merge(
        "RGB", (Image.blend(texture, light, 0.7), Image.blend(texture, light, 0.6), light)
    )
    out = []
    for i in range(n):
        img = table.copy()
        draw = ImageDraw.Draw(img)
        draw.rectangle((200, 150, 260, 200), fill=(40, 60, 200))  # the bin
        x, y = 20 + 9 * i, 40 + 6 * i
        # the block in the gripper
        draw.ellipse((x - 10, y - 10, x + 10, y + 10), fill=(220, 30, 30))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=75)
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out


def publisher(
    port: int,
    conn: Connection,
    robots: list[int],
    tag: str,
    hz: float,
    seconds: float,
    images: bool,
) -> None:
    """On command, start its robots, publish their steps on a fixed schedule, end them; report
    what was sent."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    c = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"fleet-{tag}-pub-{robots[0]}",
        protocol=MQTTProtocolVersion.MQTTv311,
    )
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port, keepalive=60)
    c.loop_start()
    pictures = {r: frames(r) for r in robots} if images else {}
    try:
        conn.recv()
        for r in robots:
            c.publish(
                f"{PREFIX}/{run_id(r, tag)}/start", json.dumps({"task": TASK}).encode(), qos=1
            ).wait_for_publish(30)
        ticks = int(seconds * hz)
        begin = time.monotonic()
        late = 0
        infos = []
        for t in range(1, ticks + 1):
            due = begin + (t - 1) / hz
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            elif wait < -1.0 / hz:
                late += 1
            for r in robots:
                body: dict[str, Any] = {
                    "index": t,
                    "text": f"t={t / hz:.1f}s: move gripper dx={0.01 * (t % 7):+.2f} "
                    f"dz={-0.005 * (t % 5):+.3f}; "
                    f"joints [{0.1 * (t % 11):.2f}, {0.05 * (t % 13):.2f}, 1.20, -0.40, 0.00, "
                    "0.30]; gripper open",
                }
                if images:
                    body["images"] = [
                        {"data": pictures[r][t % len(pictures[r])], "mime": "image/jpeg"}
                    ]
                infos.append(
                    c.publish(f"{PREFIX}/{run_id(r, tag)}/step", json.dumps(body).encode(), qos=1)
                )
        for info in infos:
            info.wait_for_publish(120)
        conn.send(("ok", ticks * len(robots), late, time.monotonic() - begin))
        conn.recv()
        for r in robots:
            c.publish(f"{PREFIX}/{run_id(r, tag)}/end", b"{}", qos=1).wait_for_publish(30)
        conn.send("ended")
    finally:
        c.disconnect()
        c.loop_stop()


class Record:
    """A sink: every run's progress times and step latencies, and accepted steps."""

    def __init__(self) -> None:
        from agent_monitor.daemon import Accepted, Scored

        self.events = (Accepted, Scored)
        self.scored: dict[str, list[float]] = {}
        self.last_step: dict[str, int] = {}
        self.latency: list[float] = []
        self.steps = 0
        self._scored = Scored
        self.changed = asyncio.Event()

    def __call__(self, event: Any) -> None:
        if isinstance(event, self._scored):
            if event.progress.ok:
                self.scored.setdefault(event.run_id, []).append(event.at)
                self.last_step[event.run_id] = max(
                    self.last_step.get(event.run_id, 0), event.progress.step
                )
                self.latency.extend(event.at - a for a in event.arrived)
        elif event.kind == "step":
            self.steps += 1
        self.changed.set()


async def _answer(conn: Connection, wait_s: float) -> Any:
    deadline = time.monotonic() + wait_s
    while not await asyncio.to_thread(conn.poll, 0.2):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from a publisher within {wait_s}s")
    return conn.recv()


async def _lag(samples: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t = time.monotonic()
        await asyncio.sleep(0.05)
        samples.append(time.monotonic() - t - 0.05)


async def fleet(
    args: argparse.Namespace, port: int, url: str, tag: str, images: bool
) -> dict[str, Any]:
    from agent_monitor.daemon import Monitor, MonitorConfig, RunLimits, SqliteStore
    from agent_monitor.testing import FakeJudge
    from agent_monitor.wire import BrokerSettings

    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        config = MonitorConfig(
            broker=BrokerSettings.from_url(url),
            client_id=f"fleet-monitor-{tag}",
            max_concurrency=args.concurrency,
            limits=RunLimits(max_runs=max(1000, 2 * args.robots)),
        )
        judge = FakeJudge(["K"], latency_s=args.latency, concurrency=args.concurrency, record=False)
        record = Record()
        ctx = mp.get_context("spawn")
        shares = [list(range(i, args.robots, args.publishers)) for i in range(args.publishers)]
        pipes = [ctx.Pipe() for _ in shares]
        procs = [
            ctx.Process(
                target=publisher,
                args=(port, child, share, tag, args.hz, args.seconds, images),
                daemon=True,
            )
            for (_, child), share in zip(pipes, shares, strict=True)
        ]
        for p in procs:
            p.start()
        lag: list[float] = []
        stop = asyncio.Event()
        try:
            async with Monitor(
                config, judge=judge, store=SqliteStore(Path(tmp) / "runs.db"), sinks=[record]
            ) as mon:
                lagger = asyncio.create_task(_lag(lag, stop))
                rss0 = proc_status_kb()
                cpu0 = time.process_time()
                t0 = time.monotonic()
                for parent, _ in pipes:
                    parent.send("go")
                await asyncio.sleep(args.seconds / 2)
                # halfway: what the second half adds is what a longer episode would
                rss_mid = proc_status_kb()
                sent = [await _answer(parent, args.seconds * 4 + 120) for parent, _ in pipes]
                rss_end_of_publishing = proc_status_kb()
                published = sum(s[1] for s in sent)
                # Wait until the last steps are scored (or a generous while), then measure.
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and (
                    record.steps < published or sum(record.last_step.values()) < published
                ):
                    record.changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(record.changed.wait(), 1.0)
                elapsed = time.monotonic() - t0
                cpu = time.process_time() - cpu0
                rss = proc_status_kb()
                held = [0, 0]  # frames whose pixels the runs still hold, and their bytes
                for r in range(args.robots):
                    t = mon.tracker(run_id(r, tag))
                    for step in t.steps if t is not None else ():
                        for f in step.frames:
                            held[0] += bool(f.data)
                            held[1] += len(f.data)
                for parent, _ in pipes:
                    parent.send("end")
                for parent, _ in pipes:
                    await _answer(parent, 60)
                stop.set()
                await lagger
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.terminate()
    gaps = []
    rates = []
    for times in record.scored.values():
        gaps.extend(b - a for a, b in itertools.pairwise(times))
        rates.append(len(times) / args.seconds)
    lost = max(0, published - record.steps) + max(0, published - sum(record.last_step.values()))
    return {
        "robots": args.robots,
        "frames": images,
        "published": published,
        "late_ticks": sum(s[2] for s in sent),
        "lost": lost,
        "accepted": record.steps,
        "scored_to": sum(record.last_step.values()),
        "updates_per_robot_s": sum(rates) / max(1, len(rates)),
        "min_robot": min(rates, default=0.0),
        "gap_p99_s": percentile(gaps, 99),
        "gap_max_s": max(gaps, default=float("nan")),
        "step_to_progress_p50_s": percentile(record.latency, 50),
        "step_to_progress_p99_s": percentile(record.latency, 99),
        "rss_per_robot_kb": (rss - rss0) / args.robots,
        "rss_second_half_kb": (rss_end_of_publishing - rss_mid) / args.robots,
        "frames_held_per_robot": held[0] / args.robots,
        "frame_kb_held_per_robot": held[1] / 1024 / args.robots,
        "cpu_ms_per_step": 1000 * cpu / max(1, published),
        "cpu_s": cpu,
        "elapsed_s": elapsed,
        "loop_lag_p99_ms": 1000 * percentile(lag, 99),
    }


async def main_async(args: argparse.Namespace) -> None:
    load_start = load1()
    with mosquitto() as broker:
        base = await fleet(args, broker.port, broker.url, "text", images=False)
        full = await fleet(args, broker.port, broker.url, "jpeg", images=True)
    frames_sent = full["published"]
    full["cpu_ms_per_frame"] = 1000 * (full["cpu_s"] - base["cpu_s"]) / max(1, frames_sent)
    for r in (base, full):
        print(
            f"{'with a 320x240 JPEG' if r['frames'] else 'baseline, text only'}: "
            f"{r['robots']} robots x {args.hz:g} Hz x "
            f"{args.seconds:g} s = {r['published']} steps, accepted {r['accepted']}, scored "
            f"up to {r['scored_to']} "
            f"(lost {r['lost']}), late publisher ticks {r['late_ticks']}; "
            f"{r['updates_per_robot_s']:.2f} updates/robot/s (slowest robot "
            f"{r['min_robot']:.2f}), gap between updates "
            f"p99 {r['gap_p99_s']:.2f} s max {r['gap_max_s']:.2f} s; step to progress p50 "
            f"{r['step_to_progress_p50_s']:.3f} s "
            f"p99 {r['step_to_progress_p99_s']:.3f} s; RSS +{r['rss_per_robot_kb']:.0f} KiB/robot "
            f"(+{r['rss_second_half_kb']:.0f} in the second half), frames held "
            f"{r['frames_held_per_robot']:.0f}/robot "
            f"({r['frame_kb_held_per_robot']:.0f} KiB); CPU "
            f"{r['cpu_ms_per_step']:.2f} ms/step; loop lag p99 {r['loop_lag_p99_ms']:.1f} ms"
        )
    print(f"frames: {full['cpu_ms_per_frame']:.2f} ms of monitor CPU per frame over the baseline")
    print(f"load average (1 min): {load_start} at start, {load1()} at end")
    print(
        kv_line(
            robots=args.robots,
            hz=args.hz,
            seconds=args.seconds,
            lost=full["lost"],
            updates_per_robot_s=full["updates_per_robot_s"],
            min_robot=full["min_robot"],
            gap_p99_s=full["gap_p99_s"],
            step_to_progress_p99_s=full["step_to_progress_p99_s"],
            rss_per_robot_kb=full["rss_per_robot_kb"],
            rss_second_half_kb=full["rss_second_half_kb"],
            frames_held_per_robot=full["frames_held_per_robot"],
            frame_kb_held_per_robot=full["frame_kb_held_per_robot"],
            cpu_ms_per_frame=full["cpu_ms_per_frame"],
            loop_lag_p99_ms=full["loop_lag_p99_ms"],
            load1_start=load_start,
            load1_end=load1(),
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--robots", type=int, default=100)
    ap.add_argument("--hz", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument(
        "--latency", type=float, default=0.25, help="the scripted judge's fixed latency per call"
    )
    ap.add_argument("--concurrency", type=int, default=32, help="judge calls at once")
    ap.add_argument("--publishers", type=int, default=4)
    args = ap.parse_args()
    cleanup_on_sigterm()
    configure_logs("error", open(os.devnull, "w"))  # noqa: SIM115 - for the process's life
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
