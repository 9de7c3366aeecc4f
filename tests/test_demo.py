"""The demo, as README's first command runs it (short mode): embedded broker, real tiny judge, plot at the end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.brokers import free_port


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_runs_to_the_end_and_leaves_the_plot(tmp_path: Path) -> None:
    port = str(free_port())  # 0 would turn /metrics off
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
