"""Signed outcomes and group joins cannot be replayed (issue 44, finding 5): each (run id,
started_at) is used once.

An eavesdropper on a real Mosquitto captures a harness's signed start and end (MonitorClient with
the outcome secret) and publishes them again, several times, after the run ended: one calibration
sample, the replays counted, and still one after the monitor restarts on the same journal. A signed
start whose started_at is outside the freshness window teaches nothing either.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor import Policy
from agent_monitor.calibration import outcome_mac
from agent_monitor.daemon import Monitor, MonitorConfig, SqliteStore
from agent_monitor.daemon.runs._groups import GroupBook, GroupRefused, Joiner
from agent_monitor.daemon.runs._replay import Replays
from agent_monitor.groups import group_mac
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings, MonitorClient
from tests.brokers import Mosquitto, input_listener

pytestmark = pytest.mark.timeout(120)

SECRET = "a-long-shared-secret-for-tests"


def _refused(reg: CollectorRegistry, reason: str) -> float:
    return reg.get_sample_value("agent_monitor_outcomes_refused_total", {"reason": reason}) or 0.0


async def _until(check: Any, wait_s: float = 20.0) -> None:
    async with asyncio.timeout(wait_s):
        while not check():  # noqa: ASYNC110 - the monitor's state, set by its own tasks
            await asyncio.sleep(0.05)


def _publish(port: int, messages: list[tuple[str, bytes]]) -> None:
    """Publish raw messages (QoS 1), in order, as any client allowed on the input topics can."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv311)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        for topic, payload in messages:
            client.publish(topic, payload, qos=1).wait_for_publish(10)
            time.sleep(0.3)  # the end after the run's start and step were taken
    finally:
        client.loop_stop()
        client.disconnect()


async def test_a_captured_signed_end_replayed_with_its_start_teaches_one_sample(
    broker: Mosquitto, tmp_path: Path
) -> None:
    captured: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def heard(_c: Any, _u: Any, msg: Any) -> None:
        with lock:
            captured.append((msg.topic, bytes(msg.payload)))

    spy = input_listener(broker.port, heard)
    reg = CollectorRegistry()
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        outcome_secret=SECRET,
        calibration_rate=10_000,
        policy=Policy(min_steps=1, patience=1),
    )

    def harness() -> None:
        with MonitorClient(broker.url, outcome_secret=SECRET) as client:
            run = client.start_run("signed-1", task="fix it", family="signed")
            run.step("did it")
            run.wait_progress(1)
            run.end("success")

    store = SqliteStore(tmp_path / "runs.sqlite3")
    try:
        async with Monitor(config, judge=FakeJudge(["P"]), store=store, registry=reg) as mon:
            await asyncio.to_thread(harness)
            await _until(lambda: len(mon.calibration) == 1)
            with lock:
                start = next(p for t, p in captured if t == "agents/signed-1/start")
                end = next(p for t, p in captured if t == "agents/signed-1/end")
            assert "auth" in json.loads(end)
            step = json.dumps({"index": 1, "text": "did it again"}).encode()
            replay = [
                ("agents/signed-1/start", start),
                ("agents/signed-1/step", step),
                ("agents/signed-1/end", end),
            ]
            for _ in range(3):
                await asyncio.to_thread(_publish, broker.port, replay)
            await _until(lambda: _refused(reg, "replayed") == 3)
            assert len(mon.calibration) == 1  # before: one more sample per replay
    finally:
        await store.aclose()
    # A restart on the same journal remembers the signature is spent.
    reg2 = CollectorRegistry()
    store = SqliteStore(tmp_path / "runs.sqlite3")
    try:
        async with Monitor(config, judge=FakeJudge(["P"]), store=store, registry=reg2) as mon:
            assert len(mon.calibration) == 1
            await asyncio.to_thread(_publish, broker.port, replay)
            await _until(lambda: _refused(reg2, "replayed") == 1)
            assert len(mon.calibration) == 1
    finally:
        await store.aclose()
        spy.loop_stop()
        spy.disconnect()


async def test_a_signed_outcome_outside_the_freshness_window_teaches_nothing() -> None:
    reg = CollectorRegistry()
    config = MonitorConfig(
        outcome_secret=SECRET,
        calibration_rate=10_000,
        signature_max_age_s=3600,
        policy=Policy(min_steps=1, patience=1),
    )
    async with Monitor(config, judge=FakeJudge(["P"]), registry=reg) as mon:
        now = time.time()
        for run_id, started in (("old", now - 7200), ("ahead", now + 3600), ("fresh", now - 60)):
            await mon.handle(
                f"agents/{run_id}/start", json.dumps({"task": "t", "started_at": started}).encode()
            )
            await mon.handle(
                f"agents/{run_id}/step", json.dumps({"index": 1, "text": "x"}).encode()
            )
            await mon.drain()
            auth = outcome_mac(SECRET, run_id, started, "success")
            await mon.handle(
                f"agents/{run_id}/end", json.dumps({"outcome": "success", "auth": auth}).encode()
            )
            await mon.drain()
        assert [s.run_id.split("@")[0] for s in mon.calibration.samples()] == ["fresh"]
        assert _refused(reg, "stale") == 2


def test_the_replay_record_is_bounded_and_never_reopens_a_replay() -> None:
    now = [10_000.0]
    r = Replays(max_age_s=1000, max_entries=3, clock=lambda: now[0])
    for i in range(5):
        assert r.check(f"r{i}", 9_500.0 + i) is None
        r.used(f"r{i}", 9_500.0 + i)
    assert len(r) == 3
    # The forgotten ones are below the floor: stale, never fresh again.
    assert r.check("r0", 9_500.0) == "stale" and r.check("r4", 9_504.0) == "replayed"
    assert r.check("r9", None) == "no_started_at"


def test_a_replayed_or_stale_group_join_is_refused() -> None:
    book = GroupBook(
        max_groups=10,
        max_group_runs=10,
        grace_s=60,
        secret=SECRET,
        replays=Replays(3600, 100, clock=time.time),
    )
    started = time.time()

    def joiner(run_id: str, at: float) -> Joiner:
        return Joiner(
            family="f",
            rubric="r",
            policy=Policy(),
            started_at=at,
            auth=group_mac(SECRET, run_id, at, "g"),
        )

    book._check_joiner("run-1", "g", joiner("run-1", started))
    book.join("run-1", "g", Policy(), started, joiner("run-1", started))
    # the member's own start again (a redelivery): fine
    book._check_joiner("run-1", "g", joiner("run-1", started))
    book.end("run-1", "success", started)
    book.forget("run-1")
    with pytest.raises(GroupRefused, match="replayed"):
        # its captured start, once the run left the group
        book._check_joiner("run-1", "g", joiner("run-1", started))
    with pytest.raises(GroupRefused, match="stale"):
        book._check_joiner("run-2", "g", joiner("run-2", started - 7200))
    # a new run under the same id: a new started_at
    book._check_joiner("run-1", "g", joiner("run-1", started + 1))
