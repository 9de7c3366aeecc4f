"""The manual's in-process hook example (docs/hook.md), run as pasted: against a scripted server,
and with none."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.brokers import free_port
from tests.openai_server import chat_choice, chat_reply, scripted_server
from tests.paths import REPO

README = (REPO / "docs" / "hook.md").read_text(encoding="utf-8")
BLOCK = re.search(r"# The in-process hook\n\n```python\n(.*?)```", README, re.DOTALL)
DEFAULT_URL = "http://localhost:8000/v1"

pytestmark = pytest.mark.timeout(150)


def run(block: str, url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    assert DEFAULT_URL in block
    script = tmp_path / "hook.py"
    # only the server's address changes
    script.write_text(block.replace(DEFAULT_URL, url), encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )


def test_the_hook_example_runs_as_pasted_with_a_server(tmp_path: Path) -> None:
    assert BLOCK is not None
    with scripted_server() as s:
        s.default = chat_reply(chat_choice([("H", {"F": 0.3, "H": 0.6, "K": 0.1})]))
        done = run(BLOCK.group(1), s.url, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    first, letters = [line for line in done.stdout.splitlines() if not line.startswith("20")][:2]
    assert first.startswith("1 0.") and first.endswith("True None")
    assert "'H': 0.6" in letters


def test_the_hook_example_runs_as_pasted_when_the_scoring_fails(tmp_path: Path) -> None:
    """No server at all: a failed scoring, said in `p.error`, and no KeyError from the
    per-criterion line."""
    assert BLOCK is not None
    done = run(BLOCK.group(1), f"http://127.0.0.1:{free_port()}/v1", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # not the log's lines
    printed = [line for line in done.stdout.splitlines() if not line.startswith("20")]
    assert printed[0].startswith("1 None None False ") and "Traceback" not in done.stderr
    assert len(printed) == 1  # no letters printed for a failed scoring
