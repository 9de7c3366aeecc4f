"""The demo, as README's first command runs it (short mode): embedded broker, real tiny judge, plot at the end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_runs_to_the_end_and_leaves_the_plot(tmp_path: Path) -> None:
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
