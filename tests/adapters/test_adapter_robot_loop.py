"""The robot control loop: 10 Hz kept while a slow judge scores beside it, a frame per step, stop
on abort."""

from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from PIL import Image

from agent_monitor import Decision, FrameBudget, ProgressTracker
from agent_monitor.adapters.robot_loop import DotWorld, control_loop
from agent_monitor.testing import FakeJudge
from tests.brokers import Mosquitto, input_listener

WAIT = 10.0


def test_dot_world_frames_are_pngs_of_a_dot_moving_to_the_goal() -> None:
    world = DotWorld()
    first = Image.open(io.BytesIO(world.frame()))
    assert first.format == "PNG" and first.size == (64, 48)
    d0 = world.distance
    texts = [world.act() for _ in range(10)]
    assert world.distance < d0 - 10
    assert texts[0].startswith("t=1: move dx=") and "distance" in texts[0]
    assert world.frame() != DotWorld().frame()
    while not world.reached and world.t < 200:
        world.act()
    assert world.reached and world.t < 60
    lost = DotWorld(drift=0.3)
    for _ in range(100):
        lost.act()
    assert not lost.reached


def test_loop_keeps_10_hz_while_a_slow_judge_scores_and_sends_a_frame_per_step() -> None:
    judge = FakeJudge(latency_s=0.35)  # 3.5 ticks per judge call
    budget = FrameBudget(every=8, recent=4)
    tracker = ProgressTracker("Drive the dot to the goal", judge=judge, frame_budget=budget)
    try:
        t0 = time.monotonic()
        result = control_loop(tracker, steps=25, hz=10.0, stop_at_goal=False)
        elapsed = time.monotonic() - t0
        last = tracker.drain()
    finally:
        tracker.close()
        judge.close()
    assert result.steps == 25 and not result.aborted
    assert len(result.periods) == 24
    assert statistics.mean(result.periods) == pytest.approx(0.1, abs=0.01)
    # no tick waited for a score (a call takes 0.35 s)
    assert max(result.periods) < 0.2, result.periods
    assert max(result.send_s) < 0.05 and result.overruns == 0
    assert elapsed == pytest.approx(2.4, abs=0.25)
    # Every step carries its frame; scoring coalesced steps instead of slowing the loop.
    steps = tracker.steps
    assert len(steps) == 25 and all(len(s.frames) == 1 for s in steps)
    assert all(s.meta["distance_to_goal"] > 0 for s in steps)
    assert last is not None and last.step == 25
    assert len(judge.prompts) <= 10  # 2.5 s of loop / 0.35 s per call, not 25 calls
    assert any(p.coalesced > 1 for p in tracker.curve)
    # The frame budget, not the loop, decided which frames the judge saw in the last call.
    anchors, recent = budget.select(25)
    assert (
        judge.prompts[-1].step == 25 and judge.prompts[-1].frames == len(anchors) + len(recent) == 7
    )


def test_loop_stops_on_abort_within_a_tick() -> None:
    judge = FakeJudge(latency_s=0.05)
    decided: list[float] = []

    def on_signal(d: Decision) -> None:
        if d.signal == "abort":
            decided.append(time.monotonic())

    tracker = ProgressTracker(
        "Drive the dot to the goal",
        judge=judge,
        policy={"abort_below": 0.99, "min_steps": 3, "patience": 2},
        on_signal=on_signal,
    )
    stopped_at: list[float] = []
    try:
        result = control_loop(
            tracker, steps=100, hz=10.0, on_tick=lambda k, _t: stopped_at.append(time.monotonic())
        )
    finally:
        tracker.close()
        judge.close()
    assert result.aborted and 4 <= result.steps < 15, result
    # min_steps 3, patience 2
    assert result.abort_signal_step is not None and result.abort_signal_step >= 4
    assert len(decided) == 1
    # at most the tick already under way went out after the abort
    assert stopped_at[-1] - decided[0] < 0.12
    assert len(tracker.steps) == result.steps


# -- the runnable example over MQTT --


class FakeMonitor:
    def __init__(self, port: int, abort_at: int | None) -> None:
        self.steps: list[dict[str, Any]] = []
        self.starts: list[dict[str, Any]] = []
        self.ends: list[dict[str, Any]] = []
        self.abort_at = abort_at
        self.c = input_listener(port, self._on_message, wait_s=WAIT)

    def _on_message(self, c: mqtt.Client, _u: Any, m: mqtt.MQTTMessage) -> None:
        _, run_id, kind = m.topic.split("/")
        body = json.loads(m.payload) if m.payload else {}
        {"start": self.starts, "step": self.steps, "end": self.ends}[kind].append(body)
        if kind == "step" and body["index"] == self.abort_at:
            sig = {
                "run_id": run_id,
                "signal": "abort",
                "reason": "no progress",
                "step": body["index"],
                "score": 0.1,
            }
            c.publish(f"agents/{run_id}/signal", json.dumps(sig), qos=1, retain=True)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def run_example(broker: Mosquitto, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent_monitor.adapters.robot_loop", "--broker", broker.url, *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if not k.startswith("AGENT_MONITOR_")},
        check=False,
    )


def test_example_streams_steps_with_frames_over_mqtt(broker: Mosquitto) -> None:
    fake = FakeMonitor(broker.port, abort_at=None)
    try:
        done = run_example(
            broker, "--steps", "8", "--hz", "20", "--run-id", "robot-a", "--abort-below", "0.1"
        )
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["steps"] == 8 and not summary["aborted"] and summary["outcome"] == "failure"
        assert summary["mean_period_s"] == pytest.approx(0.05, abs=0.01)
        deadline = time.monotonic() + WAIT
        while not fake.ends and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (
            fake.starts[0]["policy"] == {"abort_below": 0.1}
            and fake.starts[0]["criteria"] == "robot"
        )
        assert len(fake.starts[0]["images"]) == 1  # the scene at the start
        assert [s["index"] for s in fake.steps] == list(range(1, 9))
        frames = [s["images"][0] for s in fake.steps]
        assert (
            all(f["mime"] == "image/png" for f in frames) and len({f["data"] for f in frames}) == 8
        )
        assert (
            fake.steps[0]["text"].startswith("t=1: move")
            and "distance_to_goal" in fake.steps[0]["meta"]
        )
        assert fake.ends == [{"outcome": "failure"}]
    finally:
        fake.close()


def test_example_stops_on_a_retained_abort_and_exits_3(broker: Mosquitto) -> None:
    fake = FakeMonitor(broker.port, abort_at=3)
    try:
        done = run_example(
            broker, "--steps", "60", "--hz", "20", "--run-id", "robot-b", "--drift", "0.3"
        )
        assert done.returncode == 3, done.stderr
        summary = json.loads(done.stdout)
        assert (
            summary["aborted"] and summary["abort_signal_step"] == 3 and summary["outcome"] is None
        )
        assert 3 <= summary["steps"] <= 8
        deadline = time.monotonic() + WAIT
        while not fake.ends and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(fake.steps) == summary["steps"] and fake.ends == [{}]
    finally:
        fake.close()
