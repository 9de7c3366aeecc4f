"""Calibrated abort thresholds: the rule, its guarantee, the minimum sample, and the family key."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_monitor import Policy
from agent_monitor.calibration import (
    Calibration,
    CalibrationError,
    Family,
    Point,
    Sample,
    conformal_threshold,
    is_success,
    margin,
    min_successes,
)
from agent_monitor.policy import PolicyError, PolicyState, held_out
from agent_monitor.progress import Progress

FAM = Family("fix-the-test", "judge-v1", "rubric-1")


def _curve(
    scores: list[float | None], uncertainties: list[float | None] | None = None
) -> tuple[Point, ...]:
    us = uncertainties or [0.1 if s is not None else None for s in scores]
    return tuple(Point(i, s, u) for i, (s, u) in enumerate(zip(scores, us, strict=True), 1))


def _aborts(curve: tuple[Point, ...], policy: Policy) -> bool:
    """The live policy itself, stepped through the curve: does it abort?"""
    state = PolicyState(policy)
    for p in curve:
        ok = p.score is not None
        prog = Progress(step=p.step, score=p.score, uncertainty=p.uncertainty, criteria={}, ok=ok)
        if state.observe(prog).signal == "abort":
            return True
    return False


scores_st = st.lists(
    st.one_of(st.none(), st.floats(0, 1), st.sampled_from([0.1, 0.2, 0.3])), min_size=0, max_size=25
)
policy_st = st.builds(
    Policy,
    min_steps=st.integers(0, 5),
    patience=st.integers(1, 5),
    max_uncertainty=st.sampled_from([0.05, 0.35, 1.0]),
)


@settings(max_examples=300, deadline=None)
@given(
    scores=scores_st, unc=st.lists(st.floats(0, 0.5), min_size=25, max_size=25), policy=policy_st
)
def test_margin_is_the_largest_threshold_that_does_not_abort(
    scores: list[float | None], unc: list[float], policy: Policy
) -> None:
    """Brute force: the live policy with abort_below just above the margin aborts; at the margin
    it does not."""
    curve = _curve(
        scores, [u if s is not None else None for s, u in zip(scores, unc, strict=False)]
    )
    m = margin(curve, policy)
    candidates = sorted({0.0, 1.0, *(s for s in scores if s is not None)})
    for t in candidates:
        aborted = _aborts(curve, Policy(**{**policy.as_dict(), "abort_below": t}))
        assert aborted == (t > m), (t, m)
    if math.isfinite(m):
        above = math.nextafter(m, 2.0)
        if above <= 1.0:
            assert _aborts(curve, Policy(**{**policy.as_dict(), "abort_below": above}))


@settings(max_examples=200, deadline=None)
@given(
    margins=st.lists(st.floats(0, 1), max_size=60),
    alpha=st.sampled_from([0.05, 0.1, 0.2, 0.29, 0.5]),
)
def test_threshold_is_the_kth_smallest_margin(margins: list[float], alpha: float) -> None:
    """Brute force: the largest t with #{m_i < t} <= k - 1 among the margins, i.e.

    the k-th smallest.
    """
    k = math.floor(alpha * (len(margins) + 1) + 1e-9)
    t = conformal_threshold(margins, alpha)
    if k < 1:
        assert t is None
        return
    assert t is not None
    assert sum(m < t for m in margins) <= k - 1
    assert t == sorted(margins)[k - 1]


def test_minimum_sample() -> None:
    assert min_successes(0.05) == 19
    assert min_successes(0.1) == 9
    assert min_successes(0.2) == 4
    # floor(0.29 * 4) = 1; the rounding of 0.29 * 100 must not cost a run
    assert min_successes(0.29) == 3
    assert min_successes(0.5) == 1
    for alpha in (0.05, 0.1, 0.2, 0.25, 0.3, 0.5):
        n = min_successes(alpha)
        assert conformal_threshold([0.5] * n, alpha) is not None
        assert conformal_threshold([0.5] * (n - 1), alpha) is None


def test_no_abort_before_the_minimum_sample() -> None:
    """18 successes at alpha 0.05: an "auto" run at rock bottom keeps going; the 19th success
    arms the rule."""
    cal = Calibration()
    policy = Policy(abort_below="auto", min_steps=1, patience=2)
    for i in range(18):
        cal.record(FAM, f"ok-{i}", "success", _curve([0.6, 0.7, 0.8]))
    for i in range(30):
        cal.record(FAM, f"bad-{i}", "failure", _curve([0.05, 0.05, 0.05]))
    state = PolicyState(policy, threshold=lambda: cal.threshold(FAM, policy))
    for step in range(1, 6):
        d = state.observe(Progress(step=step, score=0.01, uncertainty=0.05, criteria={}, ok=True))
        assert d.signal == "continue"
        assert d.abort_below is None
        assert d.calibration is not None and "18 of 19" in d.calibration
    cal.record(FAM, "ok-18", "success", _curve([0.6, 0.7, 0.8]))
    d = state.observe(Progress(step=6, score=0.01, uncertainty=0.05, criteria={}, ok=True))
    assert d.signal == "abort"
    assert d.abort_below == pytest.approx(0.7)  # the smallest success margin (k = 1 at n = 19)
    assert "calibrated on 19 successful runs, alpha 0.05" in d.reason


def test_judge_failures_and_uncertain_scores_never_abort_an_auto_run() -> None:
    cal = Calibration(Sample(f"ok-{i}", FAM, True, _curve([0.9, 0.9, 0.9])) for i in range(19))
    policy = Policy(abort_below="auto", min_steps=1, patience=2, max_uncertainty=0.3)
    state = PolicyState(policy, threshold=lambda: cal.threshold(FAM, policy))
    steps = [
        Progress(step=1, score=None, uncertainty=None, criteria={}, ok=False, reason="timeout"),
        Progress(step=2, score=0.1, uncertainty=0.5, criteria={}, ok=True),
        Progress(step=3, score=None, uncertainty=None, criteria={}, ok=False, reason="timeout"),
        Progress(step=4, score=0.1, uncertainty=0.5, criteria={}, ok=True),
    ]
    assert all(state.observe(p).signal == "continue" for p in steps)


def test_family_key_isolates_judge_model_and_rubric() -> None:
    """A new judge model or rubric starts from nothing; so does another family."""
    cal = Calibration()
    policy = Policy(abort_below="auto", alpha=0.2)
    for i in range(10):
        cal.record(FAM, f"r{i}", "success", _curve([0.5] * 6))
    assert cal.threshold(FAM, policy).value == pytest.approx(0.5)
    for other in (
        Family(FAM.name, "judge-v2", FAM.rubric),
        Family(FAM.name, FAM.model, "rubric-2"),
        Family("another-task", FAM.model, FAM.rubric),
    ):
        th = cal.threshold(other, policy)
        assert th.value is None and th.successes == 0
        assert "never aborts" in th.reason


def test_a_run_counts_once_and_unknown_outcomes_teach_nothing() -> None:
    cal = Calibration()
    assert cal.record(FAM, "r1", "success", _curve([0.5] * 5)) is not None
    assert cal.record(FAM, "r1", "success", _curve([0.5] * 5)) is None  # redelivered end
    for outcome in (None, "aborted", "evicted", "stalled", float("nan")):
        assert cal.record(FAM, f"x-{outcome}", outcome, _curve([0.5] * 4)) is None
    assert cal.threshold(FAM, Policy(alpha=0.5)).successes == 1
    assert len(cal) == 1


def test_outcomes() -> None:
    assert is_success("success") is True
    assert is_success("failure") is False
    assert is_success(0.5) is True
    assert is_success(0.49) is False
    assert is_success(0.6, success_at=0.7) is False
    assert is_success(True) is True
    assert is_success(None) is None
    assert is_success("aborted") is None


def test_samples_round_trip_and_reset() -> None:
    cal = Calibration()
    s = cal.record(FAM, "r1", 0.8, _curve([0.2, None, 0.4]))
    assert s is not None
    again = Sample.from_json(s.to_json())
    assert again == s
    cal.record(Family(FAM.name, "judge-v2", FAM.rubric), "r2", "failure", _curve([0.1]))
    cal.record(Family("other", "m", "r"), "r3", "failure", _curve([0.1]))
    assert cal.reset(FAM.name) == 2
    assert [f.family.name for f in cal.families()] == ["other"]


def test_memory_is_bounded_per_family_and_in_total() -> None:
    """Families come from the network: the oldest runs of a family go, then whole least-recent
    families."""
    cal = Calibration(max_samples=3, max_total=7)
    for i in range(5):
        cal.record(FAM, f"r{i}", "success", _curve([0.1 * i, 0.1 * i]))
    assert sorted(s.run_id for s in cal.samples(FAM)) == ["r2", "r3", "r4"]
    assert cal.margins(FAM, Policy(min_steps=1, patience=1)) == pytest.approx([0.2, 0.3, 0.4])
    for f in range(4):
        cal.record(Family(f"f{f}", "m", "r"), "a", "failure", _curve([0.5]))
        cal.record(Family(f"f{f}", "m", "r"), "b", "failure", _curve([0.5]))
    # 3 + 4 x 2 = 11 over 7: FAM (least recent) goes, then f0; f1..f3 (6 runs) stay.
    assert len(cal) == 6
    assert sorted(f.family.name for f in cal.families()) == ["f1", "f2", "f3"]
    assert cal.threshold(FAM, Policy(alpha=0.5)).successes == 0


def test_save_and_load(tmp_path: Path) -> None:
    """A harness without the daemon keeps its evidence between processes."""
    cal = Calibration()
    for i in range(5):
        cal.record(
            FAM, f"r{i}", "success" if i % 2 else "failure", _curve([0.1 * i, 0.2, None, 0.3])
        )
    path = cal.save(tmp_path / "cal.jsonl")
    again = Calibration.load(path)
    assert sorted(s.to_json()["run_id"] for s in again.samples()) == [f"r{i}" for i in range(5)]
    policy = Policy(alpha=0.5, min_steps=1, patience=1)
    assert again.threshold(FAM, policy) == cal.threshold(FAM, policy)
    assert len(Calibration.load(tmp_path / "none-yet.jsonl")) == 0
    (tmp_path / "bad.jsonl").write_text('{"run_id": "x"}\n')
    with pytest.raises(CalibrationError, match=r"bad\.jsonl:1: not a calibration sample"):
        Calibration.load(tmp_path / "bad.jsonl")


def test_bad_settings_say_what_to_use() -> None:
    with pytest.raises(PolicyError, match="alpha"):
        Policy(alpha=0.0)
    with pytest.raises(PolicyError, match='"auto"'):
        Policy(abort_below="automatic")  # type: ignore[arg-type]
    with pytest.raises(CalibrationError, match="between 0 and 1"):
        conformal_threshold([0.1], 1.5)
    assert Policy().with_overrides({"abort_below": "auto", "alpha": 0.1}).auto


def _family(
    rng: random.Random, n: int, p_success: float, gap: float
) -> list[tuple[bool, tuple[Point, ...]]]:
    """Exchangeable runs: a run's level is drawn once, its steps are noisy around it; failures
    sit `gap` lower."""
    runs = []
    for _ in range(n):
        ok = rng.random() < p_success
        level = rng.uniform(0.3, 0.8) - (0 if ok else gap)
        length = rng.randint(6, 20)
        runs.append(
            (ok, _curve([min(1.0, max(0.0, level + rng.gauss(0, 0.08))) for _ in range(length)]))
        )
    return runs


def _simulate(
    alpha: float, gap: float, *, learner: str, families: int = 300
) -> tuple[float, float]:
    """Families of exchangeable runs learnt online; the mean false-abort rate and share of failing
    steps saved.

    Each family is a stream of runs in random order; each run is judged live against the threshold
    the runs that ended before it gave (as the daemon does), then its outcome is offered to the
    calibration:
    - "live": as the monitor does. A run the armed rule could have stopped is exposed and teaches
      nothing; the held-out share (by run id) is never aborted and teaches.
    - "censored": the naive way. Every run that was not aborted teaches (an aborted one has no
      outcome).
    """
    rng = random.Random(1234 + int(alpha * 100))
    policy = Policy(abort_below="auto", alpha=alpha, min_steps=2, patience=2, max_uncertainty=1.0)
    rates, saved = [], []
    for f in range(families):
        fam = Family(f"fam-{f}", "m", "r")
        cal = Calibration()
        good = good_aborted = bad_steps = bad_saved = 0
        for i, (ok, curve) in enumerate(_family(rng, 120, 0.5, gap)):
            run_id = f"fam-{f}-r{i}"
            th = cal.threshold(fam, policy)
            held = learner == "live" and held_out(run_id, policy.holdout)
            at = None
            if th.value is not None and not held:  # judged live only once the rule is armed
                # Aborted exactly when the margin is below the threshold (the brute-force test
                # above); the live policy then says at which step.
                if margin(curve, policy) < th.value:
                    state = PolicyState(policy, threshold=lambda th=th: th)  # type: ignore[misc]
                    for p in curve:
                        prog = Progress(
                            step=p.step,
                            score=p.score,
                            uncertainty=p.uncertainty,
                            criteria={},
                            ok=True,
                        )
                        if state.observe(prog).signal == "abort":
                            at = p.step
                            break
                    assert at is not None
                if ok:
                    good += 1
                    good_aborted += at is not None
                else:
                    bad_steps += len(curve)
                    bad_saved += len(curve) - at if at is not None else 0
            exposed = th.value is not None and not held if learner == "live" else at is not None
            cal.record(fam, run_id, "success" if ok else "failure", curve, exposed=exposed)
        if good:
            rates.append(good_aborted / good)
        if bad_steps:
            saved.append(bad_saved / bad_steps)
    return sum(rates) / len(rates), sum(saved) / max(1, len(saved))


@pytest.mark.parametrize(("alpha", "gap"), [(0.05, 0.0), (0.1, 0.3), (0.2, 0.3)])
def test_guarantee_by_simulation(alpha: float, gap: float) -> None:
    """Mean realised false-abort rate <= alpha, and clearly above 0 savings when failures score
    lower."""
    rate, saved = _simulate(alpha, gap, learner="live")
    print(f"alpha={alpha} gap={gap} mean_false_abort={rate:.4f} failing_steps_saved={saved:.3f}")
    assert rate <= alpha, rate
    if gap > 0:
        assert saved > 0.1


def test_learning_from_runs_the_rule_could_stop_breaks_the_guarantee() -> None:
    """Why exposed runs teach nothing: learning from the survivors ratchets the threshold up past
    alpha."""
    rate, _ = _simulate(0.2, 0.3, learner="censored", families=100)
    live, _ = _simulate(0.2, 0.3, learner="live", families=100)
    print(f"censored mean_false_abort={rate:.4f} live={live:.4f}")
    assert rate > 0.2 >= live


def test_the_hook_learns_from_outcomes_and_then_aborts_failing_runs() -> None:
    """In-process, no daemon: the same Calibration fed by `finish`, shared by trackers on one
    judge."""
    from agent_monitor import ProgressTracker
    from agent_monitor.testing import FakeJudge

    answer = {"letter": "P"}
    judge = FakeJudge(lambda prompt: answer["letter"])
    cal = Calibration()
    # alpha 0.2 needs 4 successful runs (ceil(1/0.2) - 1): enough evidence in a short test.
    policy = {"abort_below": "auto", "alpha": 0.2, "min_steps": 1, "patience": 2, "holdout": 0.0}

    def run(run_id: str, letter: str, outcome: str) -> list[Progress]:
        answer["letter"] = letter
        with ProgressTracker(
            "Fix the failing test",
            judge=judge,
            policy=policy,
            calibration=cal,
            family="fix",
            run_id=run_id,
        ) as tracker:
            results = []
            for i in range(5):
                p = tracker.update(f"step {i}")
                results.append(p)
                if p.signal is not None and p.signal.signal == "abort":
                    break
            assert tracker.family == Family("fix", "fake-1", tracker.rubric.hash)
            tracker.finish(outcome)
        return results

    for i in range(4):
        # before the minimum sample: a failing run goes on to the end
        bad = run(f"bad-{i}", "C", "failure")
        assert len(bad) == 5 and all(
            p.signal is not None and p.signal.signal == "continue" for p in bad
        )
        assert bad[-1].signal is not None and bad[-1].signal.abort_below is None
        assert "not calibrated yet" in (bad[-1].signal.calibration or "")
        run(f"good-{i}", "P", "success")
    th = cal.threshold(Family("fix", "fake-1", bad[-1].rubric), Policy(**policy))  # type: ignore[arg-type]
    # P = 15/19
    assert th.successes == 4 and th.failures == 4 and th.value == pytest.approx(15 / 19)
    late = run("bad-late", "C", "failure")
    assert len(late) == 2  # patience 2 from min_steps 1: aborted at step 2
    d = late[-1].signal
    assert d is not None and d.signal == "abort" and d.abort_below == pytest.approx(15 / 19)
    assert "calibrated on 4 successful runs, alpha 0.2" in d.reason
    assert run("good-late", "P", "success")[-1].signal.signal == "continue"  # type: ignore[union-attr]
    judge.close()
