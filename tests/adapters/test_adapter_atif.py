"""The ATIF adapter: shipped fixtures (complete, converted, bare, broken), the real recorded runs
when present, and replay to a monitor over MQTT."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from agent_monitor import track
from agent_monitor.adapters.atif import (
    AtifError,
    AtifRun,
    AtifStep,
    iter_atif,
    load_atif,
    main,
    outcome_of,
    parse_atif,
    publish,
)
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import MonitorClient
from tests import paths
from tests.brokers import Mosquitto, input_listener

FIXTURES = paths.FIXTURES / "adapters"
GOOD = FIXTURES / "atif"
BROKEN = FIXTURES / "atif_broken"
DATA = paths.REPO.parent / "shared" / "data"
WAIT = 10.0


def test_harbor_v12_trajectory_with_timestamps_and_paired_tool_calls() -> None:
    run = load_atif(GOOD / "harbor_v12_success.json")
    assert run.name == "fizzbuzz__AbC1234" and run.outcome == "success" and run.reward == 1.0
    assert run.task == (
        "Write /app/fizzbuzz.py that prints FizzBuzz for 1..15, one per line, and run it."
    )
    assert run.schema_version == "ATIF-v1.2" and run.agent == "terminus-2 (gemini/gemini-2.5-pro)"
    # agent steps only; system and user are not steps
    assert [s.step_id for s in run.steps] == [3, 4, 5]
    first = run.steps[0].text
    # Message, then each call followed by the observation that answers it (by source_call_id, not
    # list order).
    assert first.startswith(
        "Analysis: /app is empty.\nPlan: write the script, then run it.\n$ cat > /app/fizzbuzz.py"
    )
    assert (
        first.index("$ cat >")
        < first.index("Observation:\nroot@box:/app# cat")
        < first.index("$ ls /app")
    )
    assert first.endswith("$ ls /app\nObservation:\nroot@box:/app# ls /app\nfizzbuzz.py")
    # A "$32" message is an unresolved exporter reference: dropped, the command and output stay.
    assert run.steps[1].text == (
        "$ python3 /app/fizzbuzz.py | tail -3\nObservation:\n13\n14\nFizzBuzz"
    )
    assert run.steps[2].text == (
        "The script prints the expected sequence; the task is complete.\nmark_task_complete({})"
    )
    assert run.steps[0].ts == pytest.approx(1761904810.0)  # 2025-10-31T10:00:10+00:00
    assert run.steps[1].ts == pytest.approx(1761904830.25)
    assert (
        run.steps[0].time is not None
        and run.steps[0].time.isoformat() == "2025-10-31T10:00:10+00:00"
    )
    assert run.texts == [s.text for s in run.steps]


def test_converted_trajectory_unwraps_json_shell_results_and_drops_empty_steps() -> None:
    run = load_atif(GOOD / "converted_failure.json")
    assert (
        run.outcome == "failure"
        and run.reward == 0.0
        and run.schema_version == "atif-converted-1.0"
    )
    assert all(s.ts is None for s in run.steps)
    assert [s.step_id for s in run.steps] == [2, 3, 4]  # step 5 has no message, calls or output
    assert run.steps[0].text == (
        "$ ls -la /app\nObservation:\ntotal 4\nserver.py\n[exit code 0]\n"
        "$ cat /app/server.py\nObservation:\nimport socket\nHOST = '0.0.0.0'\n"
        "[... 5120 characters elided ...]\nif __name__ == '__main__':\n    main()\n[exit code 0]"
    )
    assert run.steps[1].text.endswith(
        "No matching distribution found for grpcio==1.0.0.0\n[exit code 1]"
    )
    assert (
        run.steps[2].text == "$ python /app/server.py &\nObservation:\n[error: action was "
        "not executed]\n[exit code -1]"
    )


def test_bare_trajectory_with_list_content_string_arguments_and_no_reward() -> None:
    run = load_atif(GOOD / "bare_no_reward.json")
    assert (
        run.outcome is None
        and run.reward is None
        and run.name == "bare_no_reward"
        and run.agent == "my-agent"
    )
    assert run.task == "Rename the images in ./photos by date.\n[image]"
    assert [s.text for s in run.steps] == [
        'I will list the photos.\nlist_dir({"path": "photos"})\nObservation:\na.jpg\nb.jpg',
        # no observation
        'Renaming with exiftool.\nexif_rename({"dir": "photos", "pattern": "%Y%m%d"})',
        # no tool_calls
        "Checked: both files renamed.\nObservation:\n2026-01-01.jpg\n2026-01-02.jpg",
    ]
    assert run.steps[0].ts == pytest.approx(1767323045.0)  # "Z" suffix
    assert run.steps[1].ts is None  # an unreadable timestamp is no timestamp


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("truncated", "is not JSON"),
        ("array", "expected a JSON object, found list"),
        ("no_steps", "not an ATIF trajectory"),
        ("no_task", "no task"),
    ],
)
def test_broken_files_raise_atif_error_naming_the_problem(name: str, message: str) -> None:
    with pytest.raises(AtifError, match=message):
        load_atif(BROKEN / f"{name}.json")


def test_iter_atif_over_folders_sorted_with_skip_and_raise(tmp_path: Path) -> None:
    assert [r.name for r in iter_atif(GOOD)] == [
        "bare_no_reward",
        "kv-store__Xy98765",
        "fizzbuzz__AbC1234",
    ]
    assert [r.name for r in iter_atif(FIXTURES, on_error="skip")] == [
        "bare_no_reward",
        "kv-store__Xy98765",
        "fizzbuzz__AbC1234",
    ]
    with pytest.raises(AtifError):
        list(iter_atif(FIXTURES))
    with pytest.raises(AtifError, match="does not exist"):
        list(iter_atif(tmp_path / "nope"))
    with pytest.raises(AtifError, match="cannot read"):
        load_atif(tmp_path)
    (tmp_path / "latin1.json").write_bytes(b'{"task": "caf\xe9"}')
    with pytest.raises(AtifError, match="not UTF-8"):
        load_atif(tmp_path / "latin1.json")


def test_missing_and_odd_fields_are_tolerated() -> None:
    run = parse_atif(
        {
            "task_name": "hello",
            "verifier_result": {"rewards": {"reward": 0.25}},
            "trajectory": {
                "steps": [
                    {
                        "source": "agent",
                        "message": {"text": "dict content"},
                        "tool_calls": "not a list",
                    },
                    {
                        "source": "agent",
                        "tool_calls": [{"name": "noargs"}, "junk"],
                        "observation": {"results": "x"},
                    },
                    {
                        "source": "agent",
                        "tool_calls": [{"function_name": "f", "arguments": "not json"}],
                    },
                    {
                        "source": "agent",
                        "tool_calls": [{"arguments": {"cmd": "make"}}],
                        "observation": [{"content": 7}],
                    },
                    {"source": "agent", "timestamp": 1700000000, "message": "numeric ts"},
                ]
            },
        }
    )
    assert run.task == "Task: hello" and run.outcome == 0.25 and run.reward == 0.25
    assert [s.text for s in run.steps] == [
        "dict content",
        "noargs()",
        "f(not json)",
        "$ make\nObservation:\n7",
        "numeric ts",
    ]
    assert run.steps[4].ts == 1700000000.0
    clipped = parse_atif(
        {
            "task": "t",
            "trajectory": {
                "steps": [{"source": "agent", "message": "m", "observation": "y" * 500}]
            },
        },
        max_chars=100,
    )
    assert "characters cut" in clipped.steps[0].text and len(clipped.steps[0].text) < 200


@pytest.mark.parametrize(
    ("reward", "outcome"),
    [
        (1, "success"),
        (1.0, "success"),
        (0, "failure"),
        (True, "success"),
        (False, "failure"),
        (0.5, 0.5),
        (-1, -1.0),
        ("passed", "success"),
        ("FAIL", "failure"),
        ("0.75", 0.75),
        (None, None),
        (float("nan"), None),
        ("maybe", None),
        ({"x": 1}, None),
    ],
)
def test_outcome_of(reward: object, outcome: object) -> None:
    assert outcome_of(reward) == outcome


def test_steps_score_with_the_in_process_hook() -> None:
    run = load_atif(GOOD / "harbor_v12_success.json")
    judge = FakeJudge()
    try:
        curve = track(run.task, run.texts, judge=judge)
    finally:
        judge.close()
    assert [p.step for p in curve] == [1, 2, 3] and all(p.ok for p in curve)
    assert "$ python3 /app/fizzbuzz.py" in judge.prompts[1].text()


def test_cli_lists_runs_and_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(GOOD)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith(
        "fizzbuzz__AbC1234\t3 steps\toutcome=success\tWrite /app/fizzbuzz.py"
    )
    assert main([str(GOOD / "converted_failure.json"), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["outcome"] == "failure" and len(row["steps"]) == 3 and row["steps"][0]["ts"] is None
    assert main([str(FIXTURES)]) == 2
    assert "error:" in capsys.readouterr().err
    assert main([str(FIXTURES), "--skip-invalid"]) == 0


# -- the real recorded runs (../shared/data), when present --


def real_files() -> list[Path]:
    return sorted(DATA.rglob("*.json")) if DATA.is_dir() else []


@pytest.mark.skipif(not real_files(), reason="no recorded runs at ../shared/data")
def test_all_real_recorded_runs_parse_with_outcomes_matching_reward() -> None:
    files = real_files()
    assert len(files) == 32
    by_version: dict[str, int] = {}
    for f in files:
        raw = json.loads(f.read_text())
        run = load_atif(f)
        agent_steps = [s for s in raw["trajectory"]["steps"] if s["source"] == "agent"]
        assert run.outcome == {1: "success", 0: "failure"}[raw["reward"]], f
        assert run.reward == raw["reward"] and run.name == raw["trial_name"]
        assert (
            run.task
            == next(
                s["message"] for s in raw["trajectory"]["steps"] if s["source"] == "user"
            ).strip()
        )
        assert 0 < len(run.steps) <= len(agent_steps) and all(s.text.strip() for s in run.steps)
        assert all('Observation:\n{\n  "returncode"' not in s.text for s in run.steps), (
            "a JSON result not unwrapped"
        )
        version = run.schema_version or "?"
        by_version[version] = by_version.get(version, 0) + 1
        if version == "ATIF-v1.2":
            assert all(s.ts is not None for s in run.steps)
            assert [s.ts for s in run.steps] == sorted(s.ts for s in run.steps if s.ts is not None)
    assert by_version == {"ATIF-v1.2": 2, "atif-converted-1.0": 30}
    outcomes = [load_atif(f).outcome for f in files if "terminal-bench-2.1" in f.parts]
    assert (outcomes.count("success"), outcomes.count("failure")) == (16, 14)


# -- replay to a live monitor --


class Recorder:
    """A plain paho client in the monitor's seat: records inputs, optionally answers step N with
    an abort."""

    def __init__(self, port: int, abort_at: int | None = None) -> None:
        self.msgs: list[tuple[str, Any]] = []
        self.abort_at = abort_at
        self.cond = threading.Condition()
        self.c = input_listener(port, self._on_message, wait_s=WAIT)

    def _on_message(self, c: mqtt.Client, _u: Any, m: mqtt.MQTTMessage) -> None:
        body = json.loads(m.payload) if m.payload else {}
        with self.cond:
            self.msgs.append((m.topic, body))
            self.cond.notify_all()
        run_id, kind = m.topic.split("/")[1:3]
        if kind == "step" and body.get("index") == self.abort_at:
            sig = {
                "run_id": run_id,
                "signal": "abort",
                "reason": "hopeless",
                "step": body["index"],
                "score": 0.05,
            }
            c.publish(f"agents/{run_id}/signal", json.dumps(sig), qos=1, retain=True)

    def wait_end(self, run_id: str) -> list[tuple[str, Any]]:
        with self.cond:
            assert self.cond.wait_for(
                lambda: any(t == f"agents/{run_id}/end" for t, _ in self.msgs), WAIT
            )
            return [(t.rsplit("/", 1)[1], b) for t, b in self.msgs if t.split("/")[1] == run_id]

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def test_publish_replays_a_run_with_its_outcome(broker: Mosquitto) -> None:
    rec = Recorder(broker.port)
    try:
        run = load_atif(GOOD / "harbor_v12_success.json")
        with MonitorClient(broker.url, connect_timeout=5) as client:
            live, sent = publish(run, client, policy={"abort_below": 0.2})
        assert sent == 3 and live.run_id == "fizzbuzz__AbC1234"
        msgs = rec.wait_end("fizzbuzz__AbC1234")
        assert [k for k, _ in msgs] == ["start", "step", "step", "step", "end"]
        start = dict(msgs[0][1])
        # MonitorClient stamps every start (what an outcome's or a group's HMAC signs with the run
        # id).
        assert isinstance(start.pop("started_at"), float)
        assert start == {"task": run.task, "policy": {"abort_below": 0.2}}
        assert [b["text"] for k, b in msgs if k == "step"] == run.texts
        assert [b["index"] for k, b in msgs if k == "step"] == [1, 2, 3]
        assert msgs[-1][1] == {"outcome": "success"}
    finally:
        rec.close()


def test_publish_paces_by_timestamps_and_stops_on_abort(broker: Mosquitto) -> None:
    rec = Recorder(broker.port, abort_at=2)
    steps = tuple(AtifStep(f"step {i}", ts=1000.0 + i) for i in range(1, 41))
    run = AtifRun(name="long run/with spaces", task="t", steps=steps, outcome="failure")
    try:
        with MonitorClient(broker.url, connect_timeout=5) as client:
            live, sent = publish(run, client, speed=20.0)  # 1 s apart -> 50 ms apart
        assert live.run_id == "long-run-with-spaces" and live.should_abort
        assert 2 <= sent < 10, sent  # stopped within a few steps of the abort
        msgs = rec.wait_end("long-run-with-spaces")
        assert len([k for k, _ in msgs if k == "step"]) == sent
        assert msgs[-1] == ("end", {})  # stopped by the monitor: no outcome claimed
    finally:
        rec.close()


def test_cli_replays_to_a_broker(broker: Mosquitto, capsys: pytest.CaptureFixture[str]) -> None:
    rec = Recorder(broker.port)
    try:
        assert (
            main(
                [
                    str(GOOD / "converted_failure.json"),
                    "--broker",
                    broker.url,
                    "--abort-below",
                    "0.1",
                ]
            )
            == 0
        )
        assert capsys.readouterr().out.strip() == (
            "kv-store__Xy98765\t3/3 steps sent\toutcome=failure"
        )
        msgs = rec.wait_end("kv-store__Xy98765")
        assert msgs[0][1]["policy"] == {"abort_below": 0.1} and msgs[-1][1] == {
            "outcome": "failure"
        }
    finally:
        rec.close()
    assert main([str(GOOD), "--broker", "mqtt://127.0.0.1:1"]) == 2
    assert "cannot connect" in capsys.readouterr().err
