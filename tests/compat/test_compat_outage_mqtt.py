"""Issue 28's defect over MQTT: a score recovered after a judge outage is decided like any other (it
can abort).

Only the daemon's public API: `Monitor`, `MonitorConfig`, a private Mosquitto, a scripted
OpenAI-compatible judge server that is stopped (connection refused) and started again on the same
port.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiomqtt
import pytest

from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.judges.openai import OpenAIJudge
from agent_monitor.policy import Policy
from agent_monitor.wire import BrokerSettings
from tests.brokers import Mosquitto
from tests.openai_server import ScriptedServer, chat_choice, chat_reply
from tests.paths import FIXTURES

pytestmark = pytest.mark.timeout(120)


@contextmanager
def judge_server(port: int = 0, letter: str = "S") -> Iterator[ScriptedServer]:
    s = ScriptedServer(port=port)
    reply = chat_reply(chat_choice([(letter, {letter: 1.0})]))
    # One connection per call: a stopped server then refuses the next call (no kept-alive connection
    # lives on).
    reply.headers["Connection"] = "close"
    s.default = reply
    t = threading.Thread(target=s.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    try:
        yield s
    finally:
        s.httpd.shutdown()
        s.httpd.server_close()


async def until(check: Callable[[], bool], wait_s: float = 30.0) -> None:
    async with asyncio.timeout(wait_s):
        while not check():  # noqa: ASYNC110 - set by the MQTT reader task
            await asyncio.sleep(0.02)


async def test_the_score_recovered_after_an_outage_aborts_over_mqtt(broker: Mosquitto) -> None:
    seen: dict[str, list[dict[str, Any]]] = {"progress": [], "signal": []}

    async def read(client: aiomqtt.Client) -> None:
        async for m in client.messages:
            kind = m.topic.value.rsplit("/", 1)[-1]
            if kind in seen and isinstance(m.payload, bytes | bytearray) and m.payload:
                seen[kind].append(json.loads(m.payload))

    with judge_server(letter="S") as first:  # up: step 1 is doing well (18/19)
        port = first.httpd.server_address[1]
        judge = OpenAIJudge(base_url=first.url, model="m", max_retries=0, timeout_s=2.0)
        config = MonitorConfig(
            broker=BrokerSettings.from_url(broker.url),
            client_id=f"mon-{broker.port}",
            policy=Policy(abort_below=0.2, min_steps=1, patience=1),
            circuit_threshold=1,
            circuit_cooldown_s=0.3,
            max_concurrency=1,
        )
        async with (
            Monitor(config, judge=judge),
            aiomqtt.Client("127.0.0.1", broker.port, identifier="h") as h,
        ):
            for kind in seen:
                await h.subscribe(f"agents/r/{kind}", qos=1)
            reader = asyncio.create_task(read(h))
            try:
                await h.publish("agents/r/start", json.dumps({"task": "fix the bug"}), qos=1)
                await h.publish(
                    "agents/r/step", json.dumps({"index": 1, "text": "ran the tests"}), qos=1
                )
                await until(lambda: any(p["step"] == 1 and p["ok"] for p in seen["progress"]))
                first.httpd.shutdown()
                first.httpd.server_close()  # the judge is down: connection refused
                await h.publish(
                    "agents/r/step",
                    json.dumps({"index": 2, "text": "deleted the test file"}),
                    qos=1,
                )
                await until(lambda: any(p["step"] == 2 and not p["ok"] for p in seen["progress"]))
                assert not seen["signal"] or all(
                    s["signal"] != "abort" for s in seen["signal"]
                )  # an outage never aborts
                with judge_server(port, letter="B"):  # back, and step 2 is hopeless (1/19 < 0.2)
                    await until(lambda: any(p["step"] == 2 and p["ok"] for p in seen["progress"]))
                    await until(lambda: any(s["signal"] == "abort" for s in seen["signal"]))
            finally:
                reader.cancel()
    recovered = next(p for p in seen["progress"] if p["step"] == 2 and p["ok"])
    assert recovered["score"] == pytest.approx(1 / 19)
    abort = next(s for s in seen["signal"] if s["signal"] == "abort")
    assert abort["step"] == 2 and abort["score"] == pytest.approx(1 / 19)


async def test_seed_rubrics_in_a_start_event_are_read_exactly_or_refused_with_the_key(
    broker: Mosquitto,
) -> None:
    """The skill's rubric.json inline in a start is read with its scale; lmms-eval's pipeline
    config is refused."""

    from agent_monitor.testing import FakeJudge

    skill = json.loads((FIXTURES / "skill" / "rubric.json").read_text())
    seen: dict[str, list[dict[str, Any]]] = {"progress": [], "error": []}

    async def read(client: aiomqtt.Client) -> None:
        async for m in client.messages:
            kind = m.topic.value.rsplit("/", 1)[-1]
            if kind in seen and isinstance(m.payload, bytes | bytearray) and m.payload:
                seen[kind].append({"topic": m.topic.value, **json.loads(m.payload)})

    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url), client_id=f"mon-{broker.port}"
    )
    async with (
        Monitor(config, judge=FakeJudge(["A"])),
        aiomqtt.Client("127.0.0.1", broker.port, identifier="h") as h,
    ):
        for kind in seen:
            await h.subscribe(f"agents/+/{kind}", qos=1)
        reader = asyncio.create_task(read(h))
        try:
            await h.publish(
                "agents/skill/start", json.dumps({"task": "t", "criteria": skill}), qos=1
            )
            await h.publish(
                "agents/skill/step", json.dumps({"index": 1, "text": "done, verified"}), qos=1
            )
            lmms = {
                "extractors": [{"type": "strip_reasoning"}],
                "verifier": {"type": "exact_match"},
            }
            await h.publish("agents/lmms/start", json.dumps({"task": "t", "criteria": lmms}), qos=1)
            await until(lambda: bool(seen["progress"]) and bool(seen["error"]))
        finally:
            reader.cancel()
    p = seen["progress"][0]
    # The skill's A is its best: an all-A judge scores 1, on the three criteria named by their ids.
    assert p["topic"] == "agents/skill/progress" and p["score"] == pytest.approx(1.0)
    assert sorted(p["criteria"]) == ["errors", "output", "specification"]
    e = seen["error"][0]
    assert (
        e["topic"] == "agents/lmms/start"
        and "'verifier'" in json.dumps(e)
        and "build_verification_pipeline" in json.dumps(e)
    )
