"""Policy: abort / resample / continue from a run's scores; edge-triggered, fail-open,
uncertainty-aware."""

import pytest

from agent_monitor import (
    AsyncProgressTracker,
    JudgeError,
    Policy,
    PolicyError,
    Progress,
    ProgressTracker,
)
from agent_monitor.policy import PolicyState
from agent_monitor.scale import LETTERS
from agent_monitor.testing import FakeJudge


def prog(step: int, score: float | None, uncertainty: float = 0.05) -> Progress:
    ok = score is not None
    return Progress(
        step=step,
        score=score,
        uncertainty=uncertainty if ok else None,
        criteria={},
        ok=ok,
        reason=None if ok else "timeout",
    )


def run(policy: Policy, scores: list[float | None], unc: float = 0.05) -> list[str]:
    state = PolicyState(policy)
    return [state.observe(prog(i, s, unc)).signal for i, s in enumerate(scores, 1)]


def test_abort_after_patience_low_scores_past_min_steps() -> None:
    pol = Policy(abort_below=0.2, min_steps=2, patience=3)
    # Step 1 is before min_steps; steps 2, 3, 4 are three low scores in a row.
    assert run(pol, [0.1, 0.1, 0.1, 0.1, 0.1]) == [
        "continue",
        "continue",
        "continue",
        "abort",
        "abort",
    ]
    # A good score breaks the streak.
    assert run(pol, [0.1, 0.1, 0.1, 0.5, 0.1, 0.1]) == ["continue"] * 6
    # Abort is final.
    assert run(pol, [0.1, 0.1, 0.1, 0.1, 0.1, 0.9])[-1] == "abort"


def test_judge_failures_never_abort_and_do_not_break_streaks() -> None:
    pol = Policy(abort_below=0.2, min_steps=0, patience=2)
    assert run(pol, [None, None, None, None]) == ["continue"] * 4
    assert run(pol, [0.1, None, 0.1]) == ["continue", "continue", "abort"]


def test_uncertain_low_scores_do_not_abort() -> None:
    pol = Policy(abort_below=0.2, min_steps=0, patience=1, max_uncertainty=0.3)
    assert run(pol, [0.05, 0.05], unc=0.4) == ["continue", "continue"]
    assert run(pol, [0.05], unc=0.1) == ["abort"]


def test_resample_on_low_score_or_regression_and_back_to_continue() -> None:
    pol = Policy(resample_below=0.2, regression=0.3, min_steps=0)
    assert run(pol, [0.5, 0.1, 0.5]) == ["continue", "resample", "continue"]
    state = PolicyState(pol)
    decisions = [state.observe(prog(i, s)) for i, s in enumerate([0.3, 0.8, 0.45, 0.9], 1)]
    assert [d.signal for d in decisions] == ["continue", "continue", "resample", "continue"]
    assert (
        decisions[2].best_step == 2
        and decisions[2].best_score == 0.8
        and "fell 0.35" in decisions[2].reason
    )
    assert [d.changed for d in decisions] == [False, False, True, True]


def test_overrides_are_checked() -> None:
    base = Policy(abort_below=0.1)
    assert base.with_overrides({"patience": 5.0, "abort_below": 0.2}) == Policy(
        abort_below=0.2, patience=5
    )
    with pytest.raises(PolicyError, match=r"unknown policy setting\(s\) \['abort'\]"):
        base.with_overrides({"abort": 0.2})
    with pytest.raises(PolicyError, match="abort_below=2"):
        Policy(abort_below=2)
    with pytest.raises(PolicyError, match="patience"):
        Policy(patience=0)


async def test_tracker_attaches_signals_and_calls_back_on_change_only() -> None:
    # Progress falls one letter per step: 9/19, 8/19, 7/19 (< 0.4), 6/19 ...; abort after 2 low
    # steps.
    judge = FakeJudge(lambda p: LETTERS[max(0, 10 - p.step)])
    changes = []
    t = AsyncProgressTracker(
        "task",
        judge=judge,
        policy={"abort_below": 0.4, "min_steps": 1, "patience": 2},
        on_signal=changes.append,
    )
    signals = [(await t.update(f"s{i}")).signal for i in range(1, 7)]
    assert [s.signal for s in signals if s] == [
        "continue",
        "continue",
        "continue",
        "abort",
        "abort",
        "abort",
    ]
    assert (
        [d.signal for d in changes] == ["abort"]
        and changes[0].step == 4
        and changes[0].best_step == 1
    )
    assert t.curve[-1].to_json()["signal"] == "abort"


def test_sync_hook_judge_outage_never_aborts() -> None:
    judge = FakeJudge(lambda p: JudgeError("server_error", "HTTP 503", retryable=False))
    with ProgressTracker(
        "task", judge=judge, policy=Policy(abort_below=0.9, min_steps=0, patience=1)
    ) as t:
        results = [t.update(f"s{i}") for i in range(3)]
    assert all(not p.ok and p.signal is not None and p.signal.signal == "continue" for p in results)
    assert "judge failed" in (results[-1].signal.reason if results[-1].signal else "")
    judge.close()


async def test_no_policy_no_signal() -> None:
    p = await AsyncProgressTracker("task", judge=FakeJudge()).update("x")
    assert p.signal is None and p.to_json()["signal"] is None
