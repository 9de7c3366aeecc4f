"""Ingest on a real Mosquitto: group commits acked only after COMMIT, redelivery of a batch that
failed, the drop counter."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiomqtt
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.exception import MQTTException
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import Monitor, MonitorConfig, SqliteStore
from agent_monitor.daemon.sinks import Message, Outbox
from agent_monitor.daemon.sources._mqtt import SharedTableProperties, share_property_tables
from agent_monitor.daemon.stores import Record, Stepped
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings
from tests.brokers import Mosquitto, mosquitto

pytestmark = pytest.mark.timeout(120)


class FailingCommit(SqliteStore):
    """A SqliteStore whose next `fail` commits fail (as a full disk or an I/O error would),
    recording what they held."""

    fail = 0

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.failed: list[Record] = []
        self.committed: list[Record] = []

    async def journal_batch(self, records: Sequence[Record]) -> None:
        try:
            await super().journal_batch(records)
        except sqlite3.OperationalError:
            self.failed.extend(records)
            raise
        self.committed.extend(records)

    def _commit(self, db: sqlite3.Connection) -> None:
        if self.fail:
            self.fail -= 1
            raise sqlite3.OperationalError("disk I/O error (injected by the test)")
        super()._commit(db)


async def until(check: Any, wait_s: float = 20.0) -> None:
    """Poll `check` (state with no event to wait on: the run book, the store, a gauge) until
    true, or time out."""
    async with asyncio.timeout(wait_s):
        while True:
            if check():
                return
            await asyncio.sleep(0.02)


async def test_a_batch_that_fails_to_commit_is_not_acked_and_is_applied_once_after_redelivery(
    broker: Mosquitto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (connection number, packet id) of every PUBACK the monitor sent
    acked: list[tuple[int, int]] = []
    ack = mqtt.Client.ack
    config = MonitorConfig(broker=BrokerSettings.from_url(broker.url), client_id="ingest-failing")
    store = FailingCommit(tmp_path / "runs.db")
    async with Monitor(config, judge=FakeJudge(["K"]), store=store) as mon:
        link = mon.link
        assert link is not None

        def record_ack(self: mqtt.Client, mid: int, qos: int) -> Any:
            acked.append((link.connections, mid))
            return ack(self, mid, qos)

        monkeypatch.setattr(mqtt.Client, "ack", record_ack)
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="harness") as h:
            await h.publish("agents/r/start", json.dumps({"task": "t"}).encode(), qos=1)
            await until(lambda: "r" in mon.book.live)
            # Nothing else writes now (the start is not scored), so the next commit is the steps'
            # batch.
            store.fail = 1
            for i in (1, 2, 3):
                await h.publish(
                    "agents/r/step", json.dumps({"index": i, "text": f"step {i}"}).encode(), qos=1
                )
            await until(lambda: store.failed)
            await until(lambda: mon.book.live["r"].steps == 3)
            await until(
                lambda: (
                    (t := mon.tracker("r")) is not None
                    and t.latest is not None
                    and t.latest.step == 3
                )
            )
        failed = [r for r in store.failed if isinstance(r, Stepped)]
        assert failed, "the injected failure hit a batch of steps"
        failed_mids = {r.delivery.mid for r in failed if r.delivery is not None}
        # No PUBACK on the connection whose commit failed: the broker still held them, and resent
        # them.
        assert link.connections >= 2
        assert not {mid for conn, mid in acked if conn == 1} & failed_mids
        assert failed_mids <= {mid for conn, mid in acked if conn >= 2}
    # Applied once: three steps in the state and in the journal, each index once.
    reopened = SqliteStore(tmp_path / "runs.db")
    try:
        replay = await reopened.replay()
    finally:
        await reopened.aclose()
    steps = [r.step.index for r in replay.records if isinstance(r, Stepped)]
    assert steps == [1, 2, 3]
    assert [r.step.index for r in store.committed if isinstance(r, Stepped)] == [1, 2, 3]


async def test_the_brokers_drop_counter_is_exported_when_mosquitto_drops(tmp_path: Path) -> None:
    # A lowered max_queued_messages (10, stock is 1,000) forces drops with a few messages;
    # sys_interval 1 makes Mosquitto publish its $SYS counters every second instead of every 10 s.
    # Both only to make the test quick.
    with mosquitto(tmp_path / "mosquitto", extra=("max_queued_messages 10", "sys_interval 1")) as b:
        # A stalled subscriber: a persistent session (clean_session=False) that went away; the
        # broker queues for it, and past max_queued_messages it drops.
        stalled = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id="stalled",
            protocol=MQTTProtocolVersion.MQTTv311,
            clean_session=False,
        )
        stalled.connect("127.0.0.1", b.port)
        stalled.subscribe("stall/#", qos=1)
        stalled.loop(timeout=1.0)
        stalled.loop(timeout=1.0)
        stalled.disconnect()
        registry = CollectorRegistry()
        config = MonitorConfig(broker=BrokerSettings.from_url(b.url), client_id="ingest-drops")
        async with Monitor(config, judge=FakeJudge(["K"]), registry=registry) as mon:
            assert registry.get_sample_value("agent_monitor_broker_dropped_messages") == 0
            async with aiomqtt.Client("127.0.0.1", b.port, identifier="flood") as h:
                for i in range(50):
                    await h.publish(f"stall/{i}", b"x", qos=1)

            def dropped() -> float:
                return registry.get_sample_value("agent_monitor_broker_dropped_messages") or 0.0

            await until(lambda: dropped() >= 40, wait_s=15)
            assert mon.status()["connected"]


async def test_a_broker_that_refuses_the_drop_counter_does_not_stop_the_monitor(
    tmp_path: Path,
) -> None:
    acl = tmp_path / "acl"
    # The monitor may read and write its topics and nothing else: the $SYS subscription is refused.
    acl.write_text("pattern readwrite agents/#\n")
    with mosquitto(tmp_path / "mosquitto", extra=(f"acl_file {acl}",)) as b:
        registry = CollectorRegistry()
        config = MonitorConfig(broker=BrokerSettings.from_url(b.url), client_id="ingest-acl")
        async with Monitor(config, judge=FakeJudge(["K"]), registry=registry) as mon:
            async with aiomqtt.Client("127.0.0.1", b.port, identifier="harness") as h:
                await h.publish("agents/r/start", json.dumps({"task": "t"}).encode(), qos=1)
                await h.publish(
                    "agents/r/step", json.dumps({"index": 1, "text": "one"}).encode(), qos=1
                )
                await until(lambda: (t := mon.tracker("r")) is not None and t.latest is not None)
            assert registry.get_sample_value("agent_monitor_broker_dropped_messages") == 0


def test_the_outbox_keeps_arrival_order_and_drops_the_oldest_progress_when_full() -> None:
    box = Outbox(4)
    p = [Message(f"agents/r{i}/progress", b"p") for i in range(6)]
    s = [Message(f"agents/r{i}/signal", b"s", droppable=False) for i in range(4)]
    for m in (p[0], s[0], p[1], s[1]):
        box.put(m)
    box.put(p[2])  # full: the oldest progress (p0) makes room
    box.put(s[2])  # full: p1 makes room
    box.put(s[3])  # full: p2 makes room; now only signals wait
    box.put(p[3])  # full, nothing droppable queued: the newcomer is dropped
    assert box.dropped == 4 and len(box) == 4
    # a signal still goes in, over the limit
    box.put(Message("agents/r9/signal", b"s", droppable=False))
    box.requeue(p[4])  # a failed publication goes first
    out = []
    while (m := box.get_nowait()) is not None:
        out.append(m.topic)
    assert out == [p[4].topic, *(m.topic for m in s), "agents/r9/signal"] and box.dropped == 4


def test_paho_properties_with_shared_tables_encode_and_decode_as_paho_s_own() -> None:
    share_property_tables()
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    mine, theirs = SharedTableProperties(PacketTypes.PUBLISH), Properties(PacketTypes.PUBLISH)
    for props in (mine, theirs):
        props.ContentType = "application/json"
        props.UserProperty = [("run", "r1"), ("k", "v")]
        props.MessageExpiryInterval = 60
    packed = mine.pack()
    assert packed == theirs.pack()
    back = SharedTableProperties(PacketTypes.PUBLISH)
    back.unpack(packed)
    assert back.json() == theirs.json()
    with pytest.raises(MQTTException):
        back.SessionExpiryInterval = 1  # not a PUBLISH property: refused as paho refuses it
    assert SharedTableProperties(PacketTypes.PUBACK).json() == {}  # instances do not share values


def _events(seed: int, n: int) -> list[tuple[str, bytes, None]]:
    """A random mix of starts, steps (in and out of order) and ends over a few run ids, as topic
    and payload."""
    import random

    rng = random.Random(seed)
    out: list[tuple[str, bytes, None]] = []
    for _ in range(n):
        run = f"r{rng.randrange(8)}"
        kind = rng.choices(["start", "step", "end"], weights=[3, 6, 1])[0]
        body: dict[str, Any] = {"task": "t"} if kind == "start" else {}
        if kind == "step":
            body = {"index": rng.randrange(1, 5), "text": f"s{rng.randrange(3)}"}
        out.append((f"agents/{run}/{kind}", json.dumps(body).encode(), None))
    return out


class Reports:
    """A sink keeping what the monitor reported, in order (accepted kinds and refusal reasons, by
    run)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None, str]] = []

    def __call__(self, event: Any) -> None:
        from agent_monitor.daemon import Accepted, Refused

        if isinstance(event, Accepted):
            self.seen.append(("accepted", event.run_id, event.kind))
        elif isinstance(event, Refused):
            self.seen.append(("refused", event.run_id, event.reason))


@pytest.mark.parametrize("seed", range(12))
async def test_a_batch_decides_as_one_message_at_a_time_would_evictions_included(seed: int) -> None:
    from agent_monitor.daemon import MemoryStore, RunLimits

    events = _events(seed, 120)
    # max_runs 3 over 8 run ids: most starts evict, and later messages in the same batch name their
    # victims.
    config = MonitorConfig(limits=RunLimits(max_runs=3, hold_s=1000, max_orphan_runs=4))
    outcomes = []
    for batch_size in (1, 7, 120):
        store, reports = MemoryStore(), Reports()
        async with Monitor(
            config, judge=FakeJudge(["K"]), store=store, sinks=[reports], clock=lambda: 1000.0
        ) as mon:
            for k in range(0, len(events), batch_size):
                errors = await mon.handle_batch(events[k : k + batch_size])
                assert errors == [None] * len(errors)
            outcomes.append(
                (
                    mon.book.snapshot(),
                    reports.seen,
                    [(type(r).__name__, r.run_id) for r in store.records],
                )
            )
        # The journal rebuilds the same state.
        async with Monitor(
            config, judge=FakeJudge(["K"]), store=store, clock=lambda: 1000.0
        ) as again:
            assert again.book.snapshot() == outcomes[-1][0]
    one, *batched = outcomes
    for other in batched:
        assert other[0] == one[0]
        # the same reports (refusals may come before earlier acceptances)
        assert sorted(other[1]) == sorted(one[1])
        assert [x for x in other[1] if x[0] == "accepted"] == [
            x for x in one[1] if x[0] == "accepted"
        ]
        assert other[2] == one[2]


async def test_a_batch_of_starts_never_grows_a_group_past_its_limit() -> None:
    # The group's size is state beyond one run: within a batch, each start into a group is decided
    # on the state the starts before it left (committed alone), so a burst cannot overshoot
    # --max-group-runs.
    from agent_monitor.daemon import RunLimits

    registry = CollectorRegistry()
    config = MonitorConfig(limits=RunLimits(max_group_runs=3))
    async with Monitor(config, judge=FakeJudge(), registry=registry) as mon:
        starts = [
            (f"agents/r{i}/start", json.dumps({"task": "t", "group": "g"}).encode(), None)
            for i in range(8)
        ]
        errors = await mon.handle_batch(starts)
        assert errors == [None] * 8  # refusals are handled (and acknowledged), not errors
        assert sorted(mon.groups.groups["g"].members) == ["r0", "r1", "r2"]
        # Issue 48: a start past the group's limit is still a run, scored in no group (it was
        # refused before).
        assert sorted(mon.book.live) == [f"r{i}" for i in range(8)]
        assert sorted(mon.groups.of_run) == ["r0", "r1", "r2"]
        assert registry.get_sample_value("agent_monitor_groups_refused_total") == 5


async def test_a_step_before_its_start_is_said_at_once_not_after_the_hold() -> None:
    import json as _json

    from structlog.testing import capture_logs

    from agent_monitor.daemon import Monitor, MonitorConfig
    from agent_monitor.testing import FakeJudge

    async with Monitor(MonitorConfig(), judge=FakeJudge()) as monitor:
        with capture_logs() as logs:
            await monitor.handle(
                "agents/early/step", _json.dumps({"index": 1, "text": "x"}).encode()
            )
            await monitor.handle(
                "agents/early/step", _json.dumps({"index": 2, "text": "y"}).encode()
            )
        said = [e for e in logs if e["event"] == "step_before_start"]
        assert len(said) == 1 and said[0]["run_id"] == "early" and said[0]["log_level"] == "warning"
        assert "publish the start first" in said[0]["what"] and said[0]["hold_s"] == 10.0
        await monitor.handle("agents/early/start", _json.dumps({"task": "t"}).encode())
        await monitor.drain()
        view = monitor.run("early")
        assert view is not None and len(view.steps) == 2  # both held steps joined the run
