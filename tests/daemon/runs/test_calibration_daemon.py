"""Calibrated aborts in the daemon: outcomes teach it over a real Mosquitto, the store keeps it, the
CLI shows it.

The scripted judge separates the family well: a run whose task says "good" scores P (15/19) at every
step, one that says "bad" scores C (2/19). Runs use alpha 0.2, which needs only ceil(1/0.2) - 1 = 4
successful runs before it gives a threshold (19 at the default 0.05): the tests stay short and the
rule is the same.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.calibration import Family, Point, Sample, min_successes
from agent_monitor.cli import main
from agent_monitor.criteria import load_criteria
from agent_monitor.daemon import MemoryStore, Monitor, MonitorConfig, SqliteStore
from agent_monitor.daemon.stores import Finished, Record
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings, ProgressOut, SignalOut
from tests.brokers import Mosquitto
from tests.daemon.test_daemon_mqtt import Harness, harness
from tests.paths import REPO

pytestmark = pytest.mark.timeout(120)

ALPHA = 0.2
NEEDED = min_successes(ALPHA)  # 4
GOOD, BAD = 15 / 19, 2 / 19
# holdout 0: every auto run here may be aborted (the default holds out ~10% of runs, picked by run
# id).
AUTO = {"abort_below": "auto", "alpha": ALPHA, "min_steps": 1, "patience": 2, "holdout": 0.0}
STEPS = 3
RUBRIC = load_criteria(None).hash  # the default rubric's


def judge(model: str = "fake-1") -> FakeJudge:
    return FakeJudge(lambda p: "P" if "good" in p.prefix_text() else "C", model=model)


def monitor(
    broker: Mosquitto, store: SqliteStore | MemoryStore, *, model: str = "fake-1", **kw: Any
) -> Monitor:
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url), client_id=f"mon-{broker.port}", **kw
    )
    return Monitor(config, judge=judge(model), store=store, registry=CollectorRegistry())


async def finished_run(h: Harness, run_id: str, kind: str, outcome: Any, **start: Any) -> None:
    """A run of the family from start to end; returns once the monitor closed it (its signal
    cleared)."""
    await h.publish(
        run_id, "start", {"task": f"a {kind} attempt ({run_id})", "family": "fix-tests", **start}
    )
    for i in range(1, STEPS + 1):
        await h.publish(run_id, "step", {"index": i, "text": f"{run_id} step {i}"})
    await h.until(lambda: h.last_step(run_id) == STEPS)
    await h.publish(run_id, "end", {"outcome": outcome})
    # cleared when the run closes, after it taught
    await h.until(lambda: None in h.seen[(run_id, "signal")])


async def failing_auto_run(h: Harness, run_id: str, **start: Any) -> None:
    """A failing run under abort_below auto, until it is told to abort or has all its steps
    scored."""
    await h.publish(
        run_id,
        "start",
        {"task": f"a bad attempt ({run_id})", "family": "fix-tests", "policy": AUTO, **start},
    )
    for i in range(1, STEPS + 1):
        await h.publish(run_id, "step", {"index": i, "text": f"{run_id} step {i}"})
    await h.until(lambda: bool(h.seen[(run_id, "signal")]) or h.last_step(run_id) == STEPS)


def decisions(h: Harness, run_id: str) -> list[dict[str, Any]]:
    return [p["decision"] for p in h.progress(run_id)]


async def test_a_well_separated_family_starts_aborting_failures_once_enough_successes_ended(
    broker: Mosquitto, tmp_path: Path
) -> None:
    store = SqliteStore(tmp_path / "runs.sqlite3")
    try:
        async with monitor(broker, store) as mon, harness(broker.port) as h:
            # Runs without "auto" teach too (numbers at or above 0.5 are successes): the family is
            # ready when a user switches to auto. The last good run ends only after the first
            # failing auto run is judged.
            for i in range(NEEDED - 1):
                await finished_run(h, f"good-{i}", "good", "success" if i % 2 else 0.9)
            await finished_run(h, "bad-0", "bad", "failure")
            await failing_auto_run(h, "early")
            assert h.seen[("early", "signal")] == [], "aborted before the family was calibrated"
            early = decisions(h, "early")
            assert len(early) == STEPS and all(
                d["signal"] == "continue" and d["abort_below"] is None for d in early
            )
            assert early[-1]["calibration"] == (
                f"not calibrated yet: {NEEDED - 1} of {NEEDED} successful runs needed at "
                "alpha 0.2; never aborts"
            )
            await h.publish("early", "end", {"outcome": "failure"})

            await finished_run(h, f"good-{NEEDED - 1}", "good", "success")
            # An end without an outcome, and a number below 0.5 (a failure), teach no success.
            await finished_run(h, "unknown", "good", None)
            await finished_run(h, "low", "good", 0.2)
            fam = Family("fix-tests", "fake-1", RUBRIC)
            await failing_auto_run(h, "late")
            signals = h.seen[("late", "signal")]
            assert [s["signal"] for s in signals] == ["abort"]
            abort = signals[0]
            assert f"calibrated on {NEEDED} successful runs, alpha 0.2" in abort["reason"]
            assert abort["step"] == 2 and abort["abort_below"] == pytest.approx(GOOD)
            assert abort["policy"]["abort_below"] == "auto" and abort["policy"]["alpha"] == ALPHA
            late = decisions(h, "late")
            assert [d["abort_below"] for d in late] == pytest.approx([GOOD, GOOD])
            assert late[-1]["calibration"] == f"calibrated on {NEEDED} successful runs, alpha 0.2"
            assert [p["score"] for p in h.progress("late")] == pytest.approx([BAD, BAD])
            # What MonitorClient users get from these payloads.
            assert SignalOut.model_validate(abort).calibration == late[-1]["calibration"]
            out = ProgressOut.model_validate(h.progress("late")[-1])
            assert out.decision is not None and out.decision.abort_below == pytest.approx(GOOD)
            th = mon.calibration.threshold(fam, Policy().with_overrides(AUTO))
            assert (th.successes, th.failures, th.value) == (NEEDED, 3, pytest.approx(GOOD))
    finally:
        await store.aclose()


async def test_only_runs_no_rule_could_stop_teach_and_held_out_runs_keep_it_learning(
    broker: Mosquitto, tmp_path: Path
) -> None:
    """Once armed, an auto run's outcome is censored (an aborted success never reports one): it
    teaches nothing.

    A held-out run is judged but never aborted by the rule; its decisions say it would have been,
    and its outcome teaches, so the calibration keeps learning without bias.
    """
    store = MemoryStore()
    async with monitor(broker, store) as mon, harness(broker.port) as h:
        for i in range(NEEDED):
            await finished_run(h, f"good-{i}", "good", "success")
        fam = Family("fix-tests", "fake-1", RUBRIC)
        policy = Policy().with_overrides(AUTO)
        assert mon.calibration.threshold(fam, policy).successes == NEEDED
        # Armed and not held out: a success that could have been aborted teaches nothing.
        await finished_run(h, "exposed", "good", "success", policy=AUTO)
        assert mon.calibration.threshold(fam, policy).successes == NEEDED
        # Held out (a share just under 1 holds out every run id): never aborted, says so, and
        # teaches.
        await failing_auto_run(h, "held", policy={**AUTO, "holdout": 0.999})
        assert h.seen[("held", "signal")] == []
        last = decisions(h, "held")[-1]
        assert last["signal"] == "continue" and last["reason"].startswith(
            "held out: would abort (score below"
        )
        assert last["abort_below"] == pytest.approx(GOOD)
        await h.publish("held", "end", {"outcome": "success"})
        await h.until(lambda: mon.calibration.threshold(fam, policy).successes == NEEDED + 1)
        # its low margin now counts
        assert mon.calibration.threshold(fam, policy).value == pytest.approx(BAD)


async def teach(
    broker: Mosquitto, store: SqliteStore | MemoryStore, *, successes: int = NEEDED
) -> float:
    """A monitor learns `successes` good runs and one failure of the family; the threshold it
    then gives."""
    async with monitor(broker, store) as mon, harness(broker.port, "teacher") as h:
        for i in range(successes):
            await finished_run(h, f"good-{i}", "good", "success")
        await finished_run(h, "bad-0", "bad", "failure")
        th = mon.calibration.threshold(
            Family("fix-tests", "fake-1", RUBRIC), Policy().with_overrides(AUTO)
        )
    assert th.value is not None
    return th.value


async def test_the_calibration_survives_a_restart(broker: Mosquitto, tmp_path: Path) -> None:
    path = tmp_path / "runs.sqlite3"
    store = SqliteStore(path)
    try:
        learnt = await teach(broker, store)
    finally:
        await store.aclose()
    store = SqliteStore(path)  # a new process would open the file afresh
    try:
        async with monitor(broker, store) as mon, harness(broker.port) as h:
            # each sample once: loaded, never learnt again
            assert len(mon.calibration) == NEEDED + 1
            await failing_auto_run(h, "after")
            (abort,) = h.seen[("after", "signal")]
            assert abort["signal"] == "abort" and abort["abort_below"] == pytest.approx(learnt)
            assert f"calibrated on {NEEDED} successful runs, alpha 0.2" in abort["reason"]
    finally:
        await store.aclose()


async def test_a_new_judge_model_or_rubric_does_not_inherit_a_threshold(broker: Mosquitto) -> None:
    store = MemoryStore()
    await teach(broker, store)
    not_yet = f"not calibrated yet: 0 of {NEEDED} successful runs needed at alpha 0.2; never aborts"
    async with monitor(broker, store, model="fake-2") as mon, harness(broker.port) as h:
        assert len(mon.calibration) == NEEDED + 1  # the evidence is there, for another judge model
        await failing_auto_run(h, "new-model")
        assert h.seen[("new-model", "signal")] == []
        assert decisions(h, "new-model")[-1]["calibration"] == not_yet
    async with monitor(broker, store) as mon, harness(broker.port) as h:
        await failing_auto_run(h, "new-rubric", criteria="coding")
        assert h.seen[("new-rubric", "signal")] == []
        assert decisions(h, "new-rubric")[-1]["calibration"] == not_yet
        # The same judge and rubric as the teacher's still aborts: only the key changed above.
        await failing_auto_run(h, "same")
        assert [s["signal"] for s in h.seen[("same", "signal")]] == ["abort"]


def samples(family: str, successes: int, failures: int, *, model: str = "fake-1") -> list[Sample]:
    """Finished runs of one family: successes dip to 0.5 at step 2 and end at 0.6 or 0.8;
    failures score 0.1."""
    out = []
    for i in range(successes + failures):
        low = 0.6 + 0.2 * (i % 2)
        scores = [0.1] * 6 if i >= successes else [0.9, 0.5, 0.9, low, low, low]
        curve = tuple(Point(step, score, 0.0) for step, score in enumerate(scores, 1))
        out.append(
            Sample(
                f"{family}-{i}", Family(family, model, RUBRIC), i < successes, curve, at=float(i)
            )
        )
    return out


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["calibration", *argv], {})
    out, err = capsys.readouterr()
    return code, out, err


async def stored(path: Path, kept: list[Sample]) -> None:
    store = SqliteStore(path)
    for s in kept:
        store.record_sample(s, 2000, 50_000)
    await store.aclose()


def test_the_calibration_command_lists_families_and_resets_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kept = [
        *samples("fix-tests", 5, 2),
        *samples("fix-tests", 1, 0, model="other-judge"),
        *samples("docs", 1, 1),
    ]
    asyncio.run(stored(tmp_path / "runs.sqlite3", kept))
    d = str(tmp_path)

    code, out, _ = cli(capsys, "--state-dir", d)
    assert code == 0
    rows = {tuple(line.split()[:2]): line for line in out.splitlines()[1:] if line.strip()}
    assert rows[("fix-tests", "fake-1")].endswith("5        2  never aborts (5 of 19 successes)")
    assert rows[("docs", "fake-1")].endswith("never aborts (1 of 19 successes)")
    assert "thresholds for alpha 0.05, min_steps 3, patience 3" in out

    # At alpha 0.2 five successes are enough: the k = floor(0.2 * 6) = 1st smallest margin, 0.6.
    code, out, _ = cli(capsys, "--state-dir", d, "--alpha", "0.2", "--json")
    got = {(r["family"], r["model"]): r for r in map(json.loads, out.splitlines())}
    assert set(got) == {("fix-tests", "fake-1"), ("fix-tests", "other-judge"), ("docs", "fake-1")}
    fix = got[("fix-tests", "fake-1")]
    assert (fix["successes"], fix["failures"], fix["needed"], fix["rubric"]) == (5, 2, 4, RUBRIC)
    assert fix["threshold"] == pytest.approx(0.6) and fix["reason"] == (
        "calibrated on 5 successful runs, alpha 0.2"
    )
    assert got[("docs", "fake-1")]["threshold"] is None
    # The step budget (every success is 6 steps long) and done (2 failures: 4 needed) from the same
    # samples.
    assert fix["step_budget"] == 6 and fix["done_above"] is None
    assert fix["done_reason"] == (
        "not calibrated yet: 2 of 4 failing runs needed at alpha 0.2; never done"
    )
    # The thresholds are the policy's: from step 2 on with patience 1, the dip at step 2 alone would
    # abort.
    code, out, _ = cli(
        capsys, "--state-dir", d, "--alpha", "0.2", "--patience", "1", "--min-steps", "2", "--json"
    )
    assert {
        r["family"]: r["threshold"]
        for r in map(json.loads, out.splitlines())
        if r["model"] == "fake-1"
    } == {
        "fix-tests": pytest.approx(0.5),
        "docs": None,
    }

    code, out, _ = cli(capsys, "--state-dir", d, "--reset", "fix-tests")
    assert code == 0 and out.startswith("deleted 8 samples of family 'fix-tests' from ")
    assert "a running agent-monitor serve keeps using them until it restarts" in out
    code, out, _ = cli(capsys, "--state-dir", d, "--json")
    assert [json.loads(line)["family"] for line in out.splitlines()] == ["docs"]
    code, _, err = cli(capsys, "--state-dir", d, "--reset", "fix-tests")
    assert (
        code == 2
        and "no family 'fix-tests' in " in err
        and ("`agent-monitor calibration` lists them") in err
    )


def test_the_calibration_command_on_an_empty_store_says_what_teaches_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli(capsys, "--state-dir", str(tmp_path))
    assert (
        code == 0
        and "no calibration samples in " in out
        and ("outcome success or failure adds one") in out
    )
    assert "if no abort rule could have stopped it" in out and "not a numeric abort_below" in out


def test_readme_docs_and_the_command_agree_on_which_runs_teach_auto() -> None:
    """Runs under a numeric abort_below are censored: the manual's evaluation and calibration
    pages and the message agree."""
    root = REPO
    readme = " ".join((root / "docs" / "evaluation.md").read_text(encoding="utf-8").split())
    docs = " ".join((root / "docs" / "calibration.md").read_text(encoding="utf-8").split())
    assert "whatever its policy" not in readme
    assert (
        "no abort rule could have stopped" in readme
        and ("runs under a numeric `abort_below`") in readme
    )
    assert "Runs under a numeric `abort_below` are exposed too, and teach nothing" in docs


class FullDisk(MemoryStore):
    """A store that cannot write a run's end while `full`: as if the daemon died between learning
    and journaling."""

    full = True

    async def journal(self, record: Record) -> None:
        if self.full and isinstance(record, Finished):
            raise OSError("the disk is full")
        await super().journal(record)


async def test_a_run_is_learnt_once_when_the_daemon_dies_between_learning_and_journaling_its_end() -> (  # noqa: E501 (the test's name is its sentence)
    None
):
    store = FullDisk()
    config = MonitorConfig(policy=Policy(min_steps=1, patience=1))
    async with Monitor(config, judge=judge(), store=store) as mon:
        await mon.handle(
            "agents/r/start", json.dumps({"task": "a good attempt", "family": "fix-tests"}).encode()
        )
        await mon.handle("agents/r/step", json.dumps({"index": 1, "text": "one"}).encode())
        await mon.handle("agents/r/end", json.dumps({"outcome": "success"}).encode())
        await asyncio.wait_for(mon.drain(), 10)
        # learnt, but its end never journaled
        assert "r" in mon.book.live and len(mon.calibration) == 1
    store.full = False  # a restarted daemon replays the run, which ends (and teaches) again
    async with Monitor(config, judge=judge(), store=store) as mon:
        await asyncio.wait_for(mon.drain(), 10)
        assert "r" not in mon.book.live
        assert [s.run_id.split("@")[0] for s in mon.calibration.samples()] == ["r"]
        assert [s.run_id.split("@")[0] for s in await store.samples()] == ["r"]


async def test_the_daemon_applies_a_learnt_step_budget_and_publishes_done(
    broker: Mosquitto,
) -> None:
    """max_steps and done_above "auto" over MQTT: outcomes teach both; a long good run gets done,
    then the budget."""
    store = MemoryStore()
    policy = {
        "max_steps": "auto",
        "done_above": "auto",
        "alpha": ALPHA,
        "min_steps": 1,
        "patience": 2,
        "holdout": 0.0,
    }
    async with monitor(broker, store), harness(broker.port) as h:
        # runs with no rule in force teach: successes 3 steps long, failures scoring C
        for i in range(NEEDED):
            await finished_run(h, f"good-{i}", "good", "success")
            await finished_run(h, f"bad-{i}", "bad", "failure")
        run = "long"
        await h.publish(
            run, "start", {"task": "a good attempt (long)", "family": "fix-tests", "policy": policy}
        )
        for i in range(1, STEPS + 3):
            await h.publish(run, "step", {"index": i, "text": f"{run} step {i}"})
        await h.until(lambda: any(s and s["signal"] == "abort" for s in h.seen[(run, "signal")]))
        signals = [s for s in h.seen[(run, "signal")] if s]
        assert [s["signal"] for s in signals] == ["done", "abort"]
        done, stop = signals
        assert done["step"] == 2 and done["reason"].startswith("done: score above")
        assert f"calibrated on {NEEDED} failing runs, alpha 0.2" in done["reason"]
        # The budget is the longest of 4 successes (3 steps) at alpha 0.2: step 4 is the first past
        # it.
        assert stop["step"] == STEPS + 1 and stop["reason"].startswith(
            f"step_budget: step 4 past the step budget of {STEPS}"
        )
        assert f"calibrated on {NEEDED} successful runs, alpha 0.2" in stop["reason"]
        assert SignalOut.model_validate(done).signal == "done"
