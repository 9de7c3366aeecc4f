"""Disagreement between repeats (`spread`): in the hook's results, the MQTT progress message and
the per-run gauge."""

from __future__ import annotations

import statistics

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor import AsyncProgressTracker
from agent_monitor.testing import FakeJudge
from tests.brokers import Mosquitto
from tests.daemon.test_daemon_mqtt import harness, monitor

pytestmark = pytest.mark.timeout(120)

# Three repeats that disagree: A = 0, K = 10/19, T = 1. Spread is the standard deviation of the
# repeats' expectations.
REPEATS = ["A", "K", "T"]
SPREAD = statistics.pstdev([0.0, 10 / 19, 1.0])


async def test_hook_reports_the_spread_of_disagreeing_repeats() -> None:
    t = AsyncProgressTracker(
        "task", judge=FakeJudge([REPEATS]), repeats=3, criteria={"goal": "how far"}
    )
    p = await t.update("step one")
    assert p.ok and p.spread == pytest.approx(SPREAD)
    assert p.criteria["goal"].spread == pytest.approx(SPREAD)
    # Repeats that agree have no spread, but keep their own within-answer dispersion.
    t2 = AsyncProgressTracker(
        "task", judge=FakeJudge([["K", "K", "K"]]), repeats=3, criteria={"goal": "how far"}
    )
    assert (await t2.update("step one")).spread == pytest.approx(0.0)


async def test_progress_message_and_gauge_carry_the_spread(broker: Mosquitto) -> None:
    reg = CollectorRegistry()
    # One criterion graded with three disagreeing repeats, the other with three that agree: the
    # run's spread is the weighted mean of the criteria's (weights 0.75 / 0.25 here).
    judge = FakeJudge(lambda prompt: REPEATS if prompt.criterion == "goal_progress" else ["K"])
    criteria = {
        "criteria": [
            {"name": "goal_progress", "description": "how far", "weight": 3},
            {"name": "health", "description": "how healthy", "weight": 1},
        ]
    }
    async with monitor(broker, judge, registry=reg, repeats=3) as mon, harness(broker.port) as h:
        await h.publish("r1", "start", {"task": "t", "criteria": criteria})
        await h.publish("r1", "step", {"index": 1, "text": "did a thing"})
        await h.until(lambda: h.last_step("r1") == 1)
        await mon.drain()
        msg = h.progress("r1")[-1]
        assert msg["ok"] and msg["spread"] == pytest.approx(0.75 * SPREAD)
        assert msg["criteria"]["goal_progress"]["spread"] == pytest.approx(SPREAD)
        assert msg["criteria"]["health"]["spread"] == pytest.approx(0.0)
        assert reg.get_sample_value(
            "agent_monitor_run_spread", {"run_id": "r1", "group": "", "model": ""}
        ) == pytest.approx(0.75 * SPREAD)
