"""The in-process group API: sibling trackers sharing a group, pruned runs told by an abort
marked pruned."""

from __future__ import annotations

from typing import Any

import pytest

from agent_monitor import AsyncGroupTracker, Decision, GroupTracker, Policy
from agent_monitor.prompts import Prompt
from agent_monitor.testing import FakeJudge

LETTERS = {"a": "P", "b": "O", "c": "D", "d": "C"}
POLICY = Policy(min_steps=2, patience=2, keep_top=2, prune_margin=0.2)


def by_run(p: Prompt) -> str:
    # Each sibling's steps name it; the newest step says whose prefix this is.
    return LETTERS[p.prefix_text().rsplit("run=", 1)[1][0]]


def test_two_laggards_are_pruned_and_the_leaders_continue() -> None:
    rankings: list[Any] = []
    signals: list[Decision] = []
    judge = FakeJudge(by_run)
    with GroupTracker(
        "Fix the bug",
        judge=judge,
        policy=POLICY,
        name="g",
        on_ranking=rankings.append,
        on_signal=signals.append,
    ) as group:
        runs = {r: group.run(r) for r in LETTERS}
        last = {}
        for step in range(1, 5):
            for r, t in runs.items():
                if r in group.pruned:
                    continue  # the harness stops a pruned run
                last[r] = t.update(f"run={r} step {step}")
        for r in ("c", "d"):
            d = last[r].signal
            assert (
                d is not None
                and d.signal == "abort"
                and d.pruned
                and d.leader == "a"
                and d.step == 3
            )
        for r in ("a", "b"):
            assert (
                last[r].step == 4
                and last[r].signal is not None
                and last[r].signal.signal == "continue"
            )
        assert [s.pruned for s in signals] == [True, True]
        assert group.leader == "a" and sorted(group.pruned) == ["c", "d"]
        group.end("a", "success")
        r = group.ranking()
        assert [(x["run_id"], x["state"], x.get("outcome")) for x in r["runs"]] == [
            ("a", "ended", "success"),
            ("b", "live", None),
            ("c", "pruned", None),
            ("d", "pruned", None),
        ]
        assert rankings[-1] == r
        # Dense reward on the hook too.
        assert runs["a"].curve[0].delta is None and runs["a"].curve[1].delta == pytest.approx(0.0)


def test_a_judge_failure_prunes_nothing() -> None:
    def answer(p: Prompt) -> Any:
        return by_run(p) if p.step == 1 else FakeJudge.failure("server_error")

    with GroupTracker(
        "t",
        judge=FakeJudge(answer),
        policy={"min_steps": 1, "patience": 2, "keep_top": 1, "prune_margin": 0.1},
    ) as group:
        runs = {r: group.run(r) for r in LETTERS}
        # step 1 puts c and d one step behind; then the judge fails for everyone
        for step in range(1, 6):
            for r, t in runs.items():
                t.update(f"run={r} step {step}")
        assert group.pruned == [] and len(group.state.live) == 4
        assert all(m.behind == 1 for r, m in group.state.members.items() if r in "cd")


async def test_the_async_group() -> None:
    group = AsyncGroupTracker("t", judge=FakeJudge(by_run), policy=POLICY)
    runs = {r: group.run(r) for r in LETTERS}
    for step in range(1, 4):
        for r, t in runs.items():
            await t.update(f"run={r} step {step}")
    assert sorted(group.pruned) == ["c", "d"] and group.state.live == ["a", "b"]
    with pytest.raises(ValueError, match="already in the group"):
        group.run("a")
    with pytest.raises(TypeError, match="policy is the group's"):
        group.run("e", policy={})


def _tied_judge(p: Prompt) -> Any:
    # Pointwise: a slightly ahead of b, both spread wide (tied within their uncertainty). Pairwise:
    # b, in either slot.
    text = p.prefix_text()
    if "## Trajectory 2" in text:
        return "A" if text.index("run=b") < text.index("run=a") else "T"
    last = text.rsplit("run=", 1)[1][0]
    return {"a": {"L": 0.5, "T": 0.5}, "b": {"K": 0.5, "S": 0.5}, "c": "C"}[last]


def test_compare_orders_tied_leaders_by_the_pivot_tournament() -> None:
    rankings: list[Any] = []
    with GroupTracker("t", judge=FakeJudge(_tied_judge), on_ranking=rankings.append) as group:
        runs = {r: group.run(r) for r in "abc"}
        for r, t in runs.items():
            t.update(f"run={r} step 1")
        assert group.leader == "a" and group.state.tied_leaders() == ["a", "b"]
        result = group.compare()
        assert result is not None and result.winner == "b" and result.comparisons == 1
        assert [x["run_id"] for x in group.ranking()["runs"]] == ["b", "a", "c"]
        assert rankings[-1]["leader"] == "b"


async def test_compare_makes_no_call_when_pointwise_scores_separate_the_leaders() -> None:
    judge = FakeJudge(by_run)
    group = AsyncGroupTracker("t", judge=judge, policy=POLICY)
    for r in LETTERS:
        await group.run(r).update(f"run={r} step 1")
    calls = len(judge.requests)
    assert await group.compare() is None and len(judge.requests) == calls
