"""Defects found while checking the seeds' rows (issue 28): each test fails before its fix."""

from __future__ import annotations

import asyncio

import pytest

from agent_monitor import AsyncProgressTracker, CriteriaError, Decision, load_criteria
from agent_monitor.testing import FakeJudge


def test_a_score_recovered_after_an_outage_is_decided_like_any_other() -> None:
    """Step 2's first scoring fails (outage); its re-score after recovery must reach the policy
    and abort."""
    judge = FakeJudge(["J", FakeJudge.failure("timeout"), "A"])
    signals: list[Decision] = []

    async def main() -> tuple[list[str | None], str | None]:
        tracker = AsyncProgressTracker(
            "make the test pass",
            judge=judge,
            repeats=1,
            on_signal=signals.append,
            policy={"abort_below": 0.2, "min_steps": 1, "patience": 1},
        )
        first = await tracker.update("ran pytest")
        failed = await tracker.update("edited the wrong file")
        assert first.ok and not failed.ok and failed.reason == "timeout"
        recovered = await tracker.score(2)  # the judge is back: the same step scored again
        assert recovered.ok and recovered.step == 2
        return [r.signal.signal if r.signal else None for r in (first, failed, recovered)], (
            tracker.latest.signal.signal if tracker.latest and tracker.latest.signal else None
        )

    seen, latest = asyncio.run(main())
    assert seen == ["continue", "continue", "abort"]
    assert latest == "abort"
    assert [d.signal for d in signals] == ["abort"]


def test_a_rubric_whose_criteria_is_not_a_list_is_mapped_or_refused_never_read_as_its_keys() -> (
    None
):
    # Before the fix this became criteria named "title", "criteria" and "thresholds".
    r = load_criteria(
        {
            "title": "mine",
            "criteria": {"correct": "is it right?"},
            "thresholds": {"abort_below": 0.1},
        }
    )
    assert [c.name for c in r.criteria] == ["correct"] and r.title == "mine"
    assert dict(r.thresholds) == {"abort_below": 0.1}
    with pytest.raises(CriteriaError, match="'criteria' is a str"):
        load_criteria({"criteria": "correctness"})
    with pytest.raises(CriteriaError, match="'criteria' is missing"):
        load_criteria({"title": "no criteria", "thresholds": {"abort_below": 0.1}})
    with pytest.raises(CriteriaError, match="'criteria' is a dict"):
        load_criteria({"criteria": {"correct": {"weight": 1}}})
