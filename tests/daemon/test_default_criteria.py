"""`serve --criteria NAME|FILE`: the daemon-wide rubric of runs whose start names none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_monitor.criteria import CriteriaError, load_criteria
from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.testing import FakeJudge
from tests.brokers import Mosquitto
from tests.daemon.test_daemon_mqtt import harness, monitor

pytestmark = pytest.mark.timeout(120)

OWN = {"criteria": [{"name": "tidy", "description": "How tidy the work is."}]}


async def test_runs_without_criteria_take_the_default_and_the_others_keep_their_own(
    broker: Mosquitto,
) -> None:
    judge = FakeJudge()
    async with monitor(broker, judge, criteria="coding") as mon, harness(broker.port) as h:
        await h.publish("plain", "start", {"task": "t"})
        await h.publish("named", "start", {"task": "t", "criteria": "robot"})
        await h.publish("inline", "start", {"task": "t", "criteria": OWN})
        for run in ("plain", "named", "inline"):
            await h.publish(run, "step", {"index": 1, "text": "did a thing"})
        await h.until(lambda: all(h.last_step(r) == 1 for r in ("plain", "named", "inline")))
        await mon.drain()
        rubric = {r: h.progress(r)[-1]["rubric"] for r in ("plain", "named", "inline")}
        assert rubric == {
            "plain": load_criteria("coding").hash,
            "named": load_criteria("robot").hash,
            "inline": load_criteria(OWN).hash,
        }
        # The default's criteria are the ones graded: coding has three, each a judge call.
        assert set(h.progress("plain")[-1]["criteria"]) == {
            "goal_progress",
            "verification",
            "trajectory_health",
        }


async def test_a_default_rubric_file_brings_its_thresholds(tmp_path: Path) -> None:
    path = tmp_path / "rubric.json"
    path.write_text(json.dumps({**OWN, "thresholds": {"abort_below": 0.2}}))
    async with Monitor(MonitorConfig(criteria=str(path)), judge=FakeJudge(["B"])) as mon:
        await mon.handle("agents/r1/start", json.dumps({"task": "t"}).encode())
        await mon.handle(
            "agents/r2/start", json.dumps({"task": "t", "criteria": "progress"}).encode()
        )
        await mon.drain()
        t1, t2 = mon.tracker("r1"), mon.tracker("r2")
        assert t1 is not None and t1.rubric.hash == load_criteria(OWN).hash
        assert t1.policy_state is not None and t1.policy_state.policy.abort_below == 0.2
        # A run with its own rubric has that rubric's levels (none): the default's thresholds are
        # the default's.
        assert (
            t2 is not None
            and t2.policy_state is not None
            and t2.policy_state.policy.abort_below is None
        )


@pytest.mark.parametrize(
    ("criteria", "says"),
    [
        ("nope", "no bundled criteria named 'nope'"),
        ("/nonexistent/r.md", "cannot read criteria file"),
    ],
)
def test_a_bad_default_fails_at_start_up_not_at_the_first_run(criteria: str, says: str) -> None:
    with pytest.raises(CriteriaError) as e:
        Monitor(MonitorConfig(criteria=criteria), judge=FakeJudge())
    assert f"default criteria {criteria!r} (serve --criteria)" in str(e.value) and says in str(
        e.value
    )
