"""Groups flagged early (DAPO dynamic sampling): the per-run conformal calls, their combination,
their guarantee."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from agent_monitor.calibration import (
    NO_CALL,
    Calibration,
    Caller,
    Family,
    Point,
    Sample,
    p_fail,
    p_pass,
    pass_margin,
)
from agent_monitor.daemon import Monitor, MonitorConfig, SqliteStore
from agent_monitor.daemon.runs._groups import GroupBook
from agent_monitor.groups import GroupState
from agent_monitor.policy import Policy, PolicyError
from agent_monitor.testing import FakeJudge

FAM = Family("tasks", "judge", "rubric")
POL = Policy(min_steps=1, patience=2, max_uncertainty=1.0, uniform_confidence=0.8)


def curve(*scores: float | None) -> tuple[Point, ...]:
    return tuple(Point(i + 1, s, 0.0 if s is not None else None) for i, s in enumerate(scores))


def calibrated(successes: int = 19, failures: int = 19) -> Calibration:
    """Successes score high (0.7..0.9), failures low (0.05..0.25): the judge tells them apart."""
    cal = Calibration()
    for i in range(successes):
        s = 0.7 + 0.2 * i / max(1, successes - 1)
        cal.add(Sample(f"s{i}", FAM, True, curve(s, s, s, s)))
    for i in range(failures):
        f = 0.05 + 0.2 * i / max(1, failures - 1)
        cal.add(Sample(f"f{i}", FAM, False, curve(f, f, f, f)))
    return cal


def test_the_p_values_count_the_reference_runs_at_least_as_extreme() -> None:
    assert p_fail([0.3, 0.5, 0.7], 0.2) == pytest.approx(1 / 4)  # below every success margin
    assert p_fail([0.3, 0.5, 0.7], 0.5) == pytest.approx(3 / 4)  # ties count against the call
    assert p_fail([0.3], math.inf) == 1.0 and p_fail([], 0.0) == 1.0
    assert p_pass([0.1, 0.2, 0.4], 0.5) == pytest.approx(1 / 4)
    assert p_pass([0.1, 0.2, 0.4], 0.2) == pytest.approx(3 / 4)
    assert p_pass([0.1], -math.inf) == 1.0
    # max over windows of 2 of the window's min; a failed scoring (None) is not counted, so it
    # breaks no window.
    assert pass_margin(curve(0.2, 0.9, 0.8, 0.1), POL) == pytest.approx(0.8)
    assert pass_margin(curve(0.2, None, 0.9), POL) == pytest.approx(0.2)
    assert pass_margin(curve(0.9), POL) == -math.inf


def test_a_run_is_called_fail_or_pass_only_once_it_has_patience_counted_scores() -> None:
    caller = Caller(calibrated())
    # one counted score, patience 2: no call yet
    assert caller.calls(FAM, POL, curve(0.1)) == NO_CALL
    low = caller.calls(FAM, POL, curve(0.1, 0.1))
    assert low.fail_p == pytest.approx(1 / 20) and low.pass_p > 0.5  # a low score is no pass call
    high = caller.calls(FAM, POL, curve(0.95, 0.95))
    assert high.pass_p == pytest.approx(1 / 20) and high.fail_p == 1.0  # above every success margin
    # no evidence
    assert caller.calls(Family("other", "judge", "rubric"), POL, curve(0.1, 0.1)) == NO_CALL
    # Cached per family revision: asking again computes nothing; a new sample recomputes once.
    n = caller.recomputed
    caller.calls(FAM, POL, curve(0.1, 0.1))
    assert caller.recomputed == n
    caller.calibration.add(Sample("s-new", FAM, True, curve(0.8, 0.8)))
    assert caller.calls(FAM, POL, curve(0.1, 0.1)).fail_p == pytest.approx(1 / 21)
    assert caller.recomputed == n + 1


def _group(n: int, policy: Policy = POL) -> GroupState:
    g = GroupState("g", policy)
    for i in range(n):
        g.join(f"r{i}")
    return g


def _feed(g: GroupState, caller: Caller, run: str, scores: list[float | None]) -> None:
    pts = curve(*scores)
    for p in pts:
        g.observe(
            run, step=p.step, score=p.score, uncertainty=p.uncertainty, ok=p.score is not None
        )
    c = caller.calls(FAM, g.policy, pts)
    g.call(run, fail_p=c.fail_p, pass_p=c.pass_p)


def test_a_group_whose_runs_are_all_called_fail_is_flagged_with_the_union_bound_confidence() -> (
    None
):
    caller, g = Caller(calibrated()), _group(3)
    _feed(g, caller, "r0", [0.1, 0.1])
    _feed(g, caller, "r1", [0.1, 0.1])
    assert g.uniform() is None and "uniform" not in g.ranking()  # r2 has no call yet
    _feed(g, caller, "r2", [0.1, 0.1])
    flag = g.ranking()["uniform"]
    assert flag == {
        "call": "all_fail",
        "confidence": pytest.approx(1 - 3 / 20),
        "at_step": 2,
        "runs": 3,
    }
    assert g.live == ["r0", "r1", "r2"]  # a flag stops nothing: the trainer decides
    # A run joining later is not called yet: the flag is withdrawn until it is.
    g.join("r3")
    assert "uniform" not in g.ranking()
    _feed(g, caller, "r3", [0.15, 0.1])
    assert g.ranking()["uniform"]["call"] == "all_fail" and g.ranking()["uniform"]["runs"] == 4
    assert g.ranking()["uniform"]["at_step"] == 2


def test_all_pass_is_the_mirror_image_and_one_mixed_member_flags_nothing() -> None:
    caller, g = Caller(calibrated()), _group(3)
    for r in ("r0", "r1", "r2"):
        _feed(g, caller, r, [0.95, 0.95])
    assert g.ranking()["uniform"]["call"] == "all_pass"
    caller, g = Caller(calibrated()), _group(3)
    _feed(g, caller, "r0", [0.95, 0.95])
    _feed(g, caller, "r1", [0.1, 0.1])
    _feed(g, caller, "r2", [0.1, 0.1])
    assert g.uniform() is None  # variance: the group has a gradient, keep it


def test_the_required_confidence_needs_enough_calibration_for_the_group_size() -> None:
    # 9 successes: the best p-value is 1/10, so 3 runs give 1 - 3/10 = 0.7 < 0.8: no flag however
    # low they score.
    caller, g = Caller(calibrated(successes=9)), _group(3)
    for r in ("r0", "r1", "r2"):
        _feed(g, caller, r, [0.0, 0.0, 0.0])
    assert g.uniform() is None
    off = _group(3, Policy(min_steps=1, patience=2, max_uncertainty=1.0, uniform_confidence=None))
    caller = Caller(calibrated())
    for r in ("r0", "r1", "r2"):
        _feed(caller=caller, g=off, run=r, scores=[0.0, 0.0])
    assert off.uniform() is None  # uniform_confidence none: never flagged


def test_an_infra_or_judge_failure_in_a_member_never_flags_or_stops_the_group() -> None:
    pol = Policy(
        min_steps=1,
        patience=2,
        max_uncertainty=1.0,
        uniform_confidence=0.8,
        prune_margin=0.1,
        keep_top=1,
    )
    caller, g = Caller(calibrated()), _group(3, pol)
    _feed(g, caller, "r0", [0.1, 0.1, 0.1])
    _feed(g, caller, "r1", [0.1, 0.1, 0.1])
    # r2's judge fails on every step: no counted score is no call (p = 1), never a "fail".
    _feed(g, caller, "r2", [None, None, None])
    assert g.uniform() is None and g.members["r2"].fail_p == 1.0
    assert g.members["r2"].state == "live"  # and no prune either: a failed scoring counts nothing
    # One failed scoring amid good ones is skipped, not read as a low score.
    caller, g = Caller(calibrated()), _group(3, pol)
    for r in ("r0", "r1", "r2"):
        _feed(g, caller, r, [0.95, None, 0.95])
    assert g.ranking()["uniform"]["call"] == "all_pass"
    # A member that ends by an infrastructure failure (no pass/fail outcome) settles nothing: still
    # no flag.
    caller, g = Caller(calibrated()), _group(3, pol)
    _feed(g, caller, "r0", [0.1, 0.1])
    _feed(g, caller, "r1", [0.1, 0.1])
    g.end("r2", "unknown")
    assert g.uniform() is None
    assert all(m.state != "pruned" for m in g.members.values())


def test_an_outcome_settles_a_member_and_a_contradicting_one_withdraws_the_call() -> None:
    caller, g = Caller(calibrated()), _group(3)
    for r in ("r0", "r1"):
        _feed(g, caller, r, [0.1, 0.1])
    g.end("r2", "failure")  # known outcome: certain
    assert g.ranking()["uniform"]["call"] == "all_fail"
    assert g.members["r2"].fail_p == 0.0
    g.end("r0", "success")  # the call was wrong
    assert "uniform" not in g.ranking() and g.contradicted == "all_fail"


def test_the_book_returns_a_groups_flag_by_group_and_by_run() -> None:
    book = GroupBook(max_groups=4, max_group_runs=4, grace_s=60.0)
    caller = Caller(calibrated())
    for r in ("a", "b"):
        book.join(r, "g", POL, 0.0)
    g = book.groups["g"]
    for r in ("a", "b"):
        _feed(g, caller, r, [0.1, 0.1])
    assert book.uniform("g") == g.called and book.uniform("g") is not None
    assert book.uniform_of("a") == book.uniform("g")
    assert book.uniform("nope") is None and book.uniform_of("nope") is None


def test_the_fail_call_aborts_no_more_successes_than_its_bound() -> None:
    """Exchangeable successes: the share called fail at level a (at any step) is at most a (up to
    sampling error)."""
    rng = random.Random(7)
    pol = Policy(min_steps=0, patience=2, max_uncertainty=1.0)

    def success() -> tuple[Point, ...]:
        return curve(*(min(1.0, max(0.0, rng.gauss(0.6, 0.2))) for _ in range(8)))

    level, called, trials = 0.1, 0, 400
    for _ in range(trials):
        cal = Calibration()
        for i in range(19):
            cal.add(Sample(f"s{i}", FAM, True, success()))
        live = success()
        caller = Caller(cal)
        # Checked after every step, as the daemon does: called if any prefix gets p <= level.
        called += any(
            caller.calls(FAM, pol, live[:k]).fail_p <= level for k in range(1, len(live) + 1)
        )
    # Binomial(400, <= 0.1): mean <= 40, sd 6; 60 is more than 3 sd above.
    assert called <= 60
    assert called > 0  # and the rule does call some (it is not vacuous)


def test_uniform_confidence_is_checked() -> None:
    for bad in (0.0, 1.0, 1.5, True, "high"):
        with pytest.raises(PolicyError, match="uniform_confidence"):
            Policy(uniform_confidence=bad)  # type: ignore[arg-type]
    assert Policy().uniform_confidence == 0.9


async def test_a_flagged_group_is_flagged_again_after_a_restart(tmp_path: Path) -> None:
    """The calls come back from the journal and the stored calibration: the flag is what it was
    before."""
    db = tmp_path / "runs.sqlite3"
    config = MonitorConfig(policy=POL, circuit_threshold=1000)

    async def send(mon: Monitor, run: str, kind: str, body: dict[str, object]) -> None:
        await mon.handle(f"agents/{run}/{kind}", json.dumps(body).encode())

    async with Monitor(config, judge=FakeJudge(["C"]), store=SqliteStore(db)) as mon:
        for r in ("a", "b"):
            await send(mon, r, "start", {"task": "t", "family": "fam", "group": "g"})
        tracker = mon.tracker("a")
        assert tracker is not None
        # stored evidence (record, as an ended run teaches): it survives the restart
        for i in range(19):
            mon.calibration.record(tracker.family, f"old-s{i}", "success", curve(0.8, 0.8, 0.8))
            mon.calibration.record(tracker.family, f"old-f{i}", "failure", curve(0.2, 0.2, 0.2))
        for k in (1, 2):
            for r in ("a", "b"):
                await send(mon, r, "step", {"index": k, "text": f"{r} step {k}"})
            await mon.drain()
        before = mon.groups.uniform("g")
        assert before is not None and before["call"] == "all_fail"
    async with Monitor(config, judge=FakeJudge(["C"]), store=SqliteStore(db)) as mon:
        assert mon.groups.uniform("g") == before
