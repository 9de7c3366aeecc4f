"""The Claude Code hook: recorded hook payloads on stdin, a private Mosquitto, and a fake monitor
over plain paho.

Most tests run the hook as Claude Code does, one `python -m agent_monitor.adapters.claude_code`
process per event; the long session walk-through calls the same handler in-process to stay fast.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from agent_monitor.adapters.claude_code import (
    Config,
    Hook,
    StateStore,
    main,
    settings_snippet,
    tool_step,
)
from tests import paths
from tests.brokers import Mosquitto, free_port, input_listener

FIXTURES = paths.FIXTURES / "adapters" / "claude_code"
SESSION = "2f1c7e0a-6b1d-4c8e-9a3f-5d2b8c7e1a90"
SETTINGS = paths.REPO / "adapters" / "claude_code_settings.json"
WAIT = 10.0


def payload(name: str, **changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data | changes


class FakeMonitor:
    """Plain paho in the monitor's seat: records start/step/end, and publishes signals (retained)
    on demand."""

    def __init__(self, port: int) -> None:
        self.msgs: list[tuple[str, str, Any]] = []  # (run_id, kind, body)
        self.cond = threading.Condition()
        self.c = input_listener(port, self._on_message, wait_s=WAIT)

    def _on_message(self, _c: mqtt.Client, _u: Any, m: mqtt.MQTTMessage) -> None:
        _, run_id, kind = m.topic.split("/")
        with self.cond:
            self.msgs.append((run_id, kind, json.loads(m.payload) if m.payload else {}))
            self.cond.notify_all()

    def wait(self, n: int, kind: str = "step", run_id: str = SESSION) -> list[Any]:
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.of(kind, run_id)) >= n, WAIT)
            assert ok, f"only {self.msgs}"
            return self.of(kind, run_id)

    def of(self, kind: str, run_id: str = SESSION) -> list[Any]:
        out = [b for r, k, b in self.msgs if r == run_id and k == kind]
        # MonitorClient stamps every start (what an outcome's HMAC signs): checked, set aside
        if kind == "start":
            assert all(isinstance(b.get("started_at"), float) for b in out), out
            out = [{k: v for k, v in b.items() if k != "started_at"} for b in out]
        return out

    def signal(
        self, run_id: str, signal: str = "abort", step: int = 1, score: float | None = 0.04
    ) -> None:
        body = {
            "run_id": run_id,
            "signal": signal,
            "reason": "score below 0.15 for 3 steps",
            "step": step,
        }
        body["score"] = score
        self.c.publish(
            f"agents/{run_id}/signal", json.dumps(body), qos=1, retain=True
        ).wait_for_publish(WAIT)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture
def fake(broker: Mosquitto) -> Any:
    f = FakeMonitor(broker.port)
    yield f
    f.close()


def hook_env(broker_url: str, state: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_MONITOR_")}
    return env | {
        "AGENT_MONITOR_BROKER": broker_url,
        "AGENT_MONITOR_CLAUDE_STATE": str(state),
        "AGENT_MONITOR_SIGNAL_WAIT": "0.2",
        "AGENT_MONITOR_CONNECT_TIMEOUT": "2",
        **extra,
    }


def run_hook(event: dict[str, Any], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One hook invocation, exactly as Claude Code makes it: the command, the payload on stdin."""
    return subprocess.run(
        [sys.executable, "-m", "agent_monitor.adapters.claude_code"],
        input=json.dumps(event),
        capture_output=True,
        text=True,
        env=env,
        timeout=20,
        check=False,
    )


# -- the hook as separate processes --


def test_session_as_hook_processes_publishes_numbered_steps(
    broker: Mosquitto, fake: FakeMonitor, tmp_path: Path
) -> None:
    env = hook_env(broker.url, tmp_path / "state", AGENT_MONITOR_POLICY='{"abort_below": 0.15}')
    for name in (
        "02_user_prompt_submit",
        "04_post_tool_use_bash",
        "05_pre_tool_use_read",
        "06_post_tool_use_read",
    ):
        done = run_hook(payload(name), env)
        assert done.returncode == 0, done.stderr
        assert done.stdout == ""  # stdout of UserPromptSubmit would be added to Claude's context
        assert done.stderr == ""
    steps = fake.wait(2)
    starts = fake.of("start")
    assert starts[0] == {
        "task": "The test test_add in tests/test_calc.py fails. Fix calc.py so that the "
        "whole test suite passes.",
        "policy": {"abort_below": 0.15},
    }
    # each process re-sends the identical start (ignored by the monitor)
    assert all(s == starts[0] for s in starts)
    assert [s["index"] for s in steps] == [1, 2]
    assert steps[0]["text"].startswith("$ python -m pytest -q\n-> F.")
    assert "1 failed, 1 passed in 0.03s" in steps[0]["text"] and steps[0]["meta"] == {
        "tool": "Bash"
    }
    assert steps[1]["text"].startswith(
        "Read /home/dev/calc/calc.py\n-> def add(a, b):\n    return a - b"
    )
    assert run_hook(payload("12_session_end"), env).returncode == 0
    assert fake.wait(1, "end") == [{}]


def test_abort_blocks_the_next_tool_call_with_exit_2_and_a_reason(
    broker: Mosquitto, fake: FakeMonitor, tmp_path: Path
) -> None:
    env = hook_env(broker.url, tmp_path / "state")
    assert run_hook(payload("02_user_prompt_submit"), env).returncode == 0
    assert run_hook(payload("04_post_tool_use_bash"), env).returncode == 0
    fake.wait(1)
    allowed = run_hook(payload("05_pre_tool_use_read"), env)
    assert (allowed.returncode, allowed.stdout, allowed.stderr) == (0, "", "")

    fake.signal(SESSION, "abort", step=1, score=0.04)
    blocked = run_hook(payload("07_pre_tool_use_edit"), env)
    assert blocked.returncode == 2 and blocked.stdout == ""
    assert blocked.stderr.startswith(
        "Blocked by agent-monitor: the progress monitor aborted this run at step 1 (score 0.04): "
        "score below 0.15 for 3 steps. Do not call more tools"
    )
    # Aborted is remembered: later calls are blocked without the broker, and their results are not
    # sent.
    broker.stop()
    again = run_hook(payload("09_pre_tool_use_bash"), env)
    assert again.returncode == 2 and "aborted this run at step 1" in again.stderr
    assert run_hook(payload("08_post_tool_use_edit"), env).returncode == 0
    state = json.loads((tmp_path / "state" / f"{SESSION}.json").read_text())
    assert state["aborted"] and state["next_index"] == 2
    assert [s["index"] for s in fake.of("step")] == [1]


def test_json_block_mode_denies_and_stops_claude(
    broker: Mosquitto, fake: FakeMonitor, tmp_path: Path
) -> None:
    env = hook_env(broker.url, tmp_path / "state", AGENT_MONITOR_CLAUDE_BLOCK="json")
    assert run_hook(payload("04_post_tool_use_bash"), env).returncode == 0
    fake.wait(1)
    fake.signal(SESSION, "abort", step=1, score=None)
    done = run_hook(payload("05_pre_tool_use_read"), env)
    assert done.returncode == 0 and done.stderr == ""
    answer = json.loads(done.stdout)
    reason = answer["hookSpecificOutput"]["permissionDecisionReason"]
    assert answer == {
        "continue": False,
        "stopReason": reason,
        "hookSpecificOutput": {
            "hookEventName": "PreToolUse",
            "permissionDecision": "deny",
            "permissionDecisionReason": reason,
        },
    }
    assert reason.startswith(
        "Blocked by agent-monitor: the progress monitor aborted this run at step 1: score below"
    )


def test_parallel_hook_processes_keep_indices_unique_and_gapless(
    broker: Mosquitto, fake: FakeMonitor, tmp_path: Path
) -> None:
    env = hook_env(broker.url, tmp_path / "state")
    assert run_hook(payload("02_user_prompt_submit"), env).returncode == 0
    events = [
        payload(
            "04_post_tool_use_bash",
            tool_input={"command": f"echo {i}"},
            tool_response={"stdout": f"{i}"},
        )
        for i in range(4)
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda e: run_hook(e, env), events))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    steps = fake.wait(4)
    assert sorted(s["index"] for s in steps) == [1, 2, 3, 4]
    assert sorted(s["text"] for s in steps) == sorted(f"$ echo {i}\n-> {i}" for i in range(4))
    assert json.loads((tmp_path / "state" / f"{SESSION}.json").read_text())["next_index"] == 5


def test_broker_down_and_bad_input_fail_open(tmp_path: Path) -> None:
    env = hook_env(f"mqtt://127.0.0.1:{free_port()}", tmp_path / "state")
    done = run_hook(payload("04_post_tool_use_bash"), env)
    assert done.returncode == 0 and done.stdout == ""
    assert "agent-monitor hook: could not reach the monitor at mqtt://127.0.0.1:" in done.stderr
    assert not (tmp_path / "state" / f"{SESSION}.json").exists()  # no index used up, no run started
    pre = run_hook(payload("03_pre_tool_use_bash"), env)
    assert (pre.returncode, pre.stdout) == (0, "")
    garbage = subprocess.run(
        [sys.executable, "-m", "agent_monitor.adapters.claude_code"],
        input="not json",
        capture_output=True,
        text=True,
        env=env,
        timeout=20,
        check=False,
    )
    assert garbage.returncode == 0 and "not the hook's JSON payload" in garbage.stderr
    bad_env = run_hook(payload("04_post_tool_use_bash"), env | {"AGENT_MONITOR_POLICY": "[1]"})
    assert (
        bad_env.returncode == 0 and "AGENT_MONITOR_POLICY must be a JSON object" in bad_env.stderr
    )


# -- the same handler in-process (fast): a whole recorded session --


def hook(broker_url: str, state: Path, **env: str) -> tuple[Hook, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    config = Config.from_env(hook_env(broker_url, state, **env))
    return Hook(config, out, err), out, err


def test_recorded_session_start_to_end(
    broker: Mosquitto, fake: FakeMonitor, tmp_path: Path
) -> None:
    h, out, err = hook(broker.url, tmp_path / "state")
    codes = [h.handle(json.loads(f.read_text())) for f in sorted(FIXTURES.glob("*.json"))]
    assert codes == [0] * 12 and out.getvalue() == "" and err.getvalue() == ""
    steps = fake.wait(4)
    assert [s["index"] for s in steps] == [1, 2, 3, 4]
    assert [s["meta"]["tool"] for s in steps] == [
        "Bash",
        "Read",
        "Edit",
        "mcp__github__create_issue",
    ]
    assert steps[2]["text"] == (
        "Edit /home/dev/calc/calc.py\n- def add(a, b):\n    return a - b\n+ def add(a, b):\n "
        "   return a + b"
    )  # the response's originalFile and patch are not sent again
    assert steps[3]["text"] == (
        'mcp__github__create_issue {"owner": "dev", "repo": "calc", "title": "add() subtracted"}\n'
        '-> [{"type": "text", "text": "{\\"number\\": 12, \\"url\\": '
        '\\"https://github.example/dev/calc/issues/12\\"}"}]'
    )
    assert fake.wait(1, "end") == [{}]
    state = json.loads((tmp_path / "state" / f"{SESSION}.json").read_text())
    assert state["ended"] and state["next_index"] == 5

    # The session is resumed later: its next prompt is a new run, numbered from 1.
    h.handle(payload("02_user_prompt_submit", prompt="Now also add a mul() function."))
    h.handle(payload("04_post_tool_use_bash"))
    resumed = fake.wait(1, run_id=f"{SESSION}.2")
    starts = fake.of("start", f"{SESSION}.2")
    assert starts and all(s == {"task": "Now also add a mul() function."} for s in starts)
    assert [s["index"] for s in resumed] == [1]


def test_prompts_after_the_first_are_steps_and_a_prompt_after_abort_starts_a_new_run(
    broker: Mosquitto, fake: FakeMonitor, tmp_path: Path
) -> None:
    h, _, err = hook(broker.url, tmp_path / "state")
    h.handle(payload("02_user_prompt_submit"))
    h.handle(payload("02_user_prompt_submit", prompt="Also keep sub() as it is."))
    assert fake.wait(1)[0] == {
        "index": 1,
        "text": "user: Also keep sub() as it is.",
        "ts": pytest.approx(time.time(), abs=60),
        "meta": {"event": "UserPromptSubmit"},
    }
    fake.signal(SESSION, "abort")
    assert h.handle(payload("03_pre_tool_use_bash")) == 2
    assert "aborted this run" in err.getvalue()
    h.handle(payload("02_user_prompt_submit", prompt="Try again, differently."))
    assert fake.wait(1, "end") == [{}]  # the aborted run is ended
    assert fake.wait(1, "start", f"{SESSION}.2")[0] == {"task": "Try again, differently."}
    assert h.handle(payload("03_pre_tool_use_bash")) == 0  # the new run has no abort


def test_lazy_start_and_task_from_the_environment(
    broker: Mosquitto, fake: FakeMonitor, tmp_path: Path
) -> None:
    h, _, _ = hook(broker.url, tmp_path / "a")
    h.handle(payload("01_session_start"))  # nothing to publish: no task yet
    h.handle(payload("04_post_tool_use_bash"))
    fake.wait(1)
    assert fake.of("start")[0] == {
        "task": "Complete the user's request in the Claude Code session in /home/dev/calc."
    }

    h2, _, _ = hook(
        broker.url,
        tmp_path / "b",
        AGENT_MONITOR_TASK="Fix calc.py",
        AGENT_MONITOR_CRITERIA="coding",
    )
    other = "0d9b7c52-1111-4222-8333-944455556666"
    h2.handle(payload("01_session_start", session_id=other))
    assert fake.wait(1, "start", other)[0] == {"task": "Fix calc.py", "criteria": "coding"}
    h2.handle(payload("02_user_prompt_submit", session_id=other))
    assert fake.wait(1, "step", other)[0]["text"].startswith("user: The test test_add")


def test_state_store_survives_garbage_and_prunes_old_sessions(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.path("s1").parent.mkdir(parents=True, exist_ok=True)
    store.path("s1").write_text("{not json")
    assert store.load("s1").next_index == 1 and not store.load("s1").started
    assert store.load("weird/../id").run_id == "weird-..-id"
    old = store.path("old")
    old.write_text("{}")
    os.utime(old, (time.time() - 30 * 86400,) * 2)
    store.prune()
    assert not old.exists() and store.path("s1").exists()


# -- step text and settings --


def test_tool_step_text() -> None:
    assert tool_step(
        "Bash", {"command": "ls"}, {"stdout": "a\nb\n", "stderr": "warn", "interrupted": True}
    ) == ("$ ls\n-> a\nb\nstderr: warn\n[interrupted]")
    assert tool_step("Bash", {"command": "true"}, {"stdout": "", "stderr": ""}) == (
        "$ true\n-> (no output)"
    )
    assert (
        tool_step("Write", {"file_path": "/x.py", "content": "print(1)"}, {"type": "create"})
        == "Write "
        "/x.py\nprint(1)"
    )
    assert tool_step(
        "Edit",
        {"file_path": "/x.py", "old_string": "a", "new_string": "b"},
        "File has not been read yet",
    ) == ("Edit /x.py\n- a\n+ b\n-> File has not been read yet")
    assert tool_step(
        "MultiEdit", {"file_path": "/x", "edits": [{"old_string": "1", "new_string": "2"}]}, {}
    ) == ("MultiEdit /x\n- 1\n+ 2")
    assert tool_step("Read", {"file_path": "/r"}, "plain text result") == (
        "Read /r\n-> plain text result"
    )
    assert tool_step("WebFetch", {"url": "https://e.x"}, None) == 'WebFetch {"url": "https://e.x"}'
    big = tool_step("Bash", {"command": "cat big"}, {"stdout": "x" * 50_000}, max_chars=1000)
    assert len(big) < 1200 and "characters cut" in big


def test_settings_snippet_file_matches_and_covers_the_handled_events(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shipped = json.loads(SETTINGS.read_text())
    assert shipped == settings_snippet()
    assert set(shipped["hooks"]) == {
        "SessionStart",
        "UserPromptSubmit",
        "PreToolUse",
        "PostToolUse",
        "SessionEnd",
    }
    for groups in shipped["hooks"].values():
        for group in groups:
            assert group["hooks"] == [
                {
                    "type": "command",
                    "command": "python -m agent_monitor.adapters.claude_code",
                    "timeout": 15,
                }
            ]
    assert main(["--print-settings", "--broker", "mqtt://10.0.0.5:1883"]) == 0
    assert json.loads(capsys.readouterr().out)["env"] == {
        "AGENT_MONITOR_BROKER": "mqtt://10.0.0.5:1883"
    }
