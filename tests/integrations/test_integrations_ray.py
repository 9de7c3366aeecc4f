"""Ray: two rollout workers on a local `ray.init(num_cpus=2)` share one MonitorActor (one judge,
its counters)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from agent_monitor.integrations.ray import MonitorActor, MonitorService
from agent_monitor.scale import LETTERS
from agent_monitor.testing import FakeJudge

ray = pytest.importorskip(
    "ray",
    reason="ray is not installed (pip install agent-monitor[ray]); its contract test needs it",
)


def _grade(prompt: Any) -> Any:
    # The judge reads the newest step: "stuck" is poor progress, "JUDGE-DOWN" an outage, anything
    # else fair.
    last = prompt.text().rsplit("Step ", 1)[-1]
    if "JUDGE-DOWN" in last:
        return FakeJudge.failure("server_error")
    return "B" if "stuck" in last else "K"


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    # Ray's workers cannot import this test module: its functions and classes travel by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_two_rollout_workers_share_one_monitor_actor(local_ray: Any) -> None:
    monitor = MonitorActor.options(num_cpus=0).remote(
        judge=functools.partial(FakeJudge, _grade),
        policy={"abort_below": 0.1, "min_steps": 2, "patience": 2, "holdout": 0.0},
    )

    @ray.remote(num_cpus=0)
    class RolloutWorker:
        """An async rollout worker: awaits the shared monitor after each step, stops when told
        to."""

        def __init__(self, monitor: Any) -> None:
            self.monitor = monitor

        async def rollout(self, run_id: str, steps: list[str]) -> list[dict[str, Any]]:
            answers = []
            for i, step in enumerate(steps):
                v = await self.monitor.update.remote(
                    run_id, step, task="Fix the failing test" if i == 0 else None
                )
                answers.append(v)
                if v["stop"]:
                    break
            return answers

    workers = [RolloutWorker.remote(monitor), RolloutWorker.remote(monitor)]
    good = ["read the test", "JUDGE-DOWN", "fixed it", "ran the tests"]
    bad = ["read the test", "stuck", "stuck again", "still stuck", "never reached"]
    a, b = ray.get([workers[0].rollout.remote("good", good), workers[1].rollout.remote("bad", bad)])

    # The good run went on through a judge outage: infra, no score, no stop, the earlier reward
    # kept.
    assert [v["stop_kind"] for v in a] == ["judged", "infra", "judged", "judged"]
    assert a[1]["score"] is None and not a[1]["stop"] and a[1]["reward"] == pytest.approx(10 / 19)
    assert not any(v["stop"] for v in a) and a[-1]["reward"] == pytest.approx(10 / 19)
    # The bad run was stopped at its second poor step in a row (patience=2), with the reward it had
    # earned then.
    assert (
        len(b) == 3
        and b[-1]["stop"]
        and b[-1]["stop_kind"] == "judged"
        and b[-1]["signal"] == "abort"
    )
    assert b[-1]["step"] == 3 and b[-1]["reward"] == pytest.approx(LETTERS.index("B") / 19)

    # One actor, one judge: both workers' steps went through it.
    stats = ray.get(monitor.statistics.remote())
    assert stats.updates == 7 and stats.live_runs == 2 and stats.infra == 1 and stats.stops == 1

    # ray.get from the driver: submit, status after the background scoring, a one-shot reward,
    # finish.
    index = ray.get(monitor.submit.remote("third", "read the test", task="Fix the failing test"))
    assert index == 1
    status = ray.get(monitor.status.remote("third", drain=True))
    assert status["step"] == 1 and status["score"] == pytest.approx(10 / 19)
    reward = ray.get(monitor.score.remote("Fix the failing test", ["read it", "fixed it"]))
    assert (
        reward["steps"] == 2
        and reward["stop_kind"] == "judged"
        and reward["score"] == pytest.approx(10 / 19)
    )
    assert ray.get(monitor.finish.remote("good"))["run_id"] == "good"
    assert ray.get(monitor.status.remote("good")) is None
    with pytest.raises(ray.exceptions.RayTaskError, match="give its task="):
        ray.get(monitor.update.remote("unknown", "a step"))


async def test_the_service_in_process_bounds_its_runs() -> None:
    service = MonitorService(functools.partial(FakeJudge, ["K"]), max_runs=2)
    for run in ("r1", "r2", "r3"):
        await service.update(run, "a step", task="Do it")
    stats = await service.statistics()
    assert stats.live_runs == 2 and stats.evicted == 1
    assert await service.status("r1") is None
    with pytest.raises(TypeError, match="zero-argument factory"):
        MonitorService(FakeJudge(["K"]))  # type: ignore[arg-type]
    await service.close()
    assert (await service.statistics()).live_runs == 0
