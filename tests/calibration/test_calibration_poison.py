"""Calibration an honest fast harness cannot break and a publisher cannot steer (issue 27, item
2)."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor import Policy
from agent_monitor.calibration import (
    Calibration,
    Family,
    Point,
    min_successes,
    outcome_authentic,
    outcome_mac,
    stratum,
)
from agent_monitor.daemon import MemoryStore, Monitor, MonitorConfig
from agent_monitor.policy import PolicyState, held_out
from agent_monitor.progress import Progress
from agent_monitor.testing import FakeJudge
from tests.brokers import Mosquitto

FAM = Family("fam", "m", "r")
AUTO: dict[str, Any] = {"abort_below": "auto", "holdout": 0.0}
SECRET = "a-long-shared-secret-for-tests"


def _curve(scores: list[float]) -> tuple[Point, ...]:
    return tuple(Point(i, s, 0.1) for i, s in enumerate(scores, 1))


def j(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def test_successes_with_fewer_counted_scores_than_patience_teach_nothing_and_never_arm() -> None:
    cal = Calibration()
    policy = Policy(abort_below="auto", min_steps=3, patience=3)
    for i in range(50):
        cal.record(FAM, f"empty-{i}", "success", ())  # start + end, no step
        # 2 counted scores from step 3: no window
        cal.record(FAM, f"short-{i}", "success", _curve([0.9] * 4))
    th = cal.threshold(FAM, policy)
    # before: 100 infinite margins, threshold 1.0 (aborts all)
    assert th.value is None and th.successes == 0
    assert "0 of 19" in th.reason


async def _run(
    mon: Monitor,
    run_id: str,
    letters: int,
    outcome: str | None,
    *,
    started: float | None = None,
    auth: str | None = None,
    family: str = "fast",
) -> None:
    start: dict[str, Any] = {"task": "fix it", "family": family, "policy": AUTO}
    if started is not None:
        start["started_at"] = started
    await mon.handle(f"agents/{run_id}/start", j(**start))
    for i in range(1, letters + 1):
        await mon.handle(f"agents/{run_id}/step", j(index=i, text=f"s{i}"))
        await mon.drain()
    end: dict[str, Any] = {} if outcome is None else {"outcome": outcome}
    if auth is not None:
        end["auth"] = auth
    await mon.handle(f"agents/{run_id}/end", j(**end))
    await mon.drain()


async def test_nineteen_empty_successes_do_not_abort_the_next_honest_run() -> None:
    judge = FakeJudge(["K"])  # an honest run at 10/19 = 0.53
    async with Monitor(judge=judge, store=MemoryStore()) as mon:
        for i in range(25):
            await _run(mon, f"fake-{i}", 0, "success")
        await mon.handle("agents/honest/start", j(task="fix it", family="fast", policy=AUTO))
        for i in range(1, 8):
            await mon.handle("agents/honest/step", j(index=i, text=f"s{i}"))
            await mon.drain()
        view = mon.run("honest")
        # before: aborted at the third counted score
        assert view is not None and view.signal == "continue"


async def test_with_an_outcome_secret_400_unauthenticated_successes_do_not_move_the_threshold() -> (
    None
):
    reg = CollectorRegistry()
    judge = FakeJudge(lambda p: "K" if "genuine" in p.text() else "T")
    config = MonitorConfig(
        outcome_secret=SECRET,
        calibration_rate=10_000,
        policy=Policy(min_steps=1, patience=1),
    )
    async with Monitor(config, judge=judge, store=MemoryStore(), registry=reg) as mon:
        # Runs with no abort rule teach (nothing could have stopped them): the attacker's would too.
        now = time.time()
        for i in range(20):
            started = now - 100 + i  # fresh: within --signature-max-age
            mac = outcome_mac(SECRET, f"g{i}", started, "success")
            await mon.handle(
                f"agents/g{i}/start", j(task="genuine", family="f", started_at=started)
            )
            await mon.handle(f"agents/g{i}/step", j(index=1, text="genuine work"))
            await mon.drain()
            await mon.handle(f"agents/g{i}/end", j(outcome="success", auth=mac))
            await mon.drain()
        fam = next(f.family for f in mon.calibration.families())
        policy = Policy(abort_below="auto", min_steps=1, patience=1)
        before = mon.calibration.threshold(fam, policy)
        assert before.successes == 20 and before.value == pytest.approx(10 / 19)
        for i in range(400):
            # Fake successes scoring T (1.0): each would raise the threshold; half carry a wrong or
            # replayed MAC.
            auth = None if i % 2 else outcome_mac(SECRET, "g0", now - 100, "success")
            await mon.handle(f"agents/x{i}/start", j(task="genuine", family="f", started_at=5.0))
            await mon.handle(f"agents/x{i}/step", j(index=1, text="fake"))
            await mon.drain()
            end = {"outcome": "success"} | ({"auth": auth} if auth else {})
            await mon.handle(f"agents/x{i}/end", j(**end))
            await mon.drain()
        after = mon.calibration.threshold(fam, policy)
        assert (after.value, after.successes) == (before.value, before.successes)
        assert (
            reg.get_sample_value(
                "agent_monitor_outcomes_refused_total", {"reason": "unauthenticated"}
            )
            == 400
        )


async def test_without_a_secret_a_family_learns_at_most_its_rate() -> None:
    reg = CollectorRegistry()
    now = [1000.0]
    config = MonitorConfig(calibration_rate=5, policy=Policy(min_steps=1, patience=1))
    async with Monitor(
        config, judge=FakeJudge(["T"]), store=MemoryStore(), registry=reg, clock=lambda: now[0]
    ) as mon:
        for i in range(12):
            await _run(mon, f"r{i}", 1, "success")
        assert len(mon.calibration) == 5
        assert reg.get_sample_value("agent_monitor_outcomes_refused_total", {"reason": "rate"}) == 7
        now[0] += 61
        await _run(mon, "later", 1, "success")
        assert len(mon.calibration) == 6


def test_the_outcome_mac_binds_run_id_start_time_and_outcome() -> None:
    mac = outcome_mac(SECRET, "r1", 1700000000.5, "success")
    assert outcome_authentic(SECRET, "r1", 1700000000.5, "success", mac)
    assert not outcome_authentic(SECRET, "r2", 1700000000.5, "success", mac)  # another run
    # the same id, a later run
    assert not outcome_authentic(SECRET, "r1", 1700000001.5, "success", mac)
    assert not outcome_authentic(SECRET, "r1", 1700000000.5, "failure", mac)
    assert not outcome_authentic("another-secret-of-16+", "r1", 1700000000.5, "success", mac)
    assert outcome_authentic(SECRET, "r1", None, 0.75, outcome_mac(SECRET, "r1", None, 0.75))


# -- the length-stratified bound, by simulation --


def _run_curve(rng: random.Random, ok: bool, scores: int, gap: float) -> tuple[Point, ...]:
    level = rng.uniform(0.3, 0.8) - (0 if ok else gap)
    # Longer runs drift down a little (more windows, lower margins): what makes lengths matter.
    return _curve([min(1.0, max(0.0, level + rng.gauss(0, 0.08))) for _ in range(scores)])


def _simulate(alpha: float, strata: int, lengths: str, families: int = 120) -> float:
    """Mean false-abort rate of live successes, judged step by step as the tracker does (threshold
    per stratum).

    lengths "random": each run's scoring count is drawn independently (steps coalesce at random:
    exchangeable); "shift": the family's first 40 runs are a fast harness's (3-5 scores: coalesced),
    the rest a slow judge's (8-20 scores). Calibration learns online from runs no rule could stop.
    """
    rng = random.Random(7 + strata + int(alpha * 100) + len(lengths))
    policy = Policy(
        abort_below="auto", alpha=alpha, min_steps=1, patience=3, max_uncertainty=1.0, holdout=0.1
    )
    rates = []
    for f in range(families):
        fam = Family(f"fam-{f}", "m", "r")
        cal = Calibration(strata=strata)
        good = aborted = 0
        for i in range(120):
            ok = rng.random() < 0.5
            if lengths == "random":
                n = rng.choice([3, 4, 5, 8, 12, 16, 20])
            else:
                n = rng.randint(3, 5) if i < 40 else rng.randint(8, 20)
            curve = _run_curve(rng, ok, n, 0.3)
            run_id = f"{f}-{i}"
            box: list[PolicyState] = []

            def threshold(
                cal: Calibration = cal, fam: Family = fam, box: list[PolicyState] = box
            ) -> Any:
                return cal.threshold(fam, policy, counted=box[0].counted + 1)

            state = PolicyState(
                policy, threshold=threshold, held_out=held_out(run_id, policy.holdout)
            )
            box.append(state)
            stopped = False
            for p in curve:
                prog = Progress(
                    step=p.step, score=p.score, uncertainty=p.uncertainty, criteria={}, ok=True
                )
                if state.observe(prog).signal == "abort":
                    stopped = True
                    break
            if ok and not state.held_out and i >= 40:
                good += 1
                aborted += stopped
            cal.record(fam, run_id, "success" if ok else "failure", curve, exposed=state.exposed)
        if good:
            rates.append(aborted / good)
    return sum(rates) / len(rates)


@pytest.mark.parametrize("alpha", [0.1, 0.2])
def test_honest_fast_harnesses_keep_the_false_abort_rate_at_most_alpha(alpha: float) -> None:
    random_lengths = _simulate(alpha, 1, "random")
    shifted = _simulate(alpha, 3, "shift")
    print(
        f"alpha={alpha} random lengths, 1 stratum: {random_lengths:.4f}; shift, 3 strata: "
        f"{shifted:.4f}"
    )
    assert random_lengths <= alpha
    assert shifted <= alpha
    # Why strata: without them, calibration on the fast phase over-aborts the slow phase's
    # successes.
    assert _simulate(alpha, 1, "shift", families=60) > alpha


def test_strata_are_doubling_ranges_of_counted_scores() -> None:
    assert [stratum(n, 3, 3) for n in (3, 5, 6, 11, 12, 100)] == [0, 0, 1, 1, 2, 2]
    assert stratum(100, 3, 1) == 0
    # A live run is judged by the smallest threshold of the strata it can still end in; none while
    # one is short.
    cal = Calibration(strata=2)
    policy = Policy(abort_below="auto", alpha=0.2, min_steps=1, patience=2)
    for i in range(min_successes(0.2)):
        cal.record(FAM, f"short-{i}", "success", _curve([0.8, 0.8, 0.8]))
    assert cal.threshold(FAM, policy, counted=2).value is None  # longer runs not calibrated yet
    assert "4+ counted scores" in cal.threshold(FAM, policy, counted=2).reason
    for i in range(min_successes(0.2)):
        cal.record(FAM, f"long-{i}", "success", _curve([0.6] * 8))
    assert cal.threshold(FAM, policy, counted=2).value == pytest.approx(0.6)  # min(0.8, 0.6)
    assert cal.threshold(FAM, policy, counted=5).value == pytest.approx(0.6)


async def test_monitor_client_signs_outcomes_over_a_real_broker(broker: Mosquitto) -> None:
    import asyncio

    from agent_monitor.wire import BrokerSettings, MonitorClient

    reg = CollectorRegistry()
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        outcome_secret=SECRET,
        policy=Policy(min_steps=1, patience=1),
    )

    def harness(secret: str | None, run_id: str) -> None:
        with MonitorClient(broker.url, outcome_secret=secret) as client:
            run = client.start_run(run_id, task="fix it", family="signed")
            run.step("did it")
            run.wait_progress(1)
            run.end("success")

    async with Monitor(config, judge=FakeJudge(["P"]), registry=reg) as mon:
        await asyncio.to_thread(harness, SECRET, "signed-1")
        await asyncio.to_thread(harness, None, "unsigned-1")
        refused = {"reason": "unauthenticated"}
        for _ in range(200):
            if len(mon.calibration) and reg.get_sample_value(
                "agent_monitor_outcomes_refused_total", refused
            ):
                break
            await asyncio.sleep(0.05)
        assert [s.run_id.split("@")[0] for s in mon.calibration.samples()] == ["signed-1"]
        assert reg.get_sample_value("agent_monitor_outcomes_refused_total", refused) == 1
