"""Crash recovery: the daemon is SIGKILLed mid-run (once exactly between receiving a step and
journaling it), restarted, and the run goes on with every step once, in order, and a continuous
score curve."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent_monitor.scale import LETTERS
from agent_monitor.wire import MonitorClient
from tests.brokers import Mosquitto
from tests.openai_server import Reply, chat_choice, chat_reply, scripted_server

pytestmark = pytest.mark.timeout(180)


def steps_judge(body: dict[str, Any]) -> Reply:
    """Grade by how many steps the prompt holds: step n scores n/19, so a daemon that lost steps
    scores lower."""
    n = int(re.search(r"has (\d+) steps? so far", json.dumps(body)).group(1))  # type: ignore[union-attr]
    letter = LETTERS[min(n, 19)]
    return chat_reply(chat_choice([(letter, {letter: 1.0})]))


def start(args: list[str], log: Path, *, crash_at: int | None = None) -> subprocess.Popen[bytes]:
    cmd = (
        [sys.executable, "tests/crash_daemon.py", str(crash_at), *args]
        if crash_at
        else [sys.executable, "-m", "agent_monitor", *args]
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("ab"))
    deadline = time.monotonic() + 60
    while (
        "agent-monitor: serving" not in log.read_text(errors="replace").split("---restart---")[-1]
    ):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the daemon did not start: {log.read_text(errors='replace')}")
        time.sleep(0.05)
    return proc


def test_sigkill_mid_run_loses_no_step(broker: Mosquitto, tmp_path: Path) -> None:
    state, log = tmp_path / "state", tmp_path / "daemon.log"
    with scripted_server() as judge:
        judge.default = steps_judge
        serve = [
            "serve",
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
            "--judge-model",
            "m",
            "--metrics-port",
            "0",
            "--state-dir",
            str(state),
            "--client-id",
            "crash-monitor",
            "--hold",
            "60",
        ]
        # First life: dies on receiving step 5, before journaling (and so before acknowledging) it.
        a = start(serve, log, crash_at=5)
        with MonitorClient(broker.url) as mon:
            run = mon.start_run("crash-1", task="Count from one to twelve, one step at a time.")
            for i in range(1, 5):
                run.step(f"said {i}")
                assert run.wait_progress(i, timeout=20).step == i
            run.step("said 5")
            assert a.wait(20) == -9  # SIGKILL
            # the harness goes on: the broker queues these for the monitor's session
            for i in range(6, 9):
                run.step(f"said {i}")

            # Second life: rebuilt from the store; step 5 comes again from the broker (never
            # acknowledged).
            log.open("a").write("---restart---\n")
            b = start(serve, log)
            assert run.wait_progress(8, timeout=30).step == 8
            run.step("said 9")
            run.step("said 10")
            b.kill()  # steps still arriving
            b.wait(10)
            run.step("said 11")
            run.step("said 12")

            # Third life.
            log.open("a").write("---restart---\n")
            c = start(serve, log)
            final = run.wait_progress(12, timeout=30)
            run.end("success")
            time.sleep(0.5)
        c.terminate()
        c.wait(15)

    # The harness saw its last step scored as the 12th: the monitor had every step.
    assert final.step == 12 and final.score == pytest.approx(12 / 19)
    out = subprocess.run(
        [sys.executable, "-m", "agent_monitor", "export", "crash-1", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        check=True,
    )
    exported = json.loads(out.stdout)
    assert [s["index"] for s in exported["steps"]] == list(range(1, 13))
    assert [s["text"] for s in exported["steps"]] == [f"said {i}" for i in range(1, 13)]
    assert exported["outcome"] == "success"
    curve = exported["curve"]
    steps = [p["step"] for p in curve]
    assert steps == sorted(set(steps)) and steps[-1] == 12
    # Continuous: every score says the daemon held exactly as many steps as the step number (no
    # restart at 1).
    assert all(p["ok"] and p["score"] == pytest.approx(p["step"] / 19) for p in curve)
    logs = log.read_text()
    assert logs.count('"event": "runs_restored"') == 2
    listed = subprocess.run(
        [sys.executable, "-m", "agent_monitor", "runs", "--state-dir", str(state)],
        capture_output=True,
        text=True,
    )
    assert "crash-1" in listed.stdout and "success" in listed.stdout
