"""The integrations' shared verdict: a judged abort stops, a judge failure never does and never
invents a reward."""

from __future__ import annotations

import asyncio

from agent_monitor import AsyncProgressTracker
from agent_monitor.integrations import Verdict, verdict
from agent_monitor.testing import FakeJudge


def test_nothing_scored_is_no_stop_and_no_reward() -> None:
    v = verdict(None, None)
    assert v == Verdict(0, None, None, None, "nothing scored yet", False, "judged")


def test_a_failure_is_infra_and_keeps_the_judged_reward() -> None:
    async def run() -> tuple[Verdict, Verdict, Verdict]:
        judge = FakeJudge(
            ["K", FakeJudge.failure("timeout"), "B", "B", FakeJudge.failure("timeout")]
        )
        t = AsyncProgressTracker(
            "Fix it",
            judge=judge,
            policy={"abort_below": 0.1, "min_steps": 1, "patience": 2, "holdout": 0.0},
        )
        await t.update("a")
        await t.update("b")  # the judge times out: no judgement, no stop
        infra = verdict(t.latest, t.summary.last_ok)
        await t.update("c")
        await t.update("d")  # two poor scores in a row: the policy aborts
        judged = verdict(t.latest, t.summary.last_ok)
        await t.update("e")  # a failure after the abort: the abort, decided on scores, stands
        return infra, judged, verdict(t.latest, t.summary.last_ok)

    infra, judged, after = asyncio.run(run())
    assert (
        not infra.stop
        and infra.stop_kind == "infra"
        and infra.score is None
        and infra.reason == "timeout"
    )
    assert infra.reward == 10 / 19 and infra.to_json()["stop_kind"] == "infra"
    assert (
        judged.stop
        and judged.stop_kind == "judged"
        and judged.signal == "abort"
        and judged.step == 4
    )
    assert judged.reward == 1 / 19
    assert (
        after.stop
        and after.stop_kind == "judged"
        and after.score is None
        and after.reward == 1 / 19
    )
