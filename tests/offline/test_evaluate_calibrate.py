"""`eval --calibrate`: recorded runs replayed through the online calibration of abort_below auto."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent_monitor.calibration import Calibration, Family, margin, min_successes, points
from agent_monitor.cli import main
from agent_monitor.offline import evaluate as ev
from agent_monitor.offline.recorded import RecordedRun, RecordedStep
from agent_monitor.policy import Policy
from agent_monitor.prompts import Prompt
from agent_monitor.scale import LETTERS
from agent_monitor.testing import FakeJudge
from agent_monitor.tracker import AsyncProgressTracker
from tests.openai_server import Reply, chat_choice, chat_reply, scripted_server

POLICY = Policy(min_steps=2, patience=2)


def curve(name: str, ok: bool | None, scores: list[float | None], family: str = "t") -> ev.RunCurve:
    outcome = None if ok is None else float(ok)
    return ev.RunCurve(
        name, outcome, scores, [0.05] * len(scores), family=Family(family, "model", "rubric")
    )


def separated(rng: random.Random, n: int, *, gap: float, family: str = "t") -> list[ev.RunCurve]:
    """Successes around 0.6, failures `gap` lower, with noise: exchangeable runs of one family."""
    out = []
    for i in range(n):
        ok = rng.random() < 0.6
        level = rng.uniform(0.45, 0.8) - (0.0 if ok else gap)
        length = rng.randint(6, 14)
        scores: list[float | None] = [
            min(1.0, max(0.0, level + rng.gauss(0, 0.06))) for _ in range(length)
        ]
        out.append(curve(f"{family}-{i}", ok, scores, family))
    return out


def test_a_judge_that_separates_aborts_failures_and_keeps_false_aborts_within_alpha() -> None:
    # The bound is an average over runs too: four families of 80, each run held out (or not) by its
    # name.
    rng = random.Random(7)
    curves = [c for fam in "abcd" for c in separated(rng, 80, gap=0.35, family=fam)]
    report = ev.calibrate(curves, policy=dataclasses.replace(POLICY, alpha=0.1), orders=100, seed=3)
    spreads = report.spreads
    assert report.never_aborts is None and not report.no_better_than_chance
    fail, succ = report.armed_abort_shares
    assert fail is not None and succ is not None and fail > 3 * succ
    fa = spreads["false_abort_rate_armed"]
    saved = spreads["steps_saved"]
    assert fa is not None and fa.mean <= 0.1 and fa.orders == 101
    assert saved is not None and saved.mean > 0.3  # failing runs are stopped early
    # Not one abort before the family had its minimum of successful runs.
    first = [o.successes_before_first_abort for o in report.orders]
    assert all(s is not None and s >= min_successes(0.1) for s in first)
    text = ev.calibrate_summary(report)
    assert "verdict: aborts runs in" in text and "never aborts" not in text
    assert re.search(r"false-abort rate \(successes judged while armed\)\s+\S+\s+\d", text)
    assert all(f.threshold.value is not None and f.failures_aborted > 0 for f in report.families)
    # Once armed, only the held-out runs (never aborted) teach: an exposed run's outcome is
    # censored.
    assert all(
        r.taught == (not r.armed) for o in report.orders for r in o.runs if r.success is not None
    )


def test_a_judge_with_no_signal_never_aborts() -> None:
    # Every run's curve is the same constant: the threshold is that constant, and nothing is ever
    # below it.
    flat = [curve(f"r{i}", i % 3 != 0, [0.42] * 8) for i in range(60)]
    report = ev.calibrate(flat, policy=POLICY, orders=50)
    assert report.never_aborts is not None and "aborted none" in report.never_aborts
    assert all(o.aborts == 0 and o.runs_armed > 0 for o in report.orders)
    text = ev.calibrate_summary(report)
    assert "verdict: never aborts: armed for" in text
    assert "aborts 0 of its 20 failing runs (in-sample); never aborts them in effect" in text
    assert ev.calibrate_json(report)["never_aborts"] == report.never_aborts


def test_scores_independent_of_the_outcome_are_flagged_as_no_better_than_chance() -> None:
    # Each failing run's curve is a successful run's: the judge cannot tell them apart.
    rng = random.Random(11)
    twins = []
    for i in range(40):
        scores: list[float | None] = [rng.uniform(0.2, 0.8) for _ in range(8)]
        twins += [curve(f"ok-{i}", True, scores), curve(f"bad-{i}", False, list(scores))]
    rng.shuffle(twins)
    report = ev.calibrate(twins, policy=dataclasses.replace(POLICY, alpha=0.2), orders=100, seed=5)
    fail, succ = report.armed_abort_shares
    assert report.never_aborts is None and report.no_better_than_chance
    assert fail is not None and succ is not None and 0 < fail <= succ
    assert "no better than chance" in ev.calibrate_summary(report)


def test_too_few_successes_never_aborts_and_names_the_minimum() -> None:
    rng = random.Random(2)
    curves = [c for fam in ("a", "b", "c") for c in separated(rng, 12, gap=0.4, family=fam)]
    best = max(
        sum(c.success is True for c in curves if c.family and c.family.name == f) for f in "abc"
    )
    assert best < 19
    report = ev.calibrate(curves, policy=POLICY, orders=20)
    assert report.never_aborts is not None
    assert report.never_aborts.startswith(
        f"no family reached 19 successful runs at alpha 0.05 (most: {best}, "
    )
    assert all(o.runs_armed == 0 for o in report.orders)
    text = ev.calibrate_summary(report)
    assert "verdict: never aborts: no family reached 19 successful runs" in text
    # every family: never aborts, no threshold printed
    assert text.count("of 19 successful runs needed)") == 3
    # The same runs pooled into one family reach the minimum: armed, with the note that pooling
    # breaks the bound.
    pooled = ev.calibrate(curves, policy=POLICY, orders=20, family_by="all")
    assert any(o.runs_armed for o in pooled.orders)
    assert "--family-by all pools different tasks" in ev.calibrate_summary(pooled)


def test_unknown_outcomes_are_judged_but_teach_nothing() -> None:
    rng = random.Random(4)
    curves = [*separated(rng, 40, gap=0.4), curve("unknown", None, [0.0] * 8)]
    report = ev.calibrate(curves, policy=dataclasses.replace(POLICY, alpha=0.2), orders=0)
    (fam,) = report.families
    assert fam.threshold.successes + fam.threshold.failures == report.recorded.runs_taught
    last = report.recorded.runs[-1]
    assert (
        last.success is None
        and last.armed
        and last.abort_step == POLICY.min_steps + POLICY.patience - 1
    )
    assert not last.taught and fam.failing == sum(r.success is False for r in report.recorded.runs)


async def test_the_replay_makes_the_live_trackers_decisions() -> None:
    """The hook, fed the same runs one after another with a shared Calibration, aborts at the
    same steps."""
    rng = random.Random(9)
    table: dict[str, list[str]] = {}
    recorded = []
    for i in range(30):
        ok = rng.random() < 0.6
        letters = [
            LETTERS[rng.randint(6, 19) if ok else rng.randint(0, 10)]
            for _ in range(rng.randint(5, 10))
        ]
        table[f"run-{i}"] = letters
        task = f"task {'AB'[i % 2]}"  # two families, by task
        steps = tuple(RecordedStep(f"run-{i} step {k}") for k in range(len(letters)))
        recorded.append(RecordedRun(f"run-{i}", task, steps, 1.0 if ok else 0.0))

    def answer(prompt: Prompt) -> str:
        run = re.search(r"run-\d+", prompt.prefix_text()).group(0)  # type: ignore[union-attr]
        return table[run][prompt.step - 1]

    judge = FakeJudge(answer)
    policy = Policy(abort_below="auto", alpha=0.2, min_steps=2, patience=2)
    curves = await ev.score_runs(recorded, judge=judge)
    judged, _ = ev.replay_online(curves, range(len(curves)), policy=policy)

    calibration = Calibration()
    live: list[tuple[float | None, int | None, bool]] = []
    for run in recorded:
        tracker = AsyncProgressTracker(
            run.task, judge=judge, policy=policy, calibration=calibration, run_id=run.name
        )
        at, threshold = None, None
        # the harness goes on after an abort: the replay teaches the whole curve
        for step in run.steps:
            p = await tracker.update(step.text)
            assert p.signal is not None
            threshold = p.signal.abort_below
            if p.signal.signal == "abort" and at is None:
                at = p.step
        taught = tracker.finish("success" if run.outcome else "failure") is not None
        live.append((threshold, at, taught))
    assert [(j.threshold, j.abort_step, j.taught) for j in judged] == live
    # the comparison covers aborts, not only continues
    assert sum(at is not None for _, at, _ in live) >= 3
    # and a held-out run teaching while armed
    assert any(taught for t, _, taught in live if t is not None)
    # And both are the rule itself: armed, a run is aborted exactly when its margin is below the
    # threshold.
    for j, c in zip(judged, curves, strict=True):
        if j.armed:
            assert (j.abort_step is not None) == (
                margin(points(ev.progress(c)), policy) < j.threshold
            )


def test_eval_calibrate_command(tmp_path: Path) -> None:
    data = tmp_path / "runs"
    data.mkdir()
    rng = random.Random(1)
    grades: dict[str, list[str]] = {}
    for i in range(24):
        ok = i % 3 != 0
        name = f"run-{i:02d}-{'good' if ok else 'doomed'}"  # recorded order: by name
        grades[name] = [LETTERS[rng.randint(8, 19) if ok else rng.randint(0, 6)] for _ in range(6)]
        steps = [f"{name} step {k}" for k in range(6)]
        (data / f"{name}.json").write_text(
            json.dumps({"task": "one task", "steps": steps, "outcome": float(ok)})
        )

    def reply(body: dict[str, Any]) -> Reply:
        text = json.dumps(body)
        n = int(re.search(r"has (\d+) steps? so far", text).group(1))  # type: ignore[union-attr]
        name = re.search(r"run-\d+-(good|doomed)", text).group(0)  # type: ignore[union-attr]
        letter = grades[name][n - 1]
        return chat_reply(chat_choice([(letter, {letter: 1.0})]))

    out = tmp_path / "out"
    with scripted_server() as server:
        server.default = reply
        cmd = [
            sys.executable,
            "-m",
            "agent_monitor",
            "eval",
            str(data),
            "--judge",
            "openai",
            "--judge-url",
            server.url,
            "--out",
            str(out),
            "--min-steps",
            "2",
            "--patience",
            "2",
            "--calibrate",
            "--alpha",
            "0.2",
            "--orders",
            "30",
            "--seed",
            "4",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "AUROC" in done.stdout  # the plain report, then the calibration's
    assert "online calibration (abort_below auto): 24 runs (16 success, 8 failure)" in done.stdout
    assert "the recorded order and 30 random orders (seed 4)" in done.stdout
    report = json.loads((out / "eval_calibrate.json").read_text())
    assert (
        report["policy"]["alpha"] == 0.2
        and report["min_successes"] == 4
        and len(report["random"]) == 30
    )
    assert report["never_aborts"] is None and report["recorded"]["aborted_failures"] > 0
    assert [f["family"] for f in report["families"]] == ["one task"]


def test_eval_says_what_to_do_with_auto_and_with_a_number_under_calibrate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"task": "t", "steps": ["a"], "outcome": 1.0}))
    base = [
        "eval",
        str(run),
        "--judge",
        "openai",
        "--judge-url",
        "http://127.0.0.1:9/v1",
        "--out",
        str(tmp_path),
    ]
    # Refused before any judge is reached (nothing listens on port 9).
    assert main([*base, "--abort-below", "auto"], environ={}) == 2
    assert "needs eval --calibrate --alpha A" in capsys.readouterr().err
    assert main([*base, "--calibrate", "--abort-below", "0.3"], environ={}) == 2
    assert "drop --abort-below 0.3" in capsys.readouterr().err
