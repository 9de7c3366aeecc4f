"""The calibrated abort bound under the adaptive schedule: the runs that teach and the runs judged
follow one rule.

The schedule scores a run only where a decision could change (near or below a threshold in force,
every `max_gap` steps, at its end); calibration learns from the points a run was scored at, and a
family's key carries the schedule, so a threshold learnt under "every" never arms a run scored under
"adaptive".
"""

from __future__ import annotations

import random

import pytest

from agent_monitor import Policy
from agent_monitor.calibration import Calibration, Family, Point
from agent_monitor.policy import FAR, PolicyState, held_out, plan
from agent_monitor.progress import Progress
from agent_monitor.testing import FakeJudge
from agent_monitor.tracker import AsyncProgressTracker

NOISE = 0.08


def _runs(rng: random.Random, n: int, gap: float) -> list[tuple[bool, list[float]]]:
    """Exchangeable runs: a level drawn once per run, noisy steps around it; failures sit `gap`
    lower."""
    out = []
    for _ in range(n):
        ok = rng.random() < 0.5
        level = rng.uniform(0.3, 0.8) - (0 if ok else gap)
        out.append(
            (
                ok,
                [
                    min(1.0, max(0.0, level + rng.gauss(0, NOISE)))
                    for _ in range(rng.randint(6, 20))
                ],
            )
        )
    return out


def _live(state: PolicyState, scores: list[float]) -> tuple[int | None, tuple[Point, ...], int]:
    """A run stepped through as the daemon does under its schedule: (abort step, the points
    scored, scorings)."""
    last: Progress | None = None
    last_step = 0
    points = []
    for i, s in enumerate(scores, 1):
        if not plan(state, i, last=last, last_step=last_step, ending=i == len(scores)).score:
            continue
        last = Progress(step=i, score=s, uncertainty=NOISE, criteria={}, ok=True)
        last_step = i
        points.append(Point(i, s, NOISE))
        if state.observe(last).signal == "abort":
            return i, tuple(points), len(points)
    return None, tuple(points), len(points)


def _simulate(alpha: float, gap: float, families: int = 150) -> tuple[float, float, float]:
    """(mean false-abort rate over families, failing steps saved, share of steps the schedule did
    not score)."""
    rng = random.Random(4321 + int(alpha * 100))
    policy = Policy(
        abort_below="auto",
        alpha=alpha,
        min_steps=2,
        patience=2,
        max_uncertainty=1.0,
        schedule="adaptive",
    )
    rates, saved = [], []
    steps = scorings = 0
    for f in range(families):
        fam = Family.of(family=f"fam-{f}", task="t", model="m", rubric="r", schedule="adaptive")
        cal = Calibration()
        good = good_aborted = bad_steps = bad_saved = 0
        for i, (ok, scores) in enumerate(_runs(rng, 120, gap)):
            run_id = f"fam-{f}-r{i}"
            state = PolicyState(
                policy,
                threshold=lambda cal=cal, fam=fam: cal.threshold(fam, policy),  # type: ignore[misc]
                held_out=held_out(run_id, policy.holdout),
            )
            armed = cal.threshold(fam, policy).value is not None and not state.held_out
            at, points, n = _live(state, scores)
            steps += len(scores)
            scorings += n
            if armed:
                if ok:
                    good += 1
                    good_aborted += at is not None
                else:
                    bad_steps += len(scores)
                    bad_saved += len(scores) - at if at is not None else 0
            else:
                assert at is None  # unarmed or held out: never aborted
            cal.record(fam, run_id, "success" if ok else "failure", points, exposed=state.exposed)
        if good:
            rates.append(good_aborted / good)
        if bad_steps:
            saved.append(bad_saved / bad_steps)
    return sum(rates) / len(rates), sum(saved) / max(1, len(saved)), 1 - scorings / steps


@pytest.mark.parametrize("alpha", [0.1, 0.2])
def test_guarantee_by_simulation_under_the_adaptive_schedule(alpha: float) -> None:
    """Realised false-abort rate <= alpha at two alphas, with aborts that save steps and steps
    left unscored."""
    rate, saved, unscored = _simulate(alpha, gap=0.3)
    print(
        f"adaptive alpha={alpha} mean_false_abort={rate:.4f} "
        f"failing_steps_saved={saved:.3f} unscored={unscored:.3f}"
    )
    assert rate <= alpha, rate
    assert saved > 0.1  # it does abort failing runs
    assert unscored > 0.2  # and the schedule did skip steps: this is not the "every" test again


def test_an_every_family_does_not_arm_adaptive_runs() -> None:
    """Same task, judge and rubric: the schedule splits the family, so 30 successes under every
    arm nothing adaptive."""
    judge = FakeJudge(["C"])
    every = AsyncProgressTracker("fix the test", judge=judge, policy=Policy(abort_below="auto"))
    adaptive = AsyncProgressTracker(
        "fix the test", judge=judge, policy=Policy(abort_below="auto", schedule="adaptive")
    )
    assert every.family != adaptive.family
    # the "every" key is as it always was (stored families stay)
    assert every.family.rubric == every.rubric.hash
    cal = Calibration()
    pol = Policy(abort_below="auto", alpha=0.1, min_steps=1, patience=1)
    for i in range(30):
        cal.record(every.family, f"r{i}", "success", (Point(1, 0.5, 0.0), Point(2, 0.5, 0.0)))
    assert cal.threshold(every.family, pol).value is not None
    assert cal.threshold(adaptive.family, pol).value is None


def test_plan_scores_near_and_below_thresholds_and_skips_far() -> None:
    """Far above every threshold: skipped until max_gap; near or below the abort threshold:
    scored."""
    pol = Policy(abort_below=0.4, schedule="adaptive", max_gap=3, margin=2.0, min_steps=0)
    state = PolicyState(pol)

    def at(step: int, score: float, last_step: int, u: float = 0.05) -> str:
        last = Progress(step=last_step, score=score, uncertainty=u, criteria={}, ok=True)
        return plan(state, step, last=last, last_step=last_step).reason

    assert plan(state, 1, last=None, last_step=0).reason == "first"
    assert at(2, 0.9, 1) == FAR
    assert at(4, 0.9, 1) == "max_gap 3"
    assert at(2, 0.45, 1) == "near abort_below 0.4"  # 0.05 above, within 2 x 0.05
    # below it: the streak is building, every step counts
    assert at(2, 0.1, 1) == "near abort_below 0.4"
    assert at(2, 0.9, 1, u=0.2) == FAR  # 0.5 above: beyond 2 x 0.2
    # within 2 x 0.3: a less certain score is nearer
    assert at(2, 0.9, 1, u=0.3) == "near abort_below 0.4"
    assert plan(state, 2, last=None, last_step=1, ending=True).reason == "end"
    failed = Progress(step=1, score=None, uncertainty=None, criteria={}, ok=False, reason="timeout")
    assert plan(state, 2, last=failed, last_step=1).reason == "after a failure"
    assert (
        plan(PolicyState(Policy(abort_below=0.4)), 2, last=None, last_step=1).reason == "every step"
    )


def test_a_groups_pruning_line_is_a_threshold_in_force() -> None:
    """In a group, the pruning line (k-th best sibling less prune_margin) makes a step near it
    scored."""
    from agent_monitor.groups import GroupState

    g = GroupState("g", Policy(min_steps=1, patience=2, keep_top=1, prune_margin=0.2))
    for r in ("a", "b"):
        g.join(r)
    g.observe("a", step=1, score=0.8, uncertainty=0.05)
    g.observe("b", step=1, score=0.62, uncertainty=0.05)
    line = g.prune_line("b")
    assert line == pytest.approx(0.6)
    assert g.prune_line("nobody") is None and GroupState("h", Policy()).prune_line("a") is None
    state = PolicyState(Policy(schedule="adaptive", margin=2.0))
    last = Progress(step=1, score=0.62, uncertainty=0.05, criteria={}, ok=True)
    assert plan(state, 2, last=last, last_step=1, extra={"prune": line}).reason == "near prune 0.6"
    # no line in force: far from everything
    assert plan(state, 2, last=last, last_step=1).reason == FAR
