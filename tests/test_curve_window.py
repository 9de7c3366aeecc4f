"""A tracker's curve is a bounded window; its summary and points cover the whole run (issue 14
part 3)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from agent_monitor import AsyncProgressTracker, Calibration, Policy, Progress, ProgressTracker
from agent_monitor.calibration import margin, points
from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.daemon.stores._store import SqliteStore
from agent_monitor.testing import Answer, FakeJudge
from agent_monitor.tracker import DEFAULT_CURVE_WINDOW
from agent_monitor.wire import Topics

WINDOW = 5
STEPS = 10 * WINDOW


def answers(n: int) -> list[Answer]:
    """A long run's answers: a wandering score, some failed calls, some very uncertain answers."""
    out: list[Answer] = []
    for i in range(1, n + 1):
        if i % 7 == 0:
            out.append(FakeJudge.failure("timeout"))
        elif i % 11 == 0:
            out.append({"A": 0.5, "T": 0.5})  # uncertainty 0.5: not counted by the policy
        else:
            out.append("ABCDEFGHIJKLMNOPQRST"[(i * 7) % 20])
    return out


async def run(
    window: int, calibration: Calibration, policy: Policy
) -> tuple[AsyncProgressTracker, list[Progress]]:
    judge = FakeJudge(answers(STEPS), record=False)
    tracker = AsyncProgressTracker(
        "count to fifty",
        judge=judge,
        curve_window=window,
        calibration=calibration,
        policy=policy,
        run_id="r",
    )
    results = [await tracker.update(f"step {i}") for i in range(1, STEPS + 1)]
    return tracker, results


async def test_a_run_ten_times_the_window_keeps_the_window_and_summarises_the_rest() -> None:
    policy = Policy(abort_below="auto", min_steps=2, patience=2)
    tracker, results = await run(WINDOW, Calibration(), policy)
    assert [p.step for p in tracker.curve] == list(range(STEPS - WINDOW + 1, STEPS + 1))
    assert tracker.curve == results[-WINDOW:]
    ok = [p for p in results if p.ok]
    # the script has failures: the summary must tell them apart
    assert ok and len(ok) < len(results)
    s = tracker.summary
    assert (s.results, s.scored, s.failed) == (STEPS, len(ok), STEPS - len(ok))
    assert s.first is results[0] and s.last is results[-1] is tracker.latest
    assert s.last_ok is ok[-1]
    best = max(ok, key=lambda p: (p.score, -p.step))
    low = min(ok, key=lambda p: (p.score, p.step))
    assert (s.best_score, s.best_step) == (best.score, best.step)
    assert (s.min_score, s.min_step) == (low.score, low.step)
    assert s.mean == pytest.approx(sum(p.score for p in ok if p.score is not None) / len(ok))
    assert s.signal_changes == sum(1 for p in results if p.signal is not None and p.signal.changed)
    # Every result's point is kept, as calibration reads a full curve.
    assert tracker.points == points(results)
    assert len(tracker.points) == STEPS


async def test_calibration_learns_the_same_margin_from_a_windowed_run_as_from_its_full_curve() -> (
    None
):
    policy = Policy(abort_below="auto", min_steps=2, patience=2)
    small, big = Calibration(), Calibration()
    windowed, results = await run(WINDOW, small, policy)
    full, _ = await run(STEPS, big, policy)
    a, b = windowed.finish("success"), full.finish("success")
    assert a is not None and b is not None
    assert a.curve == b.curve == points(results)
    m = margin(points(results), policy)
    assert math.isfinite(m)  # the run has enough counted scores for the margin to mean something
    assert margin(a.curve, policy) == margin(b.curve, policy) == m
    assert small.margins(windowed.family, policy) == big.margins(full.family, policy) == [m]


async def test_out_of_order_results_keep_step_order_in_window_points_and_summary() -> None:
    tracker = AsyncProgressTracker("t", judge=FakeJudge(["C", "K", "T", "E"]), curve_window=3)
    for i in range(1, 5):
        await tracker.add(f"step {i}")
    for n in (2, 4, 1, 3):  # scored out of order, as slow concurrent updates finish
        await tracker.score(n)
    assert [p.step for p in tracker.curve] == [2, 3, 4]
    assert [p.step for p in tracker.points] == [1, 2, 3, 4]
    assert tracker.summary.first is not None and tracker.summary.first.step == 1
    assert (
        tracker.summary.last is tracker.latest
        and tracker.latest is not None
        and tracker.latest.step == 4
    )


def test_the_sync_tracker_has_the_window_summary_and_points() -> None:
    with ProgressTracker("t", judge=FakeJudge(), curve_window=2) as tracker:
        for i in range(1, 6):
            tracker.update(f"step {i}")
        assert [p.step for p in tracker.curve] == [4, 5]
        assert tracker.summary.results == 5 and [p.step for p in tracker.points] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_window_says_what_to_use(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"curve_window={bad!r}; use a number of results >= 1"):
        AsyncProgressTracker("t", judge=FakeJudge(), curve_window=bad)  # type: ignore[arg-type]


async def test_the_daemon_keeps_a_window_and_export_gives_every_step(tmp_path: Path) -> None:
    steps = DEFAULT_CURVE_WINDOW + 30
    judge = FakeJudge(record=False)
    store = SqliteStore(tmp_path / "s.db")
    topics = Topics("agents")
    async with Monitor(MonitorConfig(), judge=judge, store=store) as mon:
        await mon.handle(topics.of("long", "start"), json.dumps({"task": "a long run"}).encode())
        for i in range(1, steps + 1):
            await mon.handle(
                topics.of("long", "step"), json.dumps({"index": i, "text": f"step {i}"}).encode()
            )
            await mon.drain()  # one scoring per step: every step has its own result
        view = mon.run("long")
        assert view is not None
        assert [p.step for p in view.curve] == list(
            range(steps - DEFAULT_CURVE_WINDOW + 1, steps + 1)
        )
        await mon.handle(topics.of("long", "end"), json.dumps({"outcome": "success"}).encode())
        await mon.drain()
    exported = await store.export("long")
    await store.aclose()
    assert exported is not None
    assert [p["step"] for p in exported["curve"]] == list(range(1, steps + 1))
    assert [s["index"] for s in exported["steps"]] == list(range(1, steps + 1))


async def test_a_restored_long_run_has_its_window_and_the_whole_runs_summary(
    tmp_path: Path,
) -> None:
    steps = DEFAULT_CURVE_WINDOW + 20
    judge = FakeJudge(record=False)
    topics = Topics("agents")
    store = SqliteStore(tmp_path / "s.db")
    async with Monitor(MonitorConfig(), judge=judge, store=store) as mon:
        await mon.handle(topics.of("long", "start"), json.dumps({"task": "a long run"}).encode())
        for i in range(1, steps + 1):
            await mon.handle(
                topics.of("long", "step"), json.dumps({"index": i, "text": f"step {i}"}).encode()
            )
            await mon.drain()
        before = mon.tracker("long")
        assert before is not None
        summary, pts = before.summary, before.points
    await store.aclose()
    store = SqliteStore(tmp_path / "s.db")
    async with Monitor(MonitorConfig(), judge=judge, store=store) as mon:
        tracker, view = mon.tracker("long"), mon.run("long")
        assert tracker is not None and view is not None
        assert len(tracker.curve) == DEFAULT_CURVE_WINDOW and tracker.curve[-1].step == steps
        assert tracker.points == pts
        assert (tracker.summary.results, tracker.summary.best_step, tracker.summary.mean) == (
            summary.results,
            summary.best_step,
            summary.mean,
        )
        assert view.last_ok is not None and view.last_ok.step == steps and view.scored == steps
    await store.aclose()
