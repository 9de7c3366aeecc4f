"""Cluster faults with real replica processes: a paused ("zombie") owner, and a broker restart.

A zombie is a replica that stops (SIGSTOP: a long GC pause, a frozen VM) past its lease while it has
scorings in flight, and then goes on as if nothing happened. The others must take its runs over, and
when it wakes up, nothing it had in flight may reach the harness or the journal: no run's progress
goes backwards, no step is lost or doubled.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from agent_monitor.scale import LETTERS
from agent_monitor.wire import MonitorClient
from tests.brokers import Mosquitto
from tests.openai_server import Reply, chat_choice, chat_reply, scripted_server
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(240)

LEASE = 2.0


def slow_steps_judge(latency_s: float) -> Any:
    def judge(body: dict[str, Any]) -> Reply:
        time.sleep(latency_s)
        n = int(re.search(r"has (\d+) steps? so far", json.dumps(body)).group(1))  # type: ignore[union-attr]
        letter = LETTERS[min(n, 19)]
        return chat_reply(chat_choice([(letter, {letter: 1.0})]))

    return judge


class Watcher:
    """Every progress message, in arrival order, per run (a plain paho subscriber, as a dashboard
    would be)."""

    def __init__(self, port: int) -> None:
        self.progress: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.subscribe("agents/+/progress", qos=1)
        self.client.loop_start()

    def _on_message(self, _c: Any, _u: Any, m: mqtt.MQTTMessage) -> None:
        run = m.topic.split("/")[1]
        with self.lock:
            self.progress.setdefault(run, []).append(int(json.loads(m.payload)["step"]))

    def last(self, run: str) -> int:
        with self.lock:
            return (self.progress.get(run) or [0])[-1]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@contextmanager
def cluster(
    broker: Mosquitto, redis: RedisServer, tmp: Path, names: list[str], latency_s: float
) -> Iterator[Any]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with scripted_server() as judge:
        judge.default = slow_steps_judge(latency_s)

        def start(name: str) -> subprocess.Popen[bytes]:
            log = tmp / f"{name}.log"
            cmd = [
                sys.executable,
                "-m",
                "agent_monitor",
                "serve",
                "--broker",
                broker.url,
                "--cluster",
                redis.url,
                "--cluster-name",
                "f",
                "--replica-id",
                name,
                "--cluster-lease",
                str(LEASE),
                "--cluster-heartbeat",
                "0.5",
                "--judge",
                "openai",
                "--judge-url",
                judge.url,
                "--judge-model",
                "m",
                "--metrics-port",
                "0",
                "--client-id",
                "cl",
            ]
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("ab"))
            deadline = time.monotonic() + 60
            while "agent-monitor: serving" not in log.read_text(errors="replace"):
                assert p.poll() is None and time.monotonic() < deadline, log.read_text(
                    errors="replace"
                )
                time.sleep(0.05)
            procs[name] = p
            return p

        for n in names:
            start(n)
        try:
            yield procs, start
        finally:
            for p in procs.values():
                with_signal(p, signal.SIGCONT)
                with_signal(p, signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()


def with_signal(p: subprocess.Popen[bytes], sig: int) -> None:
    if p.poll() is None:
        os.kill(p.pid, sig)


def assignments(redis: RedisServer) -> dict[str, str]:
    out = subprocess.run(
        ["redis-cli", "-p", str(redis.port), "--no-raw", "hgetall", "am:f:assign"],
        capture_output=True,
        text=True,
    ).stdout.split()
    words = [w.strip('"') for w in out if not w.endswith(")")]
    return dict(zip(words[::2], words[1::2], strict=True))


def export(redis: RedisServer, run: str) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_monitor",
            "export",
            run,
            "--cluster",
            redis.url,
            "--cluster-name",
            "f",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_a_paused_owner_publishes_nothing_stale_when_it_wakes(
    broker: Mosquitto, redis: RedisServer, tmp_path: Path
) -> None:
    runs = [f"z-{i}" for i in range(6)]
    steps = 14
    watcher = Watcher(broker.port)
    try:
        # A slow judge (0.4 s): the zombie has scorings in flight when it is stopped.
        with (
            cluster(broker, redis, tmp_path, ["za", "zb"], latency_s=0.4) as (procs, _),
            MonitorClient(broker.url) as mon,
        ):
            handles = [
                mon.start_run(r, task="Count from one to twelve, one step at a time.") for r in runs
            ]
            for i in range(1, 5):
                for h in handles:
                    h.step(f"said {i}")
                time.sleep(0.3)
            time.sleep(0.2)  # step 4 is being scored
            placed = assignments(redis)
            zombie = placed[runs[0]]
            theirs = [r for r in runs if placed[r] == zombie]
            os.kill(procs[zombie].pid, signal.SIGSTOP)
            stopped = time.monotonic()
            # The harness goes on; the survivor takes the zombie's runs after the lease and scores
            # them.
            for i in range(5, 11):
                for h in handles:
                    h.step(f"said {i}")
                time.sleep(0.4)
            deadline = time.monotonic() + 30
            while any(watcher.last(r) < 10 for r in theirs) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert all(watcher.last(r) == 10 for r in theirs), {r: watcher.last(r) for r in theirs}
            assert time.monotonic() - stopped > LEASE
            survivor = next(n for n in procs if n != zombie)
            assert {assignments(redis)[r] for r in theirs} == {survivor}
            # it wakes up with its old scorings finishing
            os.kill(procs[zombie].pid, signal.SIGCONT)
            time.sleep(2 * LEASE)
            for i in range(11, steps + 1):
                for h in handles:
                    h.step(f"said {i}")
                time.sleep(0.3)
            deadline = time.monotonic() + 30
            while any(watcher.last(r) < steps for r in runs) and time.monotonic() < deadline:
                time.sleep(0.1)
        log = (tmp_path / f"{zombie}.log").read_text(errors="replace")
        # it learnt it had been counted dead, and dropped what it held
        assert "cluster_rejoined" in log
    finally:
        watcher.close()
    for r in runs:
        seen = watcher.progress[r]
        assert seen == sorted(seen), f"{r}'s progress went backwards: {seen}"
        assert seen[-1] == steps
        run = export(redis, r)
        assert [s["index"] for s in run["steps"]] == list(range(1, steps + 1))
        assert [p["step"] for p in run["curve"]] == sorted({p["step"] for p in run["curve"]})


def test_a_broker_restart_loses_nothing(
    broker: Mosquitto, redis: RedisServer, tmp_path: Path
) -> None:
    """Mosquitto with persistence restarts mid-run: the replicas' sessions (and shared
    subscriptions) come back."""
    runs = [f"b-{i}" for i in range(4)]
    with (
        cluster(broker, redis, tmp_path, ["ba", "bb"], latency_s=0.02),
        MonitorClient(broker.url) as mon,
    ):
        handles = [
            mon.start_run(r, task="Count from one to twelve, one step at a time.") for r in runs
        ]
        for i in range(1, 4):
            for h in handles:
                h.step(f"said {i}")
        for h in handles:
            h.wait_progress(3, timeout=30)
        broker.stop()
        time.sleep(1)
        broker.start()
        deadline = time.monotonic() + 30
        while not mon.connected and time.monotonic() < deadline:
            time.sleep(0.1)
        watcher = Watcher(broker.port)
        try:
            for i in range(4, 8):
                for h in handles:
                    h.step(f"said {i}")
            deadline = time.monotonic() + 40
            while any(watcher.last(r) < 7 for r in runs) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            watcher.close()
    assert all(watcher.last(r) == 7 for r in runs), {r: watcher.last(r) for r in runs}
    for r in runs:
        assert [s["index"] for s in export(redis, r)["steps"]] == list(range(1, 8))
