"""The daemon against a real private Mosquitto: many runs, order, abort/resample, coalescing, bad
input, restarts."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiomqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import BrokerUnavailable, Monitor, MonitorConfig
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings
from tests.brokers import Mosquitto, free_port

pytestmark = pytest.mark.timeout(120)


class Harness:
    """A harness side written with plain aiomqtt: publishes inputs, collects every output by run
    and kind."""

    def __init__(self, client: aiomqtt.Client) -> None:
        self.client = client
        self.seen: dict[tuple[str, str], list[Any]] = defaultdict(list)
        self.retained: dict[tuple[str, str], list[bool]] = defaultdict(list)
        self.changed = asyncio.Event()

    async def publish(
        self, run_id: str, kind: str, payload: Any = None, *, raw: bytes | None = None
    ) -> None:
        data = raw if raw is not None else json.dumps(payload or {}).encode()
        await self.client.publish(f"agents/{run_id}/{kind}", data, qos=1)

    async def collect(self) -> None:
        async for m in self.client.messages:
            parts = m.topic.value.split("/")
            run_id, kind = (parts[1], parts[2]) if len(parts) == 3 else ("_errors", "error")
            body = bytes(m.payload) if isinstance(m.payload, (bytes, bytearray)) else b""
            self.seen[(run_id, kind)].append(json.loads(body) if body else None)
            self.retained[(run_id, kind)].append(m.retain)
            self.changed.set()

    async def until(self, check: Callable[[], bool], wait_s: float = 20.0) -> None:
        async def loop() -> None:
            while not check():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), wait_s)

    def progress(self, run_id: str) -> list[dict[str, Any]]:
        return [p for p in self.seen[(run_id, "progress")] if p]

    def last_step(self, run_id: str) -> int:
        p = self.progress(run_id)
        return p[-1]["step"] if p else 0


@asynccontextmanager
async def harness(port: int, client_id: str = "harness") -> AsyncIterator[Harness]:
    async with aiomqtt.Client(
        "127.0.0.1", port, identifier=client_id, protocol=aiomqtt.ProtocolVersion.V5
    ) as c:
        for kind in ("progress", "signal", "error"):
            await c.subscribe(f"agents/+/{kind}", qos=1)
        await c.subscribe("agents/_errors", qos=1)
        h = Harness(c)
        task = asyncio.create_task(h.collect())
        try:
            yield h
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


def monitor(
    broker: Mosquitto, judge: FakeJudge, registry: CollectorRegistry | None = None, **kw: Any
) -> Monitor:
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url), client_id=f"mon-{broker.port}", **kw
    )
    return Monitor(config, judge=judge, registry=registry)


async def test_many_runs_at_once(broker: Mosquitto) -> None:
    judge = FakeJudge(latency_s=0.005)
    async with monitor(broker, judge, max_concurrency=8) as mon, harness(broker.port) as h:
        assert mon.link is not None and mon.link.negotiated == "5"
        runs = [f"run-{i}" for i in range(60)]
        for r in runs:
            await h.publish(r, "start", {"task": f"task of {r}"})
        for i in range(1, 6):
            await asyncio.gather(
                *(h.publish(r, "step", {"index": i, "text": f"{r} step {i}"}) for r in runs)
            )
        await h.until(lambda: all(h.last_step(r) == 5 for r in runs), wait_s=60)
        for r in runs:
            p = h.progress(r)[-1]
            assert p["run_id"] == r and p["ok"] is True and p["score"] == pytest.approx(5 / 19)
            assert sum(q["coalesced"] for q in h.progress(r)) == 5


async def test_redelivered_and_out_of_order_steps(broker: Mosquitto) -> None:
    judge = FakeJudge()
    async with monitor(broker, judge, max_concurrency=1), harness(broker.port) as h:
        await h.publish("r", "start", {"task": "t"})
        for i in (2, 1, 1, 3, 2):
            await h.publish("r", "step", {"index": i, "text": f"step number {i}"})
        await h.until(lambda: h.last_step("r") == 3)
        await asyncio.sleep(0.2)
        assert h.last_step("r") == 3 and max(p["step"] for p in h.progress("r")) == 3
        text = judge.prompts[-1].prefix_text()
        assert text.count("step number 1") == 1 and text.count("step number 2") == 1
        assert (
            text.index("step number 1") < text.index("step number 2") < text.index("step number 3")
        )


async def test_abort_and_resample_signals_end_to_end(broker: Mosquitto) -> None:
    # "bad" stays at ~5%; "dip" climbs then falls sharply (regression -> resample).
    def answer(p: Any) -> str:
        if "dip task" in p.prefix_text():
            return {1: "H", 2: "L", 3: "C", 4: "C"}[p.step]
        return "B"

    judge = FakeJudge(answer)
    pol = Policy(abort_below=0.2, min_steps=2, patience=2)
    async with monitor(broker, judge, policy=pol), harness(broker.port) as h:
        await h.publish("bad", "start", {"task": "bad task"})
        await h.publish(
            "dip", "start", {"task": "dip task", "policy": {"regression": 0.3, "abort_below": None}}
        )
        for i in range(1, 5):
            await h.publish("bad", "step", {"index": i, "text": f"b{i}"})
            await h.publish("dip", "step", {"index": i, "text": f"d{i}"})
            # "bad" is told to abort at step 3 (min_steps 2, then 2 low scores); abort is final: no
            # more judge calls.
            await h.until(lambda i=i: h.last_step("bad") == min(i, 3) and h.last_step("dip") == i)
        await h.until(lambda: bool(h.seen[("bad", "signal")]) and bool(h.seen[("dip", "signal")]))
        bad = h.seen[("bad", "signal")]
        assert (
            [s["signal"] for s in bad] == ["abort"]
            and bad[0]["step"] == 3
            and bad[0]["score"] < 0.2
        )
        dip = h.seen[("dip", "signal")]
        assert [s["signal"] for s in dip] == ["resample"] and dip[0]["best_step"] == 2

        # A harness that subscribes late still learns the abort: the signal is retained while the
        # run lives.
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="late") as late:
            await late.subscribe("agents/bad/signal", qos=1)
            m = await asyncio.wait_for(anext(aiter(late.messages)), 5)
            assert m.retain and json.loads(bytes(m.payload))["signal"] == "abort"  # type: ignore[arg-type]

        await h.publish("bad", "end", {"outcome": "failure"})
        await h.until(lambda: None in h.seen[("bad", "signal")])  # cleared at end
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="later") as later:
            await later.subscribe("agents/bad/signal", qos=1)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(anext(aiter(later.messages)), 0.5)


async def test_slow_judge_burst_coalesces_to_newest_prefix(broker: Mosquitto) -> None:
    judge = FakeJudge(latency_s=0.2)
    async with monitor(broker, judge, max_concurrency=4), harness(broker.port) as h:
        await h.publish("burst", "start", {"task": "t"})
        await asyncio.gather(
            *(h.publish("burst", "step", {"index": i, "text": f"s{i}"}) for i in range(1, 101))
        )
        await h.until(lambda: h.last_step("burst") == 100)
        progress = h.progress("burst")
        assert len(judge.prompts) <= 8, len(judge.prompts)
        assert len(progress) == len(judge.prompts)
        assert sum(p["coalesced"] for p in progress) == 100
        assert judge.prompts[-1].step == 100


async def test_malformed_payload_reported_and_others_go_on(broker: Mosquitto) -> None:
    reg = CollectorRegistry()
    async with monitor(broker, FakeJudge(), registry=reg), harness(broker.port) as h:
        await h.publish("ok", "start", {"task": "t"})
        await h.publish("broken", "start", raw=b"\xff\xfe not json")
        await h.publish("ok", "step", raw=b'{"index": 1, "text": 5}')
        await h.client.publish("agents/bad id!/step", b"{}", qos=1)  # not a valid run id
        await h.publish("ok", "step", {"index": 1, "text": "fine"})
        await h.until(lambda: h.last_step("ok") == 1 and bool(h.seen[("_errors", "error")]))
        assert h.seen[("_errors", "error")][0]["reason"] == "bad_topic"
        broken = h.seen[("broken", "error")]
        assert broken[0]["reason"] == "bad_json" and broken[0]["topic"] == "agents/broken/start"
        assert (
            h.seen[("ok", "error")][0]["reason"] == "invalid"
            and "text" in h.seen[("ok", "error")][0]["error"]
        )
        assert (
            reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": "bad_json"}) == 1
        )
        assert (
            reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": "bad_topic"}) == 1
        )


@pytest.mark.parametrize("protocol", ["auto", "3.1.1"])
async def test_a_misspelt_topic_is_reported_and_the_monitors_own_outputs_are_not(
    broker: Mosquitto, protocol: str
) -> None:
    reg = CollectorRegistry()
    async with monitor(broker, FakeJudge(), registry=reg, protocol=protocol) as mon:  # type: ignore[arg-type]
        assert mon.link is not None and mon.link.negotiated == (
            "5" if protocol == "auto" else "3.1.1"
        )
        async with harness(broker.port) as h:
            await h.publish("run-3", "start", {"task": "t"})
            await h.publish("run-3", "steps", {"index": 1, "text": "typo"})
            await h.publish("run-3", "step", {"index": 1, "text": "fine"})
            await h.until(lambda: h.last_step("run-3") == 1 and bool(h.seen[("_errors", "error")]))
            await h.publish("run-3", "step", {"index": 2, "text": "fine again"})
            await h.until(lambda: h.last_step("run-3") == 2)
            # time for the monitor's own progress to come back to it on 3.1.1
            await asyncio.sleep(0.3)
            [error] = h.seen[("_errors", "error")]
            assert error["reason"] == "unknown_topic" and error["topic"] == "agents/run-3/steps"
            assert (
                "start, step and end" in error["error"]
                and "publish to agents/run-3/step" in error["error"]
            )
            assert h.seen[("run-3", "error")] == []
        invalid = {
            r: reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": r})
            for r in ("unknown_topic", "bad_topic", "bad_json", "invalid")
        }
        # Its own progress (and retained signal) matched agents/+/+ but was neither reported nor
        # counted.
        assert invalid == {"unknown_topic": 1, "bad_topic": 0, "bad_json": 0, "invalid": 0}


@pytest.mark.parametrize("protocol", ["auto", "3.1.1"])
async def test_a_session_kept_from_an_older_monitor_does_not_deliver_steps_twice(
    broker: Mosquitto, protocol: str
) -> None:
    # Monitors before agents/+/+ subscribed to the three input filters; the broker keeps them in the
    # persistent session, and a step matching two subscriptions of one client is delivered once for
    # each.
    client_id = f"mon-{broker.port}"
    if protocol == "auto":
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 3600
        old = aiomqtt.Client(
            "127.0.0.1",
            broker.port,
            identifier=client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            clean_start=False,
            properties=props,
        )
    else:
        old = aiomqtt.Client(
            "127.0.0.1",
            broker.port,
            identifier=client_id,
            protocol=aiomqtt.ProtocolVersion.V311,
            clean_session=False,
        )
    async with old:
        for kind in ("start", "step", "end"):
            await old.subscribe(f"agents/+/{kind}", qos=1)
    judge = FakeJudge()
    async with monitor(broker, judge, protocol=protocol) as mon, harness(broker.port) as h:  # type: ignore[arg-type]
        await h.publish("up", "start", {"task": "t"})
        for i in range(1, 4):
            # no index: a second copy would be a new step
            await h.publish("up", "step", {"text": f"unindexed {i}"})
            await h.until(lambda i=i: h.last_step("up") == i)
        await asyncio.sleep(0.3)
        view = mon.run("up")
        assert view is not None and [s.text for s in view.steps] == [
            "unindexed 1",
            "unindexed 2",
            "unindexed 3",
        ]


@pytest.mark.parametrize("protocol", ["auto", "3.1.1"])
async def test_broker_restart_mid_run_loses_no_step(broker: Mosquitto, protocol: str) -> None:
    judge = FakeJudge()
    async with monitor(broker, judge, protocol=protocol) as mon:  # type: ignore[arg-type]
        assert mon.link is not None
        async with harness(broker.port) as h:
            await h.publish("r", "start", {"task": "t"})
            for i in range(1, 4):
                await h.publish("r", "step", {"index": i, "text": f"s{i}"})
            await h.until(lambda: h.last_step("r") == 3)
        await asyncio.to_thread(broker.restart)
        # The harness comes back at once; the monitor may still be in its backoff: the broker queues
        # for it.
        async with harness(broker.port, client_id="harness-2") as h2:
            for i in range(4, 8):
                await h2.publish("r", "step", {"index": i, "text": f"s{i}"})
            await h2.until(lambda: h2.last_step("r") == 7, wait_s=60)
        assert mon.link.connections >= 2
        tracker = mon.tracker("r")
        assert tracker is not None and [s.text for s in tracker.steps] == [
            f"s{i}" for i in range(1, 8)
        ]


async def test_steps_published_while_monitor_is_down_are_delivered(broker: Mosquitto) -> None:
    judge = FakeJudge()
    async with monitor(broker, judge):
        pass  # the first connection creates the persistent session and its subscriptions
    async with harness(broker.port) as h:
        await h.publish("r", "start", {"task": "t"})
        for i in range(1, 4):
            await h.publish("r", "step", {"index": i, "text": f"s{i}"})
        async with monitor(broker, judge) as mon:
            await h.until(lambda: h.last_step("r") == 3)
            run = mon.run("r")
            assert run is not None and len(run.steps) == 3


async def test_broker_down_is_one_clear_error() -> None:
    port = free_port()
    mon = Monitor(
        MonitorConfig(broker=BrokerSettings.from_url(f"mqtt://127.0.0.1:{port}")), judge=FakeJudge()
    )
    with pytest.raises(BrokerUnavailable) as e:
        async with mon:
            pass
    assert f"mqtt://127.0.0.1:{port}" in str(e.value) and "\n" not in str(e.value)


async def test_the_compact_progress_form_is_a_line_a_terminal_can_read(broker: Mosquitto) -> None:
    from agent_monitor.daemon import MemoryStore
    from agent_monitor.wire import ProgressOut

    def size(p: dict[str, Any]) -> int:
        return len(json.dumps(p, separators=(",", ":")).encode())

    sizes: dict[str, int] = {}
    for form in ("full", "compact"):
        store = MemoryStore()
        config = MonitorConfig(
            broker=BrokerSettings.from_url(broker.url),
            client_id=f"mon-{form}",
            progress_form=form,  # type: ignore[arg-type]
        )
        judge = FakeJudge(lambda p: {"J": 0.6, "K": 0.3, "A": 0.1})
        async with (
            Monitor(config, judge=judge, store=store),
            harness(broker.port, f"h-{form}") as h,
        ):
            await h.publish(form, "start", {"task": "t"})
            await h.publish(form, "step", {"index": 1, "text": "$ pytest -q\n3 failed, 7 passed"})
            await h.until(lambda form=form: h.last_step(form) == 1)
        p = h.progress(form)[-1]
        sizes[form] = size(p)
        out = ProgressOut.model_validate(p)  # still a progress message any client reads
        assert out.ok and out.step == 1
        letters = out.criteria["task_progress"].letters
        kept = store.progress[form][1]["criteria"]["task_progress"]["letters"]
        assert kept and kept["J"] == pytest.approx(0.6)  # the store keeps the full form either way
        if form == "compact":
            assert letters == {} and "letters" not in json.dumps(p) and "tokens" not in p
            assert p["score"] == round(p["score"], 4) and len(str(p["score"])) <= 6
        else:
            assert letters["J"] == pytest.approx(0.6)
    assert sizes["compact"] < 400 < sizes["full"] / 2, sizes
