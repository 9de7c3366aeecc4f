"""Issue 48 on a real Mosquitto: a stranger cannot shut a group, a retained message cannot re-run a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import Monitor, MonitorConfig, SqliteStore
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings
from tests.brokers import Mosquitto
from tests.test_daemon_mqtt import Harness, harness

pytestmark = pytest.mark.timeout(120)


def monitor(broker: Mosquitto, judge: FakeJudge, store: SqliteStore, registry: CollectorRegistry, **kw: Any) -> Monitor:
    config = MonitorConfig(broker=BrokerSettings.from_url(broker.url), client_id=f"mon-{broker.port}", **kw)
    return Monitor(config, judge=judge, store=store, registry=registry)


async def publish_retained(h: Harness, run_id: str, kind: str, payload: Any) -> None:
    await h.client.publish(f"agents/{run_id}/{kind}", json.dumps(payload).encode(), qos=1, retain=True)


async def test_retained_start_steps_and_end_survive_a_restart_without_a_judge_call_or_a_second_sample(
    broker: Mosquitto, tmp_path: Path
) -> None:
    judge = FakeJudge(["P"])
    path = tmp_path / "runs.sqlite3"
    policy = Policy(min_steps=1, patience=1)
    store = SqliteStore(path)
    try:
        async with monitor(broker, judge, store, CollectorRegistry(), policy=policy) as mon, harness(broker.port) as h:
            # Live: a retained publish reaches a subscriber already there without the flag, so it is used.
            await publish_retained(h, "r", "start", {"task": "fix the bug", "family": "fix"})
            for i in (1, 2, 3):
                await publish_retained(h, "r", "step", {"index": i, "text": f"step {i}"})
            await h.until(lambda: h.last_step("r") == 3)
            await publish_retained(h, "r", "end", {"outcome": "success"})
            await h.until(lambda: None in h.seen[("r", "signal")])  # cleared when the run closed, after it taught
            assert len(mon.calibration) == 1
            calls = judge.calls_made
            assert calls >= 1 and not h.seen[("r", "error")]
    finally:
        await store.aclose()
    # A restart: the broker sends the retained start, last step and end again on the new subscription.
    store = SqliteStore(path)
    registry = CollectorRegistry()
    try:
        async with monitor(broker, judge, store, registry, policy=policy) as mon, harness(broker.port, "h2") as h:
            await h.until(lambda: bool(h.seen[("r", "error")]))
            (error,) = h.seen[("r", "error")]  # told once, for three retained messages
            assert error["reason"] == "retained" and "retain flag" in error["error"], error
            retained = {k: registry.get_sample_value("agent_monitor_retained_inputs_total", {"kind": k}) for k in
                        ("start", "step", "end")}  # fmt: skip
            assert retained == {"start": 1.0, "step": 1.0, "end": 1.0}
            await mon.drain()
            assert mon.run("r") is None and not h.progress("r")
            assert judge.calls_made == calls  # no judge call
            assert len(mon.calibration) == 1  # no second calibration sample
            assert len(await store.samples()) == 1
            # A run published the ordinary way is still monitored.
            await h.publish("fresh", "start", {"task": "t"})
            await h.publish("fresh", "step", {"index": 1, "text": "x"})
            await h.until(lambda: h.last_step("fresh") == 1)
    finally:
        await store.aclose()
