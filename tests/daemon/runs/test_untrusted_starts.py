"""Issue 48 on a real Mosquitto: a stranger cannot shut a group, a retained message cannot re-run
a run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import Monitor, MonitorConfig, SqliteStore
from agent_monitor.groups import group_mac
from agent_monitor.policy import Policy
from agent_monitor.prompts import Prompt
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings, RankingOut
from tests.brokers import Mosquitto
from tests.daemon.runs.test_groups_mqtt import Harness as GroupHarness
from tests.daemon.runs.test_groups_mqtt import harness as group_harness
from tests.daemon.test_daemon_mqtt import Harness, harness

pytestmark = pytest.mark.timeout(120)

SECRET = "group-secret-long-enough"


def monitor(
    broker: Mosquitto, judge: FakeJudge, store: SqliteStore, registry: CollectorRegistry, **kw: Any
) -> Monitor:
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url), client_id=f"mon-{broker.port}", **kw
    )
    return Monitor(config, judge=judge, store=store, registry=registry)


async def publish_retained(h: Harness, run_id: str, kind: str, payload: Any) -> None:
    await h.client.publish(
        f"agents/{run_id}/{kind}", json.dumps(payload).encode(), qos=1, retain=True
    )


async def test_retained_start_steps_and_end_survive_a_restart_without_a_judge_call_or_a_second_sample(  # noqa: E501 (the test's name is its sentence)
    broker: Mosquitto, tmp_path: Path
) -> None:
    judge = FakeJudge(["P"])
    path = tmp_path / "runs.sqlite3"
    policy = Policy(min_steps=1, patience=1)
    store = SqliteStore(path)
    try:
        async with (
            monitor(broker, judge, store, CollectorRegistry(), policy=policy) as mon,
            harness(broker.port) as h,
        ):
            # Live: a retained publish reaches a subscriber already there without the flag, so it is
            # used.
            await publish_retained(h, "r", "start", {"task": "fix the bug", "family": "fix"})
            for i in (1, 2, 3):
                await publish_retained(h, "r", "step", {"index": i, "text": f"step {i}"})
            await h.until(lambda: h.last_step("r") == 3)
            await publish_retained(h, "r", "end", {"outcome": "success"})
            # cleared when the run closed, after it taught
            await h.until(lambda: None in h.seen[("r", "signal")])
            assert len(mon.calibration) == 1
            calls = judge.calls_made
            assert calls >= 1 and not h.seen[("r", "error")]
    finally:
        await store.aclose()
    # A restart: the broker sends the retained start, last step and end again on the new
    # subscription.
    store = SqliteStore(path)
    registry = CollectorRegistry()
    try:
        async with (
            monitor(broker, judge, store, registry, policy=policy) as mon,
            harness(broker.port, "h2") as h,
        ):
            await h.until(lambda: bool(h.seen[("r", "error")]))
            (error,) = h.seen[("r", "error")]  # told once, for three retained messages
            assert error["reason"] == "retained" and "retain flag" in error["error"], error
            retained = {
                k: registry.get_sample_value("agent_monitor_retained_inputs_total", {"kind": k})
                for k in ("start", "step", "end")
            }
            assert retained == {"start": 1.0, "step": 1.0, "end": 1.0}
            await mon.drain()
            assert mon.run("r") is None and not h.progress("r")
            assert judge.calls_made == calls  # no judge call
            assert len(mon.calibration) == 1  # no second calibration sample
            assert len(await store.samples()) == 1
            # Sent again without the flag: the end is a duplicate (its run's end is journaled), the
            # step refused.
            await h.publish("r", "end", {"outcome": "success"})
            await h.publish("r", "step", {"index": 4, "text": "step 4"})
            await h.until(lambda: len(h.seen[("r", "error")]) == 2)
            assert h.seen[("r", "error")][1]["reason"] == "run_ended"
            await mon.drain()
            assert judge.calls_made == calls and len(mon.calibration) == 1 and mon.run("r") is None
            # A run published the ordinary way is still monitored.
            await h.publish("fresh", "start", {"task": "t"})
            await h.publish("fresh", "step", {"index": 1, "text": "x"})
            await h.until(lambda: h.last_step("fresh") == 1)
    finally:
        await store.aclose()


HONEST = {"h1": "P", "h2": "O", "h3": "D"}
SQUAT_POLICY = Policy(min_steps=2, patience=2, keep_top=2, prune_margin=0.2)


def squat_answer(p: Prompt) -> str:
    text = p.prefix_text()
    if "trivially done" in text:
        # the stranger's own rubric scores it 1.0: in one group with them, it would prune them all
        return "T"
    return next((letter for run, letter in HONEST.items() if f"{run} did" in text), "J")


async def _group_steps(h: GroupHarness, runs: list[str], upto: int) -> None:
    for i in range(1, upto + 1):
        for r in runs:
            await h.publish(r, "step", {"index": i, "text": f"{r} did step {i}"})
        await h.until(lambda i=i: all(h.last_step(r) >= i or h.signals(r) for r in runs))


async def test_a_stranger_first_in_a_group_decides_nothing_for_the_honest_runs(
    broker: Mosquitto,
) -> None:
    registry = CollectorRegistry()
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        policy=SQUAT_POLICY,
    )
    honest = list(HONEST)
    mon = Monitor(config, judge=FakeJudge(squat_answer), registry=registry)
    async with mon, group_harness(broker.port, "h") as h:
        # The stranger starts group g first, with a rubric of its own (before issue 48 the honest
        # runs were refused).
        stranger = {
            "task": "say hi",
            "criteria": {"done": "trivially done"},
            "group": "g",
            "policy": {"keep_top": 1},
        }
        await h.publish("stranger", "start", stranger)
        await h.until(lambda: h.ranking("g") is not None)
        for r in honest:
            await h.publish(r, "start", {"task": "fix the bug", "group": "g"})
        await h.until(lambda: all(h.seen[f"agents/{r}/error"] for r in honest))
        split = {h.seen[f"agents/{r}/error"][0]["reason"] for r in honest}
        assert split == {"group_split"}
        name = mon.groups.of_run["h1"]
        assert name.startswith("g~") and all(mon.groups.of_run[r] == name for r in honest)
        # where its ranking is
        assert f"_groups/{name}/ranking" in h.seen["agents/h1/error"][0]["error"]
        await _group_steps(h, [*honest, "stranger"], 4)
        # Every honest run is scored, ranked among themselves, and pruned only by them: the laggard
        # h3.
        for r in honest:
            assert h.last_step(r) >= 2, r
        await h.until(lambda: h.ranking(name) is not None and len(h.ranking(name)["runs"]) == 3)
        ranking = h.ranking(name)
        # a split group's ranking is a valid ranking
        assert RankingOut.model_validate(ranking).group == name
        assert [x["run_id"] for x in ranking["runs"]] == ["h1", "h2", "h3"], ranking
        assert [x["state"] for x in ranking["runs"]] == ["live", "live", "pruned"]
        assert all(not h.signals(r) for r in ("h1", "h2"))  # the stranger's 1.0 never pruned them
        (prune,) = h.signals("h3")
        assert prune["pruned"] and prune["leader"] == "h1"
        # The name's retained ranking shows the stranger's group alone.
        assert [x["run_id"] for x in h.ranking("g")["runs"]] == ["stranger"]
        assert registry.get_sample_value("agent_monitor_groups_split_total") == 3
        # The board shows every run: none was refused.
        assert all(mon.run(r) is not None for r in [*honest, "stranger"])


async def test_with_a_group_secret_an_unsigned_stranger_first_does_not_own_the_group(
    broker: Mosquitto,
) -> None:
    registry = CollectorRegistry()
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        policy=SQUAT_POLICY,
        group_secret=SECRET,
    )
    honest = list(HONEST)
    mon = Monitor(config, judge=FakeJudge(squat_answer), registry=registry)
    async with mon, group_harness(broker.port, "h") as h:
        # Unsigned, and the same task and rubric as the honest runs: without the secret it could not
        # be told apart.
        await h.publish("stranger", "start", {"task": "fix the bug", "group": "g"})
        await h.until(lambda: bool(h.seen["agents/stranger/error"]))
        (e,) = h.seen["agents/stranger/error"]
        assert e["reason"] == "group_refused" and "needs start.auth" in e["error"]
        # scored, in no group
        assert mon.run("stranger") is not None and "stranger" not in mon.groups.of_run
        # the honest harness signs its starts (as MonitorClient(group_secret=...) does)
        for r in honest:
            # fresh: a signed start older than --signature-max-age is stale
            started = round(time.time(), 3)
            auth = group_mac(SECRET, r, started, "g")
            await h.publish(
                r,
                "start",
                {"task": "fix the bug", "group": "g", "started_at": started, "auth": auth},
            )
        await h.until(lambda: all(r in mon.groups.of_run for r in honest))
        assert all(mon.groups.of_run[r] == "g" for r in honest)  # the signed runs own g
        await _group_steps(h, [*honest, "stranger"], 4)
        await h.until(
            lambda: h.ranking("g") is not None and h.ranking("g")["runs"][-1]["state"] == "pruned"
        )
        assert [x["run_id"] for x in h.ranking("g")["runs"]] == honest
        assert h.last_step("stranger") >= 2  # monitored all the same
        assert not any(h.seen[f"agents/{r}/error"] for r in honest)
        assert registry.get_sample_value("agent_monitor_groups_refused_total") == 1


async def test_the_same_start_run_again_after_its_end_teaches_once() -> None:
    from agent_monitor.daemon import MemoryStore

    judge = FakeJudge(["P"])
    async with Monitor(
        MonitorConfig(policy=Policy(min_steps=1, patience=1)), judge=judge, store=MemoryStore()
    ) as mon:
        # the same start re-sent after its end, then a new run of the id
        for started_at in (100.0, 100.0, 200.0):
            await mon.handle(
                "agents/r/start", json.dumps({"task": "t", "started_at": started_at}).encode()
            )
            await mon.handle("agents/r/step", b'{"index": 1, "text": "x"}')
            await mon.handle("agents/r/end", b'{"outcome": "success"}')
            await mon.drain()
        assert sorted(s.run_id for s in mon.calibration.samples()) == ["r@100.0", "r@200.0"]
