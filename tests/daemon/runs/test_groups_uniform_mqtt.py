"""Groups flagged early through the daemon on a real Mosquitto: the all_fail call on the retained
ranking mid-run."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.calibration import Point, Sample
from agent_monitor.daemon import HttpServer, Monitor, MonitorConfig, RewardApiSettings, RewardSource
from agent_monitor.policy import Policy
from agent_monitor.prompts import Prompt
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings, RankingOut, schemas
from tests.brokers import Mosquitto
from tests.daemon.runs.test_groups_mqtt import _steps, harness
from tests.daemon.sources.reward.test_reward_api import post

pytestmark = pytest.mark.timeout(120)

RANKING_SCHEMA = json.loads(schemas()["ranking.schema.json"])
# The scripted judge: every run of "doomed" does badly (C = 2/19); in "mixed", one run does well
# (P).
LETTERS = {
    "doomed-a": "C",
    "doomed-b": "C",
    "doomed-c": "D",
    "mixed-a": "C",
    "mixed-b": "C",
    "mixed-c": "P",
}
POLICY = Policy(min_steps=1, patience=2, uniform_confidence=0.8)


def by_run(p: Prompt) -> str:
    text = p.prefix_text()
    return next(letter for run, letter in LETTERS.items() if f"task of {run}" in text)


def _flat(run: str, score: float, n: int = 4) -> tuple[Point, ...]:
    return tuple(Point(i + 1, score, 0.0) for i in range(n))


async def test_a_group_of_scripted_failing_runs_is_flagged_all_fail_on_its_ranking_before_its_runs_end(  # noqa: E501 (the test's name is its sentence)
    broker: Mosquitto,
) -> None:
    registry = CollectorRegistry()
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        policy=POLICY,
        circuit_threshold=1000,
    )
    runs = list(LETTERS)
    http = HttpServer(registry, port=0)
    source = RewardSource(http, RewardApiSettings(reward_api=True), registry=registry)
    monitor = Monitor(
        config, judge=FakeJudge(by_run), registry=registry, sources=[source], http=http
    )
    async with monitor as mon, harness(broker.port, "h") as h:
        for r in runs:
            group = r.split("-")[0]
            await h.publish(
                r, "start", {"task": f"task of {r}", "family": "rl-task", "group": group}
            )
        await h.until(
            lambda: all(mon.tracker(r) is not None for r in runs) and h.ranking("mixed") is not None
        )
        # The family's evidence, as earlier groups of this prompt would have left it: 19 successes,
        # 19 failures.
        tracker = mon.tracker("doomed-a")
        assert tracker is not None
        for i in range(19):
            mon.calibration.add(
                Sample(f"old-s{i}", tracker.family, True, _flat(f"s{i}", 0.7 + 0.01 * i))
            )
            mon.calibration.add(
                Sample(f"old-f{i}", tracker.family, False, _flat(f"f{i}", 0.2 + 0.01 * i))
            )

        await _steps(h, runs, 1)
        # one counted score, patience 2: no call yet
        assert h.ranking("doomed").get("uniform") is None
        await _steps(h, runs, 2, start=2)
        await h.until(lambda: h.ranking("doomed").get("uniform") is not None)
        flagged = h.ranking("doomed")
        jsonschema.validate(flagged, RANKING_SCHEMA)
        RankingOut.model_validate(flagged)
        assert flagged["uniform"] == {
            "call": "all_fail",
            "confidence": pytest.approx(1 - 3 / 20),
            "at_step": 2,
            "runs": 3,
        }
        # Flagged while every run is live: the trainer can cancel the group and resample its prompt
        # now.
        assert [r["state"] for r in flagged["runs"]] == ["live", "live", "live"]
        assert all(not h.signals(r) for r in runs)  # the flag itself stops nothing
        assert mon.groups.uniform("doomed") == flagged["uniform"]
        assert mon.groups.uniform_of("doomed-b") == flagged["uniform"]
        # And in the reward answer for a live member (the native endpoint, by run id).
        await asyncio.wait_for(source.ready.wait(), 10)
        status, answer, _ = await post(
            f"{http.url}v1/score", json.dumps({"run_id": "doomed-b"}).encode()
        )
        assert status == 200 and answer["uniform"] == flagged["uniform"]
        status, answer, _ = await post(
            f"{http.url}v1/score", json.dumps({"run_id": "mixed-a"}).encode()
        )
        assert status == 200 and answer["uniform"] is None
        # The mixed group has variance (one run does well): never flagged.
        assert all(m.get("uniform") is None for m in h.seen["agents/_groups/mixed/ranking"] if m)
        assert mon.groups.uniform("mixed") is None

        await _steps(h, runs, 3, start=3)
        for r in runs:
            await h.publish(r, "end", {"outcome": "success" if r == "mixed-c" else "failure"})
        await h.until(lambda: all(r["state"] == "ended" for r in h.ranking("doomed")["runs"]))
        await h.until(lambda: all(r["state"] == "ended" for r in h.ranking("mixed")["runs"]))
        # the outcomes agree: the call stands
        assert h.ranking("doomed")["uniform"]["call"] == "all_fail"
        assert all(m.get("uniform") is None for m in h.seen["agents/_groups/mixed/ranking"] if m)

        def counted(call: str, event: str) -> float | None:
            return registry.get_sample_value(
                "agent_monitor_groups_uniform_total", {"call": call, "event": event}
            )

        assert counted("all_fail", "flagged") == 1
        assert counted("all_fail", "contradicted") == 0 and counted("all_pass", "flagged") == 0
