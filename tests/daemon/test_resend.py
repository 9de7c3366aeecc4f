"""Nothing lost end to end, whatever the broker keeps: the monitor asks for a gap again,
MonitorClient re-sends."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from agent_monitor.daemon import Monitor, MonitorConfig, RunLimits
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings, MonitorClient
from tests.brokers import Mosquitto

pytestmark = pytest.mark.timeout(120)


async def test_a_step_the_broker_never_delivered_is_asked_for_again_and_recovered(
    broker: Mosquitto,
) -> None:
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        limits=RunLimits(hold_s=4.0),
    )
    result: dict[str, Any] = {}

    def harness() -> None:
        with MonitorClient(broker.url) as client:
            publish = client._publish
            dropped = threading.Event()

            def lossy(topic: str, payload: dict[str, Any], *, wait: bool) -> None:
                # Fault injection: step 2 is "acknowledged" but reaches no subscriber (as after a
                # broker restart that restored sessions but not $share subscriptions); its re-send
                # goes through.
                if topic.endswith("/step") and payload.get("index") == 2 and not dropped.is_set():
                    dropped.set()
                    return
                publish(topic, payload, wait=wait)

            client._publish = lossy  # type: ignore[method-assign]
            run = client.start_run("r", task="count to three")
            for i in (1, 2, 3):
                run.step(f"step {i}")
            result["progress"] = run.wait_progress(3, timeout=30).step
            result["resent"] = run.resent
            run.end("success")

    async with Monitor(config, judge=FakeJudge()) as mon:
        view: list[str] = []

        def texts() -> None:
            tracker = mon.tracker("r")
            if tracker is not None:  # gone once the run ended
                view[:] = [s.text for s in tracker.steps]

        task = asyncio.create_task(asyncio.to_thread(harness))
        while not task.done():
            texts()
            await asyncio.sleep(0.05)
        await task
    assert result["progress"] == 3 and result["resent"] >= 1
    # before: step 2 a placeholder once the hold ran out
    assert view == ["step 1", "step 2", "step 3"]
