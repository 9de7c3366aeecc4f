"""Evaluate-and-tune: metrics on scripted judges with known answers, the cache, the CLI; replay
to a broker."""

from __future__ import annotations

import asyncio
import csv
import json
import re
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from agent_monitor.cli._replay import replay, run_id_for, schedule
from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.offline import evaluate as ev
from agent_monitor.offline.recorded import RecordedRun, RecordedStep
from agent_monitor.policy import Policy
from agent_monitor.prompts import Prompt
from agent_monitor.scale import LETTERS
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings, MonitorClient
from tests.brokers import Mosquitto
from tests.openai_server import Reply, chat_choice, chat_reply, scripted_server
from tests.paths import REPO

FAIL_LETTERS = "BBAAAAAA"


def known_answer(prompt: Prompt) -> str:
    """Good runs climb one letter per step; bad runs sit at B, then fall to A."""
    if "doomed" in prompt.prefix_text():
        return FAIL_LETTERS[min(prompt.step, 8) - 1]
    return LETTERS[min(prompt.step, 19)]


def runs(n: int = 4, steps: int = 8) -> list[RecordedRun]:
    out = []
    for i in range(n):
        out.append(
            RecordedRun(
                f"good-{i}",
                f"good task {i}",
                tuple(RecordedStep(f"g{i} step {k}") for k in range(steps)),
                1.0,
            )
        )
        out.append(
            RecordedRun(
                f"bad-{i}",
                f"doomed task {i}",
                tuple(RecordedStep(f"b{i} step {k}") for k in range(steps)),
                0.0,
            )
        )
    return out


def test_auroc_and_spearman_on_known_values() -> None:
    assert ev.auroc([0.9, 0.8, 0.2, 0.1], [True, True, False, False]) == 1.0
    assert ev.auroc([0.1, 0.2, 0.8, 0.9], [True, True, False, False]) == 0.0
    assert ev.auroc([0.5, 0.5], [True, False]) == 0.5
    assert ev.auroc([0.5], [True]) is None
    assert ev.spearman([1, 2, 3, 4], [0.1, 0.2, 0.3, 0.9]) == pytest.approx(1.0)
    assert ev.spearman([1, 2, 3, 4], [0.9, 0.3, 0.2, 0.1]) == pytest.approx(-1.0)
    assert ev.spearman([1, 2, 3], [0.5, 0.5, 0.5]) is None


async def test_scores_metrics_sweep_and_recommendation_with_known_answers(tmp_path: Path) -> None:
    judge = FakeJudge(known_answer)
    cache = ev.ScoreCache(tmp_path / "cache.sqlite3")
    curves = await ev.score_runs(runs(), judge=judge, cache=cache)
    calls = len(judge.prompts)
    assert calls == 64 and all(len(c.scores) == 8 for c in curves)
    report = ev.evaluate(curves, policy=Policy(min_steps=3, patience=2), max_false_abort=0.05)
    assert report.auroc == {0.25: 1.0, 0.5: 1.0, 0.75: 1.0}
    assert report.spearman["success"] == pytest.approx(1.0)
    assert report.spearman["failure"] is not None and report.spearman["failure"] < -0.5
    by_t = {r.threshold: r for r in report.sweep}
    # Bad runs score 0 from step 3: aborted at step 4 (patience 2) by any threshold, saving half
    # their steps.
    assert all(r.steps_saved == pytest.approx(0.5) for r in report.sweep)
    # Good runs score 3/19 = 0.158 and 4/19 at steps 3-4: a threshold of 0.25 aborts all of them.
    assert by_t[0.15].false_abort_rate == 0.0 and by_t[0.25].false_abort_rate == 1.0
    # The most saved within 5% false aborts, at the lowest such threshold.
    assert report.recommended is not None and report.recommended.threshold == 0.05
    assert "recommended: --abort-below 0.05" in ev.summary(report)
    # Written: CSVs, PNG.
    files = ev.write_csv(report, tmp_path)
    rows = list(csv.DictReader(files[0].open()))
    assert len(rows) == 64 and rows[0]["run"] == "good-0"
    png = ev.plot(report, tmp_path / "eval.png")
    assert png.read_bytes().startswith(b"\x89PNG")
    # Resumable: the same runs again cost no judge call.
    again = await ev.score_runs(runs(), judge=judge, cache=cache)
    assert len(judge.prompts) == calls and [c.scores for c in again] == [c.scores for c in curves]
    assert sum(c.cached for c in again) == 64
    cache.close()


def test_eval_command_end_to_end_with_an_http_judge(tmp_path: Path) -> None:
    data = tmp_path / "runs"
    data.mkdir()
    for r in runs(2, 6):
        (data / f"{r.name}.json").write_text(
            json.dumps({"task": r.task, "steps": [s.text for s in r.steps], "outcome": r.outcome})
        )

    def reply(body: dict[str, Any]) -> Reply:
        text = json.dumps(body)
        n = int(re.search(r"has (\d+) steps? so far", text).group(1))  # type: ignore[union-attr]
        letter = FAIL_LETTERS[n - 1] if "doomed" in text else LETTERS[min(n, 19)]
        return chat_reply(chat_choice([(letter, {letter: 1.0})]))

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
            str(tmp_path / "out"),
            "--min-steps",
            "3",
            "--patience",
            "2",
        ]
        first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stderr
        calls = len(server.requests)
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert len(server.requests) == calls  # every prefix came from the cache
    assert "AUROC" in first.stdout and "recommended: --abort-below 0.05" in first.stdout
    assert "24 prefixes scored (24 from the cache" in second.stdout
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} >= {
        "eval_curves.csv",
        "eval_sweep.csv",
        "eval.json",
        "eval.png",
    }
    assert json.loads((out / "eval.json").read_text())["recommended"]["threshold"] == 0.05
    # Robot metrics beside the agent ones: successes rise letter by letter, so VOC is 1.
    assert (
        "Progress metrics (robot episodes or agent runs; 95% bootstrap over runs): VOC 1.00"
    ) in first.stdout
    assert "success AUROC at the run's end" in first.stdout
    robot = json.loads((out / "eval.json").read_text())["robot"]
    assert robot["voc"]["value"] == pytest.approx(1.0) and robot["end_auroc"]["n"] == 4


@pytest.mark.slow
@pytest.mark.timeout(
    960
)  # its eval subprocess may take 900 s on a loaded machine: the limit covers the test's own waits
def test_eval_on_real_recorded_runs_with_the_tiny_local_judge(tmp_path: Path) -> None:
    data = REPO.parent / "shared" / "data" / "terminal-bench-2.1"
    if not data.is_dir():
        pytest.skip("../shared/data is not on this machine")
    task = sorted(p for p in data.iterdir() if p.is_dir())[0]
    cmd = [
        sys.executable,
        "-m",
        "agent_monitor",
        "eval",
        str(task),
        "--judge",
        "local",
        "--min-mass",
        "0.05",
        "--max-steps",
        "3",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "AUROC" in done.stdout and (tmp_path / "eval.png").is_file()


def test_schedule_follows_recorded_time_scaled_and_capped() -> None:
    t0 = datetime(2026, 1, 1)
    a = RecordedRun(
        "a",
        "t",
        (
            RecordedStep("1", t0),
            RecordedStep("2", t0 + timedelta(seconds=4)),
            RecordedStep("3", t0 + timedelta(seconds=400)),
        ),
        1.0,
    )
    b = RecordedRun("b", "t", (RecordedStep("1"), RecordedStep("2")), None)
    plan = schedule([a, b], speed=2.0, interval_s=1.0, max_gap_s=30.0)
    when = {(p.run, p.kind, p.step): p.at for p in plan}
    assert (
        when[(0, "step", 1)] == 0.5 and when[(0, "step", 2)] == 2.5 and when[(0, "step", 3)] == 17.5
    )
    assert when[(1, "step", 2)] == 1.0
    assert [p.at for p in plan] == sorted(p.at for p in plan)
    assert run_id_for("trial: 3/x y") == "replay-trial:-3-x-y"


async def test_replay_publishes_recorded_runs_live_to_the_monitor(broker: Mosquitto) -> None:
    judge = FakeJudge()
    recorded = runs(2, 4)
    config = MonitorConfig(broker=BrokerSettings.from_url(broker.url), client_id="replay-mon")
    async with Monitor(config, judge=judge) as mon:

        def publish() -> list[str]:
            with MonitorClient(broker.url) as client:
                return list(replay(recorded, client, speed=200.0))

        published = await asyncio.to_thread(publish)

        async def finished() -> None:
            while len(mon.book.ended) < len(recorded):  # noqa: ASYNC110 - state of the monitor under test
                await asyncio.sleep(0.02)

        await asyncio.wait_for(finished(), 20)
    assert (
        sorted(published) == sorted(run_id_for(r.name) for r in recorded) == sorted(mon.book.ended)
    )
    # Every run was scored up to its last step before it finished.
    for r in recorded:
        last = [p for p in judge.prompts if r.task in p.prefix_text()]
        assert last and max(p.step for p in last) == 4
    assert mon.metrics.runs.labels("success")._value.get() == 2
    assert mon.metrics.runs.labels("failure")._value.get() == 2
